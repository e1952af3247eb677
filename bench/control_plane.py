"""B8 — the control plane's ceiling: the full node (broker, vault, gateway, managed Task App,
generator, learner) with an engine that answers at once with fixed tokens (`GENERATOR_ENGINE
=instant`) and the copy task's Task App (one inference call and a string comparison), so that
what is left is what the services cost around generation and training. Every rollout of a
group gets the same reward, so the learner trains nothing and its CPU is bookkeeping.

Reports rollouts/s and CPU milliseconds per rollout of each process (user + system, from
/proc, over the steps after the first few), the broker (Apache Kafka's JVM) and the Task App
included; the broker's resident memory (its JVM's VmRSS after each run, and its peak since
it started, VmHWM); and how long the node took to start (LocalNode.start: its broker, the
topics, users and ACLs, every service healthy), of which its broker (LocalBroker.start, the
formatting of its log directory included, as on any first start). Writes
bench/results/control_plane.{json,md}.

With `--gateways 1,2,4` (the default), a node per count of gateway processes, one after the
other: each generator spreads its work items over them. `--before FILE` shows an earlier
tree's result (its JSON) beside this run's.

    python bench/control_plane.py [--steps 30] [--gateways 1,2,4] [--repeats 2] [--before old.json]

`--kafka secured,open` runs each gateway count twice: on the node's own broker (SASL_SSL with
SCRAM, a user and ACLs per service, as `rlnode up` runs it) and on an open broker
(PLAINTEXT, no users, no ACLs; given to the node as a broker of a user's own, as
KAFKA_BOOTSTRAP_SERVERS gives `rlnode up` one): what TLS and the logins cost, in the same run.

`--history 100000` measures a node as it ages (#36): the same job on a new node, then again
once at least that many records of history were added to its topics, with the time a
job's event listing takes at both ages; Kafka applies the topics' retention
(rlnode.messages.topics.RETENTION) as on any node. The history is copies of what the first
job left on rollout-work, trajectories and job-events, produced as stored (key, value,
headers: the services' signatures hold) in the batches the services' producers made of them
(read from the headers of Kafka's log segments; `--history-single`: one record a batch), by
a few producers at once (`--history-senders`); the node's consumers read it as they would
any record of a finished job. Writes bench/results/control_plane_aged.{json,md}.

    python bench/control_plane.py --gateways 1 --history 100000
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import statistics
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from bench_common import (
    copy_task_node,
    job_config,
    status_bytes,
    training_arguments,
    write_results,
)

from rlnode.bus import clients
from rlnode.bus.localbroker import DEFAULT_HEAP, HEAP_ENV, LocalBroker
from rlnode.bus.reader import TopicReader
from rlnode.messages import JobEventType, topics
from rlnode.models.build import init_tiny_model
from rlnode.node.chaos import BROKER, pid_of, targets, task_app_target

BROKER_NAME = "broker (Apache Kafka)"
NAMES = {BROKER: BROKER_NAME}
MIB = 1024 * 1024
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


def broker_memory(broker: LocalBroker) -> dict[str, int]:
    """The broker JVM's resident bytes now, and at their peak since it started."""
    pid = broker.pid
    assert pid is not None, "the broker runs"
    return {
        "broker_rss_bytes": status_bytes(pid, "VmRSS"),
        "broker_peak_rss_bytes": status_bytes(pid, "VmHWM"),
    }


@contextlib.contextmanager
def started_node(
    directory: Path, generator: dict[str, str], gateways: int, kafka: str = "secured"
) -> Iterator[tuple]:
    """copy_task_node's node and org, how long the node took to start, in seconds: the
    whole (node_start_s: every service healthy), its broker (broker_start_s) and within
    that the formatting of the broker's log directory (broker_format_s), as the node and its
    broker recorded them; and the broker. `kafka` "open": an open broker of its own (no TLS,
    no logins, no ACLs), started first and given to the node as a broker of the user's own."""
    with contextlib.ExitStack() as stack:
        broker = None
        if kafka == "open":
            broker = stack.enter_context(LocalBroker(directory.parent / f"{directory.name}-kafka"))
        bootstrap = broker.bootstrap_servers if broker else None
        node, org = stack.enter_context(copy_task_node(directory, generator, gateways, bootstrap))
        assert (node.broker is None) == (kafka == "open"), "the node runs on the broker asked"
        broker = broker or node.broker
        assert broker is not None and broker.start_seconds is not None
        took = {
            "kafka": kafka,
            "node_start_s": node.start_seconds,
            "broker_start_s": broker.start_seconds,
            "broker_format_s": broker.format_seconds or 0.0,
        }
        print(
            f"{gateways} gateway(s), {kafka} broker: the node up in {took['node_start_s']:.1f} "
            f"s, its broker in {took['broker_start_s']:.1f} s",
            flush=True,
        )
        yield node, org, took, broker


async def run(node, org, model: Path, args, pids: dict[str, int], broker: LocalBroker) -> dict:
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
        # Everything else busy meanwhile (this benchmark's client, the rest).
        "other_cpu_ms_per_rollout": max(0.0, machine - total),
        **broker_memory(broker),
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
    in the batches the services' producers made of them (read from Kafka's log), or with
    `single` one record a batch; `senders` producers, each with one batch in flight per
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

    async def send_batch(producer, topic: str, partition: int, group: list) -> int:
        """`group` as one batch (more where it outgrows the producer's batch size); the
        batches sent."""
        sent = 1
        batch = producer.create_batch()
        for r in group:
            fields = {"timestamp": None, "key": r.key, "value": r.value, "headers": list(r.headers)}
            if batch.append(**fields) is None:  # full: the rest goes in the next
                batch.close()
                await (await producer.send_batch(batch, topic, partition=partition))
                batch = producer.create_batch()
                batch.append(**fields)
                sent += 1
        batch.close()
        await (await producer.send_batch(batch, topic, partition=partition))
        return sent

    async def copy(producer, topic: str, partition: int, groups: list, share: int) -> tuple:
        """(records, batches) sent."""
        sent = 0
        for _ in range(share):
            for group in groups:
                sent += await send_batch(producer, topic, partition, group)
        return share * sum(len(group) for group in groups), sent

    shares = [rounds // senders + (i < rounds % senders) for i in range(senders)]
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
        "history_records": sum(records for records, _ in sent),
        "history_s": time.perf_counter() - started,
        "history_batches": sum(batches for _, batches in sent),
        "history_senders": senders,
        "history_by_topic": {
            t: sum(len(rs) for (tt, _), rs in held.items() if tt == t) * rounds
            for t in HISTORY_TOPICS
        },
    }


def batch_offsets(node, topic: str, partition: int) -> list[int]:
    """The first offsets of the record batches Kafka's log holds for a partition: in a
    segment (<topic>-<partition>/<first offset>.log) each batch opens with its first offset
    (int64) and the length of the rest (int32)."""
    offsets = []
    for segment in sorted((node.broker.data_dir / f"{topic}-{partition}").glob("*.log")):
        data = segment.read_bytes()
        position = 0
        while position + 12 <= len(data):
            first, length = struct.unpack_from(">qi", data, position)
            if length <= 0 or position + 12 + length > len(data):  # one still being written
                break
            offsets.append(first)
            position += 12 + length
    return offsets


def as_stored(records: list, offsets: list[int]) -> list[list]:
    """`records` grouped by the stored batch each came in (`offsets`: the batches' first)."""
    groups: dict[int, list] = {}
    for r in records:
        first = offsets[bisect.bisect_right(offsets, r.offset) - 1] if offsets else r.offset
        groups.setdefault(first, []).append(r)
    return list(groups.values())


def log_bytes(node) -> int:
    """Bytes of the broker's log segments, every topic's (not the indexes: Kafka sizes an
    active segment's index files ahead)."""
    size = 0
    for segment in node.broker.data_dir.rglob("*.log"):
        with contextlib.suppress(FileNotFoundError):  # a segment retention deleted meanwhile
            size += segment.stat().st_size
    return size


def aged(args, model: Path, tmp: Path, generator: dict[str, str]) -> None:
    """--history: a node alone on the machine: the job on it new, the history, a pause, the
    job again."""
    runs: list[dict] = []
    with started_node(tmp / "node-aged", generator, 1) as (node, org, took, broker):
        pids = process_pids(node, org, broker)
        first = ""
        for age in ("new", "aged"):
            if age == "aged":
                added = asyncio.run(
                    add_history(node, args.history, args.history_senders, args.history_single)
                )
                print(
                    f"{added['history_records']} records added in {added['history_s']:.0f} s",
                    flush=True,
                )
                runs.append({"age": "history", **added})
                # A job's listing reads from 5 minutes before the job was made (clocks), so
                # the history must be older than that to be out of its way, as on a node
                # whose 1,000 jobs ran over days.
                time.sleep(args.history_settle_s)
            result = asyncio.run(run(node, org, model, args, pids, broker))
            first = first or result["job_id"]
            result |= asyncio.run(listing(node, org, result["job_id"]))
            first_listing = asyncio.run(listing(node, org, first))
            result |= {
                "age": age,
                "first_job_listing_s": first_listing["listing_s"],
                "log_bytes": log_bytes(node),
                **took,
            }
            runs.append(result)
            print(
                f"{age}: {result['rollouts_per_s']:.0f} rollouts/s, "
                f"{result['cpu_ms_per_rollout_total']:.2f} CPU ms per rollout (others "
                f"{result['other_cpu_ms_per_rollout']:.2f}), listing "
                f"{result['listing_s']:.2f} s ({result['listed_events']} events), "
                f"broker {result['broker_rss_bytes'] / MIB:.0f} MiB resident, "
                f"log {result['log_bytes'] / MIB:.1f} MiB",
                flush=True,
            )
    new, old, history = (
        next(r for r in runs if r["age"] == age) for age in ("new", "aged", "history")
    )
    broker_ms = [r["cpu_ms_per_rollout"].get(BROKER_NAME, 0.0) for r in (new, old)]
    table = [
        "| records of history added | rollouts/s, new -> aged | CPU ms per rollout "
        "| of which the broker's | CPU ms per rollout of the rest of the machine "
        "| broker's peak RSS (MiB) | listing the job's events (s) "
        "| listing the first job's events (s) | the broker's log segments (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {history['history_records']} ({history['history_batches']} batches) in "
        f"{history['history_s'] / 60:.0f} min "
        f"| {new['rollouts_per_s']:.0f} -> {old['rollouts_per_s']:.0f} "
        f"(**{old['rollouts_per_s'] / new['rollouts_per_s']:.2f}x**) "
        f"| {new['cpu_ms_per_rollout_total']:.2f} -> {old['cpu_ms_per_rollout_total']:.2f} "
        f"| {broker_ms[0]:.2f} -> {broker_ms[1]:.2f} "
        f"| {new['other_cpu_ms_per_rollout']:.2f} -> {old['other_cpu_ms_per_rollout']:.2f} "
        f"| {new['broker_peak_rss_bytes'] / MIB:.0f} -> {old['broker_peak_rss_bytes'] / MIB:.0f} "
        f"| {new['listing_s']:.2f} -> {old['listing_s']:.2f} "
        f"| {new['first_job_listing_s']:.2f} -> {old['first_job_listing_s']:.2f} "
        f"| {new['log_bytes'] / MIB:.1f} -> {old['log_bytes'] / MIB:.1f} |",
        "",
        f"The same job ({args.steps} steps of {args.prompts} x {args.group}, instant engine, "
        "copy-task Task App) on a new node and again after the history (copies of the first "
        "job's records on rollout-work, trajectories and job-events, in the batches they "
        f"were stored in{' (one record a batch)' if args.history_single else ''}), "
        f"{args.history_settle_s:.0f} s later; the node's own job listed right after it ends "
        "(ids carry their time: read from 5 minutes before it), and its first job listed "
        f"then too (read from before the history). The history sent by "
        f"{args.history_senders} producers, each one record in flight per partition. One node "
        "on the machine, its broker Apache Kafka with rlnode's topic retention (a day or a "
        "week: none of the history is old enough to go within the run); the rest of the "
        "machine's CPU is this benchmark's own client and whatever else ran. The node "
        f"started in {took['node_start_s']:.1f} s, its broker in {took['broker_start_s']:.1f} "
        f"s (heap: {broker_heap()}).",
    ]
    write_results(
        "control_plane_aged",
        args,
        "B8 as the node ages: the same job on a new node and after a history of records",
        table,
        runs=runs,
        broker_heap=broker_heap(),
    )


def broker_heap() -> str:
    """The JVM heap options the node's broker ran with (kafka-server-start.sh's variable)."""
    return os.environ.get(HEAP_ENV, DEFAULT_HEAP)


def process_pids(node, org, broker: LocalBroker) -> dict[str, int]:
    """Each process of the node by name: the broker (the node's, or the open one it was
    given), its services, the managed Task App."""
    task_app = task_app_target(org, "copy")
    pids = {
        name.removeprefix("taskapp:").replace(f"{org.org_id}/", ""): pid_of(
            node, name, {org.org_id: org}
        )
        for name in targets(node, [task_app])
    }
    assert broker.pid is not None
    pids[BROKER] = broker.pid
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
        "--kafka",
        default="secured",
        help="brokers to run each count on: secured (the node's own: SASL_SSL, users, ACLs), "
        "open (PLAINTEXT, no users or ACLs), or both (secured,open)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="records of history to add between two runs of the job (writes control_plane_aged)",
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
    kafkas = args.kafka.split(",")
    if not set(kafkas) <= {"secured", "open"}:
        parser.error(f"--kafka {args.kafka}: secured, open or both")
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
            for kafka in kafkas:
                name = f"node-{count}-{kafka}"
                with started_node(Path(tmp) / name, generator, count, kafka) as (
                    node,
                    org,
                    took,
                    broker,
                ):
                    pids = process_pids(node, org, broker)
                    for round_ in range(args.repeats):
                        result = asyncio.run(run(node, org, model, args, pids, broker))
                        result |= {"gateways": count, **took}
                        runs.append(result)
                        print(
                            f"{count} gateway(s), {kafka}, round {round_ + 1}: "
                            f"{result['rollouts_per_s']:.0f} rollouts/s, "
                            f"{result['cpu_ms_per_rollout_total']:.2f} CPU ms per rollout, "
                            f"broker {result['broker_rss_bytes'] / MIB:.0f} MiB resident",
                            flush=True,
                        )
    columns = [
        (
            f"{r['gateways']} gw{', open broker' if r['kafka'] == 'open' else ''}, run {i + 1}",
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
        "| gateways, broker | rollouts/s (median) | CPU ms per rollout (median) "
        "| of which the broker's (median) | broker's RSS after a run, peak since its start "
        "(MiB) | node start (s) | of which the broker's (s) |",
        "|---|---|---|---|---|---|---|",
        *(summary(runs, count, kafka) for count in counts for kafka in kafkas),
        "",
        "The broker's RSS is its JVM's (VmRSS, VmHWM) with the heap it ran with "
        f"(`{HEAP_ENV}`: {broker_heap()}). Node start: LocalNode.start, from nothing to every "
        "service healthy (its broker, the topics, the services' Kafka users and ACLs "
        "included); the broker's: LocalBroker.start, formatting its log directory included.",
    ]
    write_results(
        "control_plane",
        args,
        "B8: the control plane's cost per rollout (instant engine, copy-task Task App)",
        table,
        runs=runs,
        before=before,
        broker_heap=broker_heap(),
    )


def summary(runs: list[dict], count: int, kafka: str) -> str:
    """A row of medians over the runs of one gateway count on one kind of broker (a node of
    its own)."""
    mine = [r for r in runs if r["gateways"] == count and r["kafka"] == kafka]
    broker = [r["cpu_ms_per_rollout"].get(BROKER_NAME, 0.0) for r in mine]
    return (
        f"| {count}, {kafka} | "
        f"{statistics.median(r['rollouts_per_s'] for r in mine):.0f} | "
        f"{statistics.median(r['cpu_ms_per_rollout_total'] for r in mine):.2f} | "
        f"{statistics.median(broker):.2f} | "
        f"{statistics.median(r['broker_rss_bytes'] for r in mine) / MIB:.0f}, "
        f"{max(r['broker_peak_rss_bytes'] for r in mine) / MIB:.0f} | "
        f"{mine[0]['node_start_s']:.1f} | "
        f"{mine[0]['broker_start_s']:.1f} (format {mine[0].get('broker_format_s', 0.0):.1f}) |"
    )


if __name__ == "__main__":
    main()
