"""B4 — transport: (1) trajectories/s and MB/s through the broker (the bus's zstd producer, a
raw consumer) for trajectories of realistic size, against encoding + decoding alone; (2)
weight-sync latency as the node does it (the trainer streams safetensors in the engines'
dtype, hashing as it writes; a WeightVersion over the broker; the engine reads the file once,
checks its BLAKE3 digest and loads it) against a raw safetensors save + load of the same weights in
the same dtype and directory (/dev/shm when it exists, as the learner uses), and against the
floor of a verified sync: that raw save + load, the file's BLAKE3 on both sides and the copy
into the engine's parameters, each done once and directly. Interleaved rounds. Writes bench/results/transport.{json,md}.

    python bench/transport.py [--trajectories 300] [--turns 4] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from bench_common import write_results

from rlnode.bus import Bus
from rlnode.bus.localbroker import LocalBroker
from rlnode.bus.settings import KafkaSettings
from rlnode.engine.base import check_digest
from rlnode.engine.torch_engine import TorchEngine
from rlnode.messages import ParityProbe, TokenTurn, TrainingSpec, Trajectory, WeightVersion, topics
from rlnode.messages.codec import decode, encode
from rlnode.models.build import init_tiny_model
from rlnode.training.trainer import WEIGHT_DTYPES, Trainer, TrainerConfig


def trajectory(job_id: str, turns: int, prompt: int, completion: int, rng: random.Random):
    return Trajectory(
        job_id=job_id,
        org_id="bench",
        work_id=uuid.uuid4(),
        rollout_id=uuid.uuid4().hex,
        generator="bench",
        step=0,
        group_id="0/0",
        seed=0,
        sample_index=0,
        status="ok",
        reward=rng.random(),
        turns=[
            TokenTurn(
                prompt_ids=[rng.randrange(150_000) for _ in range(prompt * (t + 1))],
                completion_ids=[rng.randrange(150_000) for _ in range(completion)],
                logprobs=[-rng.random() * 5 for _ in range(completion)],
                policy_version=0,
                finish_reason="stop",
            )
            for t in range(turns)
        ],
    )


async def through_broker(settings: KafkaSettings, batch: list[Trajectory]) -> float:
    bus = Bus(settings, service="bench")
    await bus.start()
    reader = bus.reader(topics.TRAJECTORIES, from_beginning=False)
    await reader.start()  # positioned at the end before we publish
    try:
        wanted = {str(t.id) for t in batch}
        started = time.perf_counter()
        await asyncio.gather(*(bus.publish(t) for t in batch))
        while wanted:
            for record in await reader.fetch(timeout_ms=1000):
                wanted.discard(str(decode(record.value, Trajectory).id))
        return time.perf_counter() - started
    finally:
        await reader.stop()
        await bus.stop()


def codec_only(batch: list[Trajectory]) -> float:
    started = time.perf_counter()
    for t in batch:
        decode(encode(t), Trajectory)
    return time.perf_counter() - started


async def weight_sync(
    settings: KafkaSettings, trainer: Trainer, engine: TorchEngine, path: Path, dtype: str
):
    """Publish -> received -> digest checked -> loaded; seconds."""
    bus = Bus(settings, service="bench-weights")
    arrived: asyncio.Queue = asyncio.Queue()

    async def on_version(version: WeightVersion, _delivery) -> None:
        await arrived.put(version)

    # Subscribed as a generator is (services/rlnode_services/rollout_generator/app.py): its
    # rollout path polls every rollout_fetch_max_wait_ms (KAFKA_ROLLOUT_FETCH_MAX_WAIT_MS).
    bus.subscribe(
        topics.WEIGHT_VERSIONS,
        on_version,
        group_id=None,
        from_beginning=False,
        fetch_max_wait_ms=settings.rollout_fetch_max_wait_ms,
    )
    await bus.start()
    try:
        job = f"bench-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        digest, size = await asyncio.to_thread(trainer.save_weights, path, dtype)
        written = time.perf_counter()
        await bus.publish(
            WeightVersion(
                job_id=job,
                org_id="bench",
                version=1,
                step=1,
                uri=path.as_uri(),
                blake3=digest,
                size_bytes=size,
                dtype=dtype,
                probe=ParityProbe(token_ids=[0, 1], logprobs=[0.0]),
            )
        )
        while True:
            version = await arrived.get()
            if version.job_id == job:
                break
        received = time.perf_counter()
        await engine.load_weights(path, 1, version.blake3)
        ended = time.perf_counter()
        # The load's digest check alone (the same read of the file's pages), to split it.
        check_started = time.perf_counter()
        check_digest(path, None, version.blake3)
        parts = {
            "write_s": written - started,
            "bus_s": received - written,
            "load_s": ended - received,
            "check_s": time.perf_counter() - check_started,
        }
        return ended - started, size, parts
    finally:
        await bus.stop()


def _saved_state(trainer: Trainer, dtype: str) -> dict:
    """The trainer's tensors in `dtype`, tied ones as copies (safetensors refuses shared)."""
    state = {k: v.detach().to(WEIGHT_DTYPES[dtype]) for k, v in trainer.model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    return state


def raw_save_load(trainer: Trainer, path: Path, dtype: str) -> float:
    """safetensors' own save + load of the same tensors (tied ones once, as it requires)."""
    from safetensors.torch import load_file, save_file

    started = time.perf_counter()
    state = _saved_state(trainer, dtype)
    save_file(state, str(path))
    load_file(str(path))
    return time.perf_counter() - started


def floor_save_load(trainer: Trainer, engine: TorchEngine, path: Path, dtype: str) -> float:
    """The raw save + load with what any verified sync adds to it, each done once and
    directly: the file's BLAKE3 on the writer's side and again on the reader's (an engine
    loads only the bytes the version names; a Task App on the node may write where it
    reads), and the loaded tensors copied into the engine's parameters (a raw load only
    returns them). The floor that weight sync is measured against besides the raw."""
    import blake3
    from safetensors.torch import load_file, save_file

    def digest() -> str:
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        hasher.update_mmap(path)
        return hasher.hexdigest()

    started = time.perf_counter()
    state = _saved_state(trainer, dtype)
    save_file(state, str(path))
    written = digest()
    loaded = load_file(str(path))
    check_digest(path, None, written)
    engine.model.load_state_dict(loaded, strict=False)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trajectories", type=int, default=300)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="per turn, growing")
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="of the weights"
    )
    args = parser.parse_args()
    shared_memory = Path("/dev/shm")
    weights_dir = shared_memory if shared_memory.is_dir() else None
    rng = random.Random(0)
    batch = [
        trajectory("bench-traj", args.turns, args.prompt_tokens, args.completion_tokens, rng)
        for _ in range(args.trajectories)
    ]
    record_bytes = statistics.fmean(len(encode(t)) for t in batch)
    runs: dict[str, list[float]] = {
        "broker_s": [],
        "codec_s": [],
        "sync_s": [],
        "raw_s": [],
        "floor_s": [],
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=weights_dir) as weights,
        LocalBroker(Path(tmp) / "broker") as broker,  # open (PLAINTEXT, no users): the bus alone
    ):
        settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        from rlnode.bus import ensure_topics

        asyncio.run(ensure_topics(settings))
        model = init_tiny_model(
            Path(tmp) / "m", seed=0, hidden=args.hidden, layers=args.layers, heads=8
        )
        trainer = Trainer(model, TrainerConfig.of(TrainingSpec()))
        engine = TorchEngine(model, dtype="float32")
        weights_bytes = 0
        for round_ in range(args.repeats):
            seconds = asyncio.run(through_broker(settings, batch))
            runs["broker_s"].append(seconds)
            runs["codec_s"].append(codec_only(batch))
            sync, weights_bytes, parts = asyncio.run(
                weight_sync(
                    settings, trainer, engine, Path(weights) / f"w{round_}.safetensors", args.dtype
                )
            )
            runs["sync_s"].append(sync)
            for name, part_s in parts.items():
                runs.setdefault(f"sync_{name}", []).append(part_s)
            runs["raw_s"].append(
                raw_save_load(trainer, Path(weights) / "raw.safetensors", args.dtype)
            )
            runs["floor_s"].append(
                floor_save_load(trainer, engine, Path(weights) / "floor.safetensors", args.dtype)
            )
            print(
                f"round {round_ + 1}: broker {args.trajectories / seconds:.0f} traj/s, "
                f"weight sync {sync * 1000:.0f} ms vs raw {runs['raw_s'][-1] * 1000:.0f} ms, "
                f"floor {runs['floor_s'][-1] * 1000:.0f} ms",
                flush=True,
            )
    m = {k: statistics.median(v) for k, v in runs.items()}
    mb = args.trajectories * record_bytes / 1e6
    table = [
        f"Trajectories: {args.turns} turns, {args.prompt_tokens}-token prompts growing per turn, "
        f"{args.completion_tokens}-token completions: {record_bytes / 1024:.0f} KiB of JSON each "
        "(zstd on the wire).",
        "",
        "| measure | median | runs |",
        "|---|---|---|",
        f"| through the broker | {args.trajectories / m['broker_s']:.0f} trajectories/s, {mb / m['broker_s']:.1f} MB/s (uncompressed) | "
        + ", ".join(f"{args.trajectories / s:.0f}" for s in runs["broker_s"])
        + " |",
        f"| encode + decode only | {args.trajectories / m['codec_s']:.0f} trajectories/s | "
        + ", ".join(f"{args.trajectories / s:.0f}" for s in runs["codec_s"])
        + " |",
        f"| weight sync ({weights_bytes / 1e6:.0f} MB, {args.dtype}): write + BLAKE3 + publish + receive + check + load | {m['sync_s'] * 1000:.0f} ms | "
        + ", ".join(f"{s * 1000:.0f}" for s in runs["sync_s"])
        + " |",
        f"| raw safetensors save + load of the same weights | {m['raw_s'] * 1000:.0f} ms | "
        + ", ".join(f"{s * 1000:.0f}" for s in runs["raw_s"])
        + " |",
        f"| the floor: the raw save + load, BLAKE3 of the file on both sides, the loaded tensors copied into the engine's model | {m['floor_s'] * 1000:.0f} ms | "
        + ", ".join(f"{s * 1000:.0f}" for s in runs["floor_s"])
        + " |",
        "",
        f"Weight sync / raw save+load: **{m['sync_s'] / m['raw_s']:.2f}x**; / the floor: "
        f"**{m['sync_s'] / m['floor_s']:.2f}x**. Its parts (medians): "
        f"the trainer's write with BLAKE3 while writing {m['sync_write_s'] * 1000:.0f} ms, "
        f"publish to receipt through the broker {m['sync_bus_s'] * 1000:.0f} ms, the engine's "
        f"load {m['sync_load_s'] * 1000:.0f} ms, of which its BLAKE3 check of the file "
        f"about {m['sync_check_s'] * 1000:.0f} ms (measured alone on the same file).",
    ]
    write_results(
        "transport",
        args,
        "B4: transport through the broker and weight-sync latency",
        table,
        runs=runs,
        record_bytes=record_bytes,
    )


if __name__ == "__main__":
    main()
