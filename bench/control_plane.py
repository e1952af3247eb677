"""B8 — the control plane's ceiling: the full node (broker, vault, gateway, managed Task App,
generator, learner) with an engine that answers at once with fixed tokens (`GENERATOR_ENGINE
=instant`) and the copy task's Task App (one inference call and a string comparison), so that
what is left is what the services cost around generation and training. Every rollout of a
group gets the same reward, so the learner trains nothing and its CPU is bookkeeping.

Reports rollouts/s and CPU milliseconds per rollout of each process (user + system, from
/proc, over the steps after the first few), the broker and the Task App included. Writes
bench/results/control_plane.{json,md}.

With `--gateways 1,2,4` (the default), a node per count of gateway processes: each
generator spreads its work items over them. `--before FILE` shows an earlier tree's result
(its JSON) beside this run's. `--storages memory,durable` runs the same work on the
embedded broker's memory engine and on its durable storage (rlnode's object store, a
process of its own, measured too), a node each, both up, their rounds in turn, and writes
bench/results/control_plane_storage.{json,md} instead.

    python bench/control_plane.py [--steps 30] [--gateways 1,2,4] [--before old.json]
    python bench/control_plane.py --gateways 1 --storages memory,durable
    python bench/control_plane.py --gateways 1 --kafka-tls off,on

`--kafka-tls off,on` likewise runs the same work on a node whose every Kafka client goes
through the broker's TLS front (haproxy, client certificates; its CPU measured too) and on
one without, and writes bench/results/control_plane_tls.{json,md}.

`--history 100000` measures a node as it ages (#36): the same job on a new node, then again
once at least that many records of history were added to its topics, with the time a
job's event listing takes at both ages; a node whose durable store applies the topics'
retention and one that keeps everything (`--retention on,off`), one after the other, each
alone on the machine. The history is copies of what the first job left on rollout-work,
trajectories and job-events, produced as stored (key, value, headers: the services'
signatures hold) in the batches the services' producers made of them (`--history-single`:
one record a batch), by a few producers at once (`--history-senders`); the node's consumers
read it as they would any record of a finished job. Writes
bench/results/control_plane_aged.{json,md}.

    python bench/control_plane.py --gateways 1 --history 100000 [--retention on]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from bench_common import copy_task_node, job_config, training_arguments, write_results

from rlnode.bus import clients
from rlnode.bus.reader import TopicReader
from rlnode.messages import JobEventType, topics
from rlnode.models.build import init_tiny_model
from rlnode.node.chaos import BROKER, pid_of, targets, task_app_target
from rlnode.node.local import FRONT, OBJECT_STORE

NAMES = {
    BROKER: "broker (Tansu)",
    OBJECT_STORE: "broker's object store",
    FRONT: "broker's TLS front (haproxy)",
}


MACHINE = "the whole machine"


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (its threads included), and
    the whole machine's busy seconds under MACHINE (what else ran beside the node)."""
    used = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        used[name] = times.user + times.system
    machine = psutil.cpu_times()
    used[MACHINE] = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    return used


async def run(node, org, model: Path, args, pids: dict[str, int]) -> dict:
    config = job_config(model, args)
    per_step = args.prompts * args.group
    marks: list[tuple[int, float, dict[str, float]]] = []
    async with node.jobs(org) as jobs:
        job_id = await jobs.start(config)
        async for event in jobs.events(job_id, idle_timeout_s=300):
            if event.type is JobEventType.TRAIN_STEP:
                step = event.data["step"]
                if step == args.warmup or step == args.steps:
                    marks.append((step, time.perf_counter(), cpu_seconds(pids)))
                if step == args.steps:
                    break
            if event.type in (JobEventType.FAILED, JobEventType.REJECTED):
                raise RuntimeError(f"job {job_id}: {event.message}")
    (first, started, before), (last, ended, after) = marks
    rollouts = (last - first) * per_step
    cpu_ms = {name: 1000 * (after[name] - before[name]) / rollouts for name in pids}
    total = sum(cpu_ms.values())
    machine = 1000 * (after[MACHINE] - before[MACHINE]) / rollouts
    return {
        "job_id": job_id,
        "rollouts": rollouts,
        "seconds": ended - started,
        "rollouts_per_s": rollouts / (ended - started),
        "cpu_ms_per_rollout": cpu_ms,
        "cpu_ms_per_rollout_total": total,
        # Everything else busy meanwhile (this benchmark's client, another node, the rest).
        "other_cpu_ms_per_rollout": max(0.0, machine - total),
    }


HISTORY_TOPICS = (topics.ROLLOUT_WORK, topics.TRAJECTORIES, topics.JOB_EVENTS)


async def listing(node, org, job_id: str) -> dict:
    """How long listing a finished job's events takes (`rlnode job events`'s path)."""
    async with node.jobs(org) as jobs:
        started = time.perf_counter()
        events = await jobs.history(job_id)
        return {"listing_s": time.perf_counter() - started, "listed_events": len(events)}


async def add_history(node, count: int, senders: int, single: bool) -> dict:
    """At least `count` records more on HISTORY_TOPICS: copies of what they hold now, sent
    in the batches the services' producers made of them (read from the store's objects), or
    with `single` one record a batch; `senders` producers, each with one batch in flight per
    partition."""
    settings = node.kafka_settings()
    held: dict[tuple[str, int], list] = {}
    for topic in HISTORY_TOPICS:
        async with TopicReader(settings, topic, service="bench") as reader:
            while not reader.caught_up.is_set():
                for r in await reader.fetch():
                    held.setdefault((topic, r.partition), []).append(r)
    batches = {
        (topic, partition): [[r] for r in records]
        if single
        else as_stored(records, batch_offsets(node, topic, partition))
        for (topic, partition), records in held.items()
    }
    total = sum(len(records) for records in held.values())
    rounds = -(-count // total)
    producers = [clients.producer(settings, "bench") for _ in range(senders)]
    for producer in producers:
        await producer.start()
    started = time.perf_counter()

    async def send_batch(producer, topic: str, partition: int, group: list) -> None:
        """`group` as one batch (more where it outgrows the producer's batch size)."""
        batch = producer.create_batch()
        for r in group:
            fields = {"timestamp": None, "key": r.key, "value": r.value, "headers": list(r.headers)}
            if batch.append(**fields) is None:  # full: the rest goes in the next
                batch.close()
                await (await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                batch.append(**fields)
        batch.close()
        await (await producer.send_batch(batch, topic, partition=partition))

    async def copy(producer, topic: str, partition: int, groups: list, share: int) -> int:
        for _ in range(share):
            for group in groups:
                await send_batch(producer, topic, partition, group)
        return share * sum(len(group) for group in groups)

    shares = [rounds // senders + (i < rounds % senders) for i in range(senders)]
    batches_before = stored_batches(node)
    try:
        sent = await asyncio.gather(
            *(
                copy(producer, t, p, groups, share)
                for (t, p), groups in batches.items()
                for producer, share in zip(producers, shares, strict=True)
            )
        )
    finally:
        for producer in producers:
            await producer.stop()
    return {
        "history_records": sum(sent),
        "history_s": time.perf_counter() - started,
        "history_batches": stored_batches(node) - batches_before,
        "history_senders": senders,
        "history_by_topic": {
            t: sum(len(rs) for (tt, _), rs in held.items() if tt == t) * rounds
            for t in HISTORY_TOPICS
        },
    }


def batch_offsets(node, topic: str, partition: int) -> list[int]:
    """The first offsets of the record batches the store holds for a partition (Tansu keeps
    each batch as records/<offset>.batch)."""
    cluster = node.data_dir / "broker" / "buckets" / "tansu" / "dclusters" / "drlnode"
    records = cluster / "dtopics" / f"d{topic}" / "dpartitions" / f"d{partition:010d}" / "drecords"
    return sorted(int(path.stem.removeprefix("o")) for path in records.glob("o*.batch"))


def as_stored(records: list, offsets: list[int]) -> list[list]:
    """`records` grouped by the stored batch each came in (`offsets`: the batches' first)."""
    groups: dict[int, list] = {}
    for r in records:
        first = offsets[bisect.bisect_right(offsets, r.offset) - 1] if offsets else r.offset
        groups.setdefault(first, []).append(r)
    return list(groups.values())


def stored_batches(node) -> int:
    """Record batches the broker's durable store holds now (one object each)."""
    root = node.data_dir / "broker" / "buckets"
    return sum(1 for _ in root.rglob("o*.batch"))


def aged(args, model: Path, tmp: Path, generator: dict) -> None:
    """--history: per retention setting (`--retention`), a node of its own, alone on the
    machine: the job on it new, the history, a pause, the job again. One node at a time: an
    aged node left up beside another costs it CPU (its consumers' idle fetches list every
    stored batch), which is not the other's ageing."""
    runs: list[dict] = []
    for retention in args.retention:
        with copy_task_node(
            tmp / f"node-aged-{retention}", generator, 1, "durable", broker_retention=retention
        ) as (node, org):
            pids = process_pids(node, org)
            first = ""
            for age in ("new", "aged"):
                if age == "aged":
                    added = asyncio.run(
                        add_history(node, args.history, args.history_senders, args.history_single)
                    )
                    print(
                        f"retention {retention}: {added['history_records']} records added "
                        f"in {added['history_s']:.0f} s",
                        flush=True,
                    )
                    runs.append({"retention": retention, "age": "history", **added})
                    # The store's sweep (every 30 s) deletes once-read records 5 minutes
                    # old; a job's listing reads from 5 minutes before the job was made
                    # (clocks), so the history must be older than that to be out of its
                    # way, as on a node whose 1,000 jobs ran over days.
                    time.sleep(args.history_settle_s)
                result = asyncio.run(run(node, org, model, args, pids))
                first = first or result["job_id"]
                result |= asyncio.run(listing(node, org, result["job_id"]))
                first_listing = asyncio.run(listing(node, org, first))
                result |= {
                    "retention": retention,
                    "age": age,
                    "first_job_listing_s": first_listing["listing_s"],
                    "stored_batches": stored_batches(node),
                }
                runs.append(result)
                print(
                    f"retention {retention}, {age}: {result['rollouts_per_s']:.0f} rollouts/s, "
                    f"{result['cpu_ms_per_rollout_total']:.2f} CPU ms per rollout (others "
                    f"{result['other_cpu_ms_per_rollout']:.2f}), listing "
                    f"{result['listing_s']:.2f} s ({result['listed_events']} events), "
                    f"{result['stored_batches']} batches stored",
                    flush=True,
                )
    rows = []
    for retention in args.retention:
        new, old = (
            next(r for r in runs if r["retention"] is retention and r["age"] == age)
            for age in ("new", "aged")
        )
        history = next(r for r in runs if r["retention"] is retention and r["age"] == "history")
        broker_ms = [
            sum(v for k, v in r["cpu_ms_per_rollout"].items() if k in NAMES.values())
            for r in (new, old)
        ]
        rows.append(
            f"| {'on' if retention else 'off (keeps everything)'} "
            f"| {history['history_records']} ({history['history_batches']} batches) in "
            f"{history['history_s'] / 60:.0f} min "
            f"| {new['rollouts_per_s']:.0f} -> {old['rollouts_per_s']:.0f} "
            f"(**{old['rollouts_per_s'] / new['rollouts_per_s']:.2f}x**) "
            f"| {new['cpu_ms_per_rollout_total']:.2f} -> {old['cpu_ms_per_rollout_total']:.2f} "
            f"| {broker_ms[0]:.2f} -> {broker_ms[1]:.2f} "
            f"| {new['other_cpu_ms_per_rollout']:.2f} -> {old['other_cpu_ms_per_rollout']:.2f} "
            f"| {new['listing_s']:.2f} -> {old['listing_s']:.2f} "
            f"| {new['first_job_listing_s']:.2f} -> {old['first_job_listing_s']:.2f} "
            f"| {new['stored_batches']} -> {old['stored_batches']} |"
        )
    table = [
        "| retention | records of history added | rollouts/s, new -> aged | CPU ms per rollout "
        "| of which the broker's and its store's | CPU ms per rollout of the rest of the "
        "machine | listing the job's events (s) | listing the first job's events (s) "
        "| batches stored |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"The same job ({args.steps} steps of {args.prompts} x {args.group}, instant engine, "
        "copy-task Task App) on a new node and again after the history (copies of the first "
        "job's records on rollout-work, trajectories and job-events, in the batches they "
        f"were stored in{' (one record a batch)' if args.history_single else ''}), "
        f"{args.history_settle_s:.0f} s later; each node's own job listed right after it ends "
        "(ids carry their time: read from 5 minutes before it), and its first job listed "
        f"then too (read from before the history). The history sent by "
        f"{args.history_senders} producers, each one record in flight per partition. One node "
        "at a time on the machine, on durable storage; the rest of the machine's CPU is "
        "this benchmark's own client and whatever else ran.",
    ]
    write_results(
        "control_plane_aged",
        args,
        "B8 as the node ages: the embedded broker with retention and without",
        table,
        runs=runs,
    )


def process_pids(node, org) -> dict[str, int]:
    task_app = task_app_target(org, "copy")
    pids = {
        name.removeprefix("taskapp:").replace(f"{org.org_id}/", ""): pid_of(
            node, name, {org.org_id: org}
        )
        for name in targets(node, [task_app])
    }
    return {NAMES.get(k, k): v for k, v in pids.items()}


def by_service(cpu_ms: dict[str, float]) -> dict[str, float]:
    """CPU ms per rollout with a node's gateways summed into one row."""
    rows: dict[str, float] = {}
    for name, value in cpu_ms.items():
        key = "taskapp-gateway (all)" if name.startswith("taskapp-gateway") else name
        rows[key] = rows.get(key, 0.0) + value
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    training_arguments(parser, steps=30, max_async=2)
    parser.set_defaults(prompts=16, group=16)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the measurement")
    parser.add_argument("--repeats", type=int, default=2, help="jobs per gateway count")
    parser.add_argument(
        "--gateways", default="1,2,4", help="gateway counts to run, a node each (default 1,2,4)"
    )
    parser.add_argument(
        "--storages",
        default="durable",
        help="the embedded broker's storage, a node each: memory, durable (the default "
        "node's) or both, compared (memory,durable)",
    )
    parser.add_argument(
        "--kafka-tls",
        default="off",
        help="off, on (every Kafka client through the broker's TLS front) or both, compared "
        "(off,on)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="records of history to add between two runs of the job, on a node with "
        "retention and one without (writes control_plane_aged)",
    )
    parser.add_argument(
        "--history-senders",
        type=int,
        default=4,
        help="producers sending the history, each one record in flight per partition",
    )
    parser.add_argument(
        "--history-single",
        action="store_true",
        help="send the history one record a batch (the default: in the batches the "
        "services' producers made of the first job's records, as stored)",
    )
    parser.add_argument(
        "--retention",
        type=lambda v: [{"on": True, "off": False}[x] for x in v.split(",")],
        default=[True, False],
        help="with --history: on, off or both (on,off, the default), a node each in turn",
    )
    parser.add_argument(
        "--history-settle-s",
        type=float,
        default=360.0,
        help="seconds between the history and the aged run (past a listing's 5 minutes)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="a results JSON of this benchmark from an earlier tree, shown beside this run",
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.gateways.split(",")]
    storages = args.storages.split(",")
    fronts = [{"off": False, "on": True}[v] for v in args.kafka_tls.split(",")]
    # A node per (storage, TLS front) variant.
    variants = [(storage, tls) for storage in storages for tls in fronts]
    compared = len(variants) > 1
    generator = {
        "GENERATOR_ENGINE": "instant",
        "GENERATOR_CONCURRENCY": "256",
        "GENERATOR_MAX_BATCH_SIZE": "256",
    }
    runs = []
    if args.history:
        with tempfile.TemporaryDirectory() as tmp:
            model = init_tiny_model(Path(tmp) / "tiny", seed=0)
            aged(args, model, Path(tmp), generator)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny_model(Path(tmp) / "tiny", seed=0)
        for count in counts:
            # One node per storage, up together, their rounds taken in turn: a machine whose
            # load moves during the run moves both alike (an idle node costs ~3% of a core).
            with contextlib.ExitStack() as nodes:
                running = {
                    (storage, tls): nodes.enter_context(
                        copy_task_node(
                            Path(tmp) / f"node-{storage}-{tls}-{count}",
                            generator,
                            count,
                            storage,
                            kafka_tls=tls,
                        )
                    )
                    for storage, tls in variants
                }
                pids = {variant: process_pids(*running[variant]) for variant in variants}
                for round_ in range(args.repeats):
                    for (storage, tls), (node, org) in running.items():
                        result = asyncio.run(run(node, org, model, args, pids[storage, tls]))
                        result |= {"gateways": count, "storage": storage, "kafka_tls": tls}
                        runs.append(result)
                        print(
                            f"{label(storage, tls)}, {count} gateway(s), round {round_ + 1}: "
                            f"{result['rollouts_per_s']:.0f} rollouts/s, "
                            f"{result['cpu_ms_per_rollout_total']:.2f} CPU ms per rollout",
                            flush=True,
                        )
    columns = [
        (
            (f"{label(r['storage'], r['kafka_tls'])}, " if compared else "")
            + f"{r['gateways']} gw, run {i + 1}",
            by_service(r["cpu_ms_per_rollout"]),
        )
        for i, r in enumerate(runs)
    ]
    before = None
    if args.before is not None:
        previous = json.loads(args.before.read_text())
        before = min(previous["runs"], key=lambda r: r["cpu_ms_per_rollout_total"])
        columns.insert(
            0,
            (
                f"before ({previous['machine']['commit'] or '?'})",
                by_service(before["cpu_ms_per_rollout"]),
            ),
        )
    names = list(dict.fromkeys(name for _, rows in columns for name in rows))
    per_second = ([before["rollouts_per_s"]] if before else []) + [
        r["rollouts_per_s"] for r in runs
    ]
    table = [
        "| process | " + " | ".join(label for label, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
        *(
            f"| {name} | "
            + " | ".join(f"{rows[name]:.2f}" if name in rows else "-" for _, rows in columns)
            + " |"
            for name in names
        ),
        "| **total CPU ms per rollout** | "
        + " | ".join(f"**{sum(rows.values()):.2f}**" for _, rows in columns)
        + " |",
        "| rollouts/s | " + " | ".join(f"{v:.0f}" for v in per_second) + " |",
        "| cores busy (CPU ms x rollouts/s) | "
        + " | ".join(
            f"{sum(rows.values()) * v / 1000:.2f}"
            for (_, rows), v in zip(columns, per_second, strict=True)
        )
        + " |",
        "",
        f"CPU milliseconds per rollout of each process over steps {args.warmup}..{args.steps}"
        f" ({args.prompts} prompts x {args.group} samples a step), with an engine that answers "
        "at once: what the services cost around generation (goal: 2 ms in all).",
        "",
        "| broker | gateways | rollouts/s (median) | CPU ms per rollout (median) "
        "| of which the broker's, its store's and its front's (median) |",
        "|---|---|---|---|---|",
        *(summary(runs, storage, tls, count) for storage, tls in variants for count in counts),
    ]
    name, title = "control_plane", ""
    if len(fronts) > 1:
        name, title = "control_plane_tls", ": Kafka through the broker's TLS front, and not"
    elif len(storages) > 1:
        name, title = "control_plane_storage", ": the broker's memory engine and durable storage"
    write_results(
        name,
        args,
        "B8: the control plane's cost per rollout (instant engine, copy-task Task App)" + title,
        table,
        runs=runs,
        before=before,
    )


def label(storage: str, tls: bool) -> str:
    return f"{storage}{', TLS front' if tls else ''}"


def summary(runs: list[dict], storage: str, tls: bool, count: int) -> str:
    """A row of medians over the runs of one variant and gateway count."""
    mine = [
        r
        for r in runs
        if r["storage"] == storage and r.get("kafka_tls", False) == tls and r["gateways"] == count
    ]
    broker = [
        sum(v for k, v in r["cpu_ms_per_rollout"].items() if k in NAMES.values()) for r in mine
    ]
    return (
        f"| {label(storage, tls)} | {count} | "
        f"{statistics.median(r['rollouts_per_s'] for r in mine):.0f} | "
        f"{statistics.median(r['cpu_ms_per_rollout_total'] for r in mine):.2f} | "
        f"{statistics.median(broker):.2f} |"
    )


if __name__ == "__main__":
    main()
