"""B13: a node over several hosts (issue #28), on test hosts made on this machine (network
namespaces joined by a bridge, each with a tmpfs of its own over the weights directory:
rlnode.node.testhosts).

- `fetch`: a weight version fetched over HTTP from the learner by a generator on another host
  (streamed, BLAKE3 checked as it arrives, written to its own tmpfs) against the same
  engine loading it from shared memory, for SmolLM2-135M's float32 weights (538 MB) and the
  qwen2.5-0.5b preset (random weights, its published shape).
- `scaling`: rollouts/s of the copy-task job with the learner on host A and generators on
  1, 2 and 3 other hosts.
- `host-copies`: N generator processes of one host getting one SmolLM2 version from the
  learner's weights route (on loopback): sharing the host's download directory (one
  download, the others link it) against a directory each (a download each, as N hosts
  would): time until all N hold it, downloads, bytes held in memory.

The namespaces share this machine's two cores: more generator hosts add no compute here, so
the scaling curve shows what spreading work over hosts costs (weights fetched per host per
version, consumer-group rebalances, calls across the bridge), not what more machines gain.

    python bench/multihost.py [--parts fetch,scaling,host-copies] [--hosts 1,2,3] [--steps 12]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import write_results

from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node import testhosts
from rlnode.node.roles import join_path
from rlnode.node.testhosts import HostProcess, User


def rollouts_per_s(events: list, samples_per_step: int) -> tuple[float, float]:
    """(samples/s over the steps after the first, mean s/step): the first step carries the
    engines' start and the first weight fetches."""
    steps = sorted((e.data["step"], e.ts) for e in events if e.type == JobEventType.TRAIN_STEP)
    if len(steps) < 3:
        raise RuntimeError(f"only {len(steps)} train.step events")
    (first_step, first_ts), (last_step, last_ts) = steps[0], steps[-1]
    seconds = (last_ts - first_ts).total_seconds()
    per_step = seconds / (last_step - first_step)
    return samples_per_step / per_step, per_step


def models(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    from rlnode.models.build import init_model
    from rlnode.models.catalogue import packaged_gguf
    from rlnode.models.gguf import import_gguf

    chosen = {}
    for name in args.models.split(","):
        if name == "smollm2":
            gguf = packaged_gguf("smollm2-135m-instruct")
            chosen[name] = import_gguf(gguf, root / "models").path
        else:
            chosen[name] = init_model(root / name, preset=name, seed=0)
    return chosen


def fetch(args: argparse.Namespace, root: Path) -> list[dict]:
    """A short job per model with a generator beside the learner on host A (shared memory)
    and one on host B (over HTTP): each reports how long it took to get and load every
    version in `weights.loaded`."""
    rows = []
    for name, model in models(args, root).items():
        with testhosts.TestNetwork() as net, ExitStack() as stack:
            weights = root / f"weights-{name}"
            weights.mkdir()
            a, b = net.add_host("a"), net.add_host("b")
            control = HostProcess(a, root / f"{name}-a", [], weights)  # every role
            stack.callback(control.stop)
            control.wait_up(300)
            other = HostProcess(
                b,
                root / f"{name}-b",
                ["--role", "inference", "--join", str(join_path(control.data_dir))],
                weights,
            )
            stack.callback(other.stop)
            other.wait_up(300)
            user = User.create(control)
            user.register_example_task_app("arithmetic", "arithmetic")
            config = example_job(
                "arithmetic_smollm2",
                model,
                steps=args.fetch_steps,
                prompts_per_step=8,
                group_size=2,
                max_async=0,
                checkpoint_every=1000,
                weight_sync_every=1,
            )
            config = config.model_copy(
                update={
                    "eval": None,
                    "sampling": config.sampling.model_copy(update={"max_tokens": 8}),
                }
            )
            job_id = user.start(config)
            done = user.wait_for_end(job_id, 3600)
            if done["status"] != "completed":
                raise RuntimeError(f"{name}: the job ended {done}")
            events = user.events(job_id)
            published = [e.data for e in events if e.type == JobEventType.WEIGHTS_PUBLISHED]
            loads = [e.data for e in events if e.type == JobEventType.WEIGHTS_LOADED]
            size = max((d.get("size_bytes", 0) for d in published), default=0)
            row: dict = {"model": name, "size_mb": round(size / 1e6), "loads": {}}
            for transport in ("shared-memory", "http"):
                mine = [d for d in loads if d["transport"] == transport]
                if not mine:
                    continue
                row["loads"][transport] = {
                    "versions": len(mine),
                    "fetch_s": round(statistics.median(d["fetch_s"] for d in mine), 3),
                    "load_s": round(statistics.median(d["load_s"] for d in mine), 3),
                }
            rows.append(row)
            print(row, flush=True)
    return rows


def scaling(args: argparse.Namespace, root: Path) -> list[dict]:
    model = init_tiny_model(root / "tiny", seed=0)
    rows = []
    for count in [int(n) for n in args.hosts.split(",")]:
        with testhosts.TestNetwork() as net, ExitStack() as stack:
            weights = root / f"weights-{count}"
            weights.mkdir()
            control_host = net.add_host("a")
            control = HostProcess(
                control_host, root / f"{count}-a", ["--role", "control,training"], weights
            )
            stack.callback(control.stop)
            control.wait_up(180)
            generators = []
            for index in range(count):
                host = net.add_host(f"g{index}")
                process = HostProcess(
                    host,
                    root / f"{count}-g{index}",
                    ["--role", "inference", "--join", str(join_path(control.data_dir))],
                    weights,
                    env={"GENERATOR_CONCURRENCY": "64", "GENERATOR_MAX_BATCH_SIZE": "64"},
                )
                stack.callback(process.stop)
                generators.append(process)
            for process in generators:
                process.wait_up(180)
            user = User.create(control)
            user.register_example_task_app("copy", "copy_task")
            config = example_job(
                "copy_task",
                model,
                steps=args.steps,
                prompts_per_step=args.prompts,
                group_size=args.group,
                max_async=1,
                checkpoint_every=1000,
            )
            job_id = user.start(config)
            done = user.wait_for_end(job_id, 1200)
            if done["status"] != "completed":
                raise RuntimeError(f"{count} host(s): the job ended {done}")
            events = user.events(job_id)
            rate, per_step = rollouts_per_s(events, args.prompts * args.group)
            loads = [e.data for e in events if e.type == JobEventType.WEIGHTS_LOADED]
            fetches = [d.get("fetch_s") or 0.0 for d in loads]
            rows.append(
                {
                    "hosts": count,
                    "samples_per_s": round(rate, 1),
                    "s_per_step": round(per_step, 3),
                    "weight_loads": len(loads),
                    "transports": sorted({d.get("transport", "?") for d in loads}),
                    "fetch_s_median": round(statistics.median(fetches), 4) if fetches else None,
                }
            )
            print(rows[-1], flush=True)
    return rows


def _generator(settings: dict, version_json: str, go, results) -> None:
    """One generator process of the host: waits for `go`, then gets the version."""
    from rlnode.messages import WeightVersion
    from rlnode_services.rollout_generator.fetch import WeightsFetcher
    from rlnode_services.rollout_generator.settings import GeneratorSettings

    fetcher = WeightsFetcher(GeneratorSettings(**settings))
    version = WeightVersion.model_validate_json(version_json)
    go.wait()
    fetched = asyncio.run(fetcher.fetch(version))
    results.put((time.perf_counter(), fetched.reused, fetched.seconds))


def host_copies(args: argparse.Namespace, root: Path) -> list[dict]:
    import blake3
    from fastapi import FastAPI
    from nacl.signing import SigningKey

    from rlnode.messages import ParityProbe, WeightVersion
    from rlnode.service.auth import Scope, TokenClaims, TokenVerifier, sign_token
    from rlnode.service.http import install_error_handlers
    from rlnode.testing import ThreadedServer
    from rlnode_services.learner.weights import PublishedWeights, weights_router

    (model,) = models(argparse.Namespace(models="smollm2"), root).values()
    store = root / "learner-store"
    file = store / "acme" / "job" / "v000001.safetensors"
    file.parent.mkdir(parents=True)
    shutil.copyfile(next(model.glob("*.safetensors")), file)
    version = WeightVersion(
        job_id="job",
        org_id="acme",
        version=1,
        step=1,
        uri=file.as_uri(),
        blake3=blake3.blake3(file.read_bytes(), max_threads=blake3.blake3.AUTO).hexdigest(),
        size_bytes=file.stat().st_size,
        dtype="float32",
        probe=ParityProbe(token_ids=[1, 2], logprobs=[0.0]),
    )
    published = PublishedWeights()
    published.note(version)
    key = SigningKey.generate()
    app = FastAPI()
    app.state.verifier = TokenVerifier(key.verify_key)
    install_error_handlers(app)
    app.include_router(weights_router(published, [store]))
    now = int(time.time())
    claims = TokenClaims(
        f"t_{uuid.uuid4().hex[:12]}", "service", "rollout-generator", None,
        frozenset({Scope.WEIGHTS_READ}), now, now + 3600, "k",
    )  # fmt: skip
    token = sign_token(key, claims)
    memory = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
    context = multiprocessing.get_context("spawn")
    rows = []
    with ThreadedServer(app) as server:
        for repeat in range(args.repeats):
            for mode in ("shared", "separate") if repeat % 2 == 0 else ("separate", "shared"):
                host = Path(tempfile.mkdtemp(prefix="rlnode-b13-", dir=memory))
                try:
                    go, results = context.Event(), context.Queue()
                    processes = []
                    for index in range(args.generators):
                        directory = host if mode == "shared" else host / f"own-{index}"
                        settings = {
                            "generator_id": f"gen{index}",
                            "weights_url": server.url,
                            "weights_dir": str(directory),
                            "service_token": token,
                            "weights_fetch_timeout_s": 120.0,
                        }
                        process = context.Process(
                            target=_generator,
                            args=(settings, version.model_dump_json(), go, results),
                        )
                        process.start()
                        processes.append(process)
                    time.sleep(3)  # every process imported and waiting
                    started = time.perf_counter()
                    go.set()
                    done = [results.get(timeout=600) for _ in processes]
                    for process in processes:
                        process.join(30)
                    held = {
                        (p.stat().st_dev, p.stat().st_ino): p.stat().st_size
                        for p in host.rglob("*.safetensors")
                    }
                    rows.append(
                        {
                            "mode": mode,
                            "generators": args.generators,
                            "size_mb": round(version.size_bytes / 1e6),
                            "all_hold_it_s": round(max(t for t, _, _ in done) - started, 3),
                            "downloads": sum(not reused for _, reused, _ in done),
                            "held_mb": round(sum(held.values()) / 1e6),
                        }
                    )
                    print(rows[-1], flush=True)
                finally:
                    shutil.rmtree(host, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="fetch,scaling,host-copies")
    parser.add_argument("--hosts", default="1,2,3", help="generator hosts per scaling run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--models", default="smollm2,qwen2.5-0.5b", help="for the fetch part")
    parser.add_argument("--fetch-steps", type=int, default=3)
    parser.add_argument("--generators", type=int, default=3, help="for the host-copies part")
    parser.add_argument("--repeats", type=int, default=2, help="for the host-copies part")
    args = parser.parse_args()
    why = testhosts.available()
    if why and {"fetch", "scaling"} & set(args.parts.split(",")):
        print(f"bench/multihost.py needs test hosts: {why}", file=sys.stderr)
        return 2
    parts = args.parts.split(",")
    result: dict = {}
    table: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rlnode-b13-") as tmp:
        root = Path(tmp)
        if "fetch" in parts:
            rows = fetch(args, root)
            result["fetch"] = rows
            table += [
                "| model | version | shared memory: load s | over HTTP: fetch s | "
                "over HTTP: load s | HTTP fetch + load vs shared-memory load |",
                "|---|---|---|---|---|---|",
            ]
            for r in rows:
                shm, http = r["loads"].get("shared-memory"), r["loads"].get("http")
                if not (shm and http):
                    table.append(f"| {r['model']} | {r['size_mb']} MB | missing: {r['loads']} |")
                    continue
                ratio = (http["fetch_s"] + http["load_s"]) / shm["load_s"]
                table.append(
                    f"| {r['model']} | {r['size_mb']} MB | {shm['load_s']} | {http['fetch_s']} "
                    f"| {http['load_s']} | {ratio:.2f}x |"
                )
            table.append("")
        if "scaling" in parts:
            rows = scaling(args, root)
            result["scaling"] = rows
            base = rows[0]["samples_per_s"]
            table += [
                "| generator hosts | samples/s | vs 1 host | s/step | weight loads | how | "
                "fetch s (median) |",
                "|---|---|---|---|---|---|---|",
                *(
                    f"| {r['hosts']} | {r['samples_per_s']} | {r['samples_per_s'] / base:.2f}x | "
                    f"{r['s_per_step']} | {r['weight_loads']} | {', '.join(r['transports'])} | "
                    f"{r['fetch_s_median']} |"
                    for r in rows
                ),
            ]
        if "host-copies" in parts:
            rows = host_copies(args, root)
            copies_table = [
                f"{args.generators} generator processes of one host, one SmolLM2 version each "
                "(median of the repeats):",
                "",
                "| download directory | all hold it (s) | vs shared | downloads | held in memory |",
                "|---|---|---|---|---|",
            ]
            medians = {}
            for mode in ("shared", "separate"):
                mine = [r for r in rows if r["mode"] == mode]
                medians[mode] = statistics.median(r["all_hold_it_s"] for r in mine)
            labels = {"shared": "the host's, shared", "separate": "one per generator"}
            for mode in ("shared", "separate"):
                mine = [r for r in rows if r["mode"] == mode]
                copies_table.append(
                    f"| {labels[mode]} | "
                    f"{medians[mode]:.2f} | {medians[mode] / medians['shared']:.2f}x | "
                    f"{mine[0]['downloads']} | {mine[0]['held_mb']} MB |"
                )
            write_results(
                "multihost_host_copies",
                args,
                "B13: one weight download per inference host",
                copies_table,
                host_copies=rows,
            )
    if result:  # the parts on test hosts
        write_results("multihost", args, "B13: a node over several hosts", table, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
