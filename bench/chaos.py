"""A chaos run: the embedded node (its own broker, every service a process, supervised as
`rlnode up` supervises it) trains jobs of two orgs without a pause while a seeded schedule
SIGKILLs a random process (the broker, a service, a managed Task App) every
`--kill-every-s` seconds. First `--baseline-s` without faults, on the same node and jobs:
steps per minute under chaos are reported against that baseline.

Reports faults injected and survived (the node healthy again before the next), jobs
completed and failed (a request no learner recorded: "rejected" with the reason of its
job.rejected event, else "request lost"), work items lost and trained twice (in the chain of each completed
job's checkpoints, against every item its steps issue), and the longest stall (no step
trained anywhere while jobs were running). Writes bench/results/chaos.{json,md}.

With `--cluster`, the node talks to a Kafka cluster of three brokers on this machine's
loopback addresses (127.0.0.1-3; `rlnode kafka-cluster`, each run by `rlnode broker
--cluster`, which starts it again when it dies; replication 3, min.insync.replicas 2), and
each broker is one more target: bench/results/chaos_cluster.{json,md}.

    python bench/chaos.py [--chaos-s 600] [--baseline-s 120] [--kill-every-s 20] [--seed 0]
        [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench_common import write_results

from rlnode.bus.localbroker import free_port
from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node import chaos
from rlnode.node.kafka_cluster import BrokerPlan, cluster_env, plan_cluster
from rlnode.node.local import LocalNode, NodeOptions, Org
from rlnode.node.testhosts import BrokerHost, ThisMachine
from rlnode.testing import unique_id, wait_until

TASK_APP = "copy"
ACTIVE = ("accepted", "queued", "running")
REQUEST_LOST_AFTER_S = 90.0  # a start request no learner has recorded by then is gone


class Jobs:
    """Keeps `per_org` jobs of each org in flight, and watches progress: the learner's
    record of each job, polled every 0.5 s."""

    def __init__(self, node: LocalNode, orgs: list[Org], model: Path, args) -> None:
        self.node, self.orgs, self.args = node, orgs, args
        self.config = example_job(
            "copy_task",
            model,
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=args.group,
            checkpoint_every=2,
            max_async=1,
        )
        self.started: dict[str, Org] = {}  # job id -> its org
        self.requested_at: dict[str, float] = {}
        self.seen: dict[str, dict] = {}  # job id -> the learner's last record of it
        self.steps_trained = 0  # steps taken by every job (again after a resume, too)
        self.last_progress = time.monotonic()
        self.longest_stall_s = 0.0
        self.starting = True

    def start_missing(self) -> None:
        for org in self.orgs:
            mine = [j for j, o in self.started.items() if o is org]
            active = [j for j in mine if self.seen.get(j, {}).get("status", "accepted") in ACTIVE]
            for _ in range(self.args.jobs_per_org - len(active)):
                job_id = unique_id(f"chaos-{org.org_id[-4:]}")
                asyncio.run(self._start(org, job_id))
                self.started[job_id] = org
                self.requested_at[job_id] = time.monotonic()
                self.seen[job_id] = {"status": "accepted", "step": 0}

    async def _start(self, org: Org, job_id: str) -> None:
        async with self.node.jobs(org, "chaos-bench") as jobs:
            await jobs.start(self.config, job_id)

    def poll(self) -> None:
        now = time.monotonic()
        progressed = False
        for org in self.orgs:
            records = chaos.learner_jobs(self.node, org)
            for job_id, record in (records or {}).items():
                if job_id not in self.started:
                    continue
                before = self.seen.get(job_id, {}).get("step", 0)
                if record["step"] > before:
                    self.steps_trained += record["step"] - before
                    progressed = True
                self.seen[job_id] = record
        for job_id, record in self.seen.items():
            waited = now - self.requested_at[job_id]
            if record["status"] == "accepted" and waited > REQUEST_LOST_AFTER_S:
                # No learner record: refused (its job.rejected says why), or a request the
                # broker took down with it before a learner read it (README).
                try:
                    rejected = self.rejection(self.started[job_id], job_id)
                except Exception as e:  # the broker or vault being down: ask next round
                    print(f"reading {job_id}'s events: {e}")
                    continue
                record["status"] = "rejected" if rejected else "request lost"
                if rejected:
                    record["reason"] = rejected
        running = any(r.get("status") in ACTIVE for r in self.seen.values())
        if progressed or not running:
            self.last_progress = now
        self.longest_stall_s = max(self.longest_stall_s, now - self.last_progress)

    def rejection(self, org: Org, job_id: str) -> str | None:
        """Why the learner refused `job_id`, from the job's own events; None if it did not."""
        found = self.node.job_events(org, job_id, "chaos-bench")
        reasons = [e.data.get("reason", "") for e in found if e.type is JobEventType.REJECTED]
        return (reasons[-1] or "no reason given") if reasons else None

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            self.poll()
            if self.starting:
                try:
                    self.start_missing()
                except Exception as e:  # the broker or vault being down: next round
                    print(f"starting jobs: {e}")


CLUSTER_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def start_cluster(directory: Path, node_data_dir: Path) -> tuple[dict[str, BrokerHost], dict]:
    """Three brokers on this machine's loopback addresses, planned with the node's CA and
    admin (the node's data dir is the control host's); the KAFKA_* the node uses them with."""
    port, controller_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    plans = plan_cluster(node_data_dir, list(CLUSTER_HOSTS), port, controller_port)
    brokers = {
        f"kafka-{i}": BrokerHost(ThisMachine(f"kafka-{i}", host), directory / f"kafka-{i}", plan)
        for i, (host, plan) in enumerate(zip(CLUSTER_HOSTS, plans, strict=True), start=1)
    }
    for broker in brokers.values():  # each waits for a quorum of the others
        broker.wait_started(1, 180)
    return brokers, cluster_env(node_data_dir, BrokerPlan.read(plans[0]))


def kill_broker(broker: BrokerHost) -> int:
    """SIGKILL a broker of the cluster (its JVM, not the `rlnode broker` that restarts it)
    and wait until it is started again; the pid killed."""
    starts = broker.starts()
    os.kill(starts[-1], signal.SIGKILL)
    broker.wait_started(len(starts) + 1, 120)
    return starts[-1]


def steps_in(jobs: Jobs, seconds: float) -> float:
    before = jobs.steps_trained
    time.sleep(seconds)
    return (jobs.steps_trained - before) / seconds * 60


def inject(
    node: LocalNode,
    orgs: list[Org],
    supervision: chaos.Supervision,
    args,
    brokers: dict[str, BrokerHost],
) -> list[dict]:
    rng = random.Random(args.seed)
    by_id = {o.org_id: o for o in orgs}
    targets = chaos.targets(node, [chaos.task_app_target(o, TASK_APP) for o in orgs])
    targets += list(brokers)
    faults: list[dict] = []
    deadline = time.monotonic() + args.chaos_s
    while time.monotonic() < deadline:
        target = rng.choice(targets)
        fault = {"target": target, "at_s": round(args.chaos_s - (deadline - time.monotonic()), 1)}
        try:
            if target in brokers:
                killing = time.monotonic()
                fault["pid"] = kill_broker(brokers[target])
                fault["started_again_s"] = round(time.monotonic() - killing, 1)
            else:
                fault["pid"] = chaos.kill(node, target, by_id)
        except Exception as e:  # e.g. a Task App between two runs: nothing to kill
            fault["skipped"] = str(e)
            faults.append(fault)
            time.sleep(1)
            continue
        killed_at = time.monotonic()
        time.sleep(1.0)  # let supervision see it before asking for health
        try:
            wait_until(lambda: chaos.all_healthy(node), 120, f"healthy after {target}")
            fault["survived"] = True
            fault["healthy_after_s"] = round(time.monotonic() - killed_at, 1)
        except TimeoutError:
            fault["survived"] = False
        faults.append(fault)
        print(fault, flush=True)
        time.sleep(max(0.0, args.kill_every_s - (time.monotonic() - killed_at)))
    return faults


def verdicts(node: LocalNode, jobs: Jobs, args) -> dict:
    completed, failed, lost, twice = 0, [], 0, 0
    for job_id, org in jobs.started.items():
        record = jobs.seen.get(job_id, {})
        if record.get("status") == "completed":
            completed += 1
            checkpoints = node.data_dir / "checkpoints" / org.org_id / job_id / "checkpoints"
            job_lost, job_twice = chaos.trained_once(
                checkpoints, job_id, args.steps, args.prompts, args.group
            )
            lost, twice = lost + job_lost, twice + job_twice
        else:
            failed.append({"job_id": job_id, **record})
    return {"completed": completed, "not_completed": failed, "lost": lost, "twice": twice}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chaos-s", type=float, default=600)
    parser.add_argument("--baseline-s", type=float, default=120)
    parser.add_argument("--kill-every-s", type=float, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs-per-org", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument(
        "--cluster", action="store_true", help="a cluster of three brokers, each a target"
    )
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="rlnode-chaos-"))
    brokers: dict[str, BrokerHost] = {}
    if args.cluster:
        brokers, env = start_cluster(directory, directory / "node")
        os.environ.update(env)  # the node uses the cluster as its admin, as `rlnode up` would
    options = NodeOptions(
        data_dir=directory / "node",
        kafka_bootstrap=os.environ["KAFKA_BOOTSTRAP_SERVERS"] if brokers else None,
        env={
            "rollout-generator": {"GENERATOR_CONCURRENCY": "16"},
            # A job whose work were lost would wait 30 min for it: count it as failed instead.
            "learner": {"LEARNER_MAX_RUNNING_JOBS": "2", "LEARNER_STEP_TIMEOUT_S": "300"},
        },
    )
    try:
        with LocalNode(options) as node:
            orgs = []
            for name in ("a", "b"):
                org = node.create_org(
                    unique_id(f"org-{name}"), {"ENVIRONMENT_API_KEY": unique_id("key")}
                )
                assert node.register_example_task_app(org, TASK_APP, "copy_task")["ok"]
                orgs.append(org)
            model = init_tiny_model(directory / "tiny", seed=0)
            supervision = chaos.Supervision(node)
            supervision.start()
            jobs = Jobs(node, orgs, model, args)
            stop = threading.Event()
            watcher = threading.Thread(target=jobs.watch, args=(stop,), daemon=True)
            watcher.start()
            wait_until(lambda: jobs.steps_trained > 0, 300, "the first step")
            baseline = steps_in(jobs, args.baseline_s)
            jobs.longest_stall_s = 0.0  # the stalls under chaos, not the start's
            started = jobs.steps_trained
            chaos_started = time.monotonic()
            faults = inject(node, orgs, supervision, args, brokers)
            under_chaos = (jobs.steps_trained - started) / (time.monotonic() - chaos_started) * 60
            jobs.starting = False  # let what runs finish
            wait_until(
                lambda: all(r.get("status") not in ACTIVE for r in jobs.seen.values()),
                900,
                "every job finished",
            )
            stop.set()
            watcher.join()
            supervision.stop()
            result = verdicts(node, jobs, args)
    finally:  # the cluster's brokers are processes of their own
        for broker in brokers.values():
            broker.stop()

    injected = [f for f in faults if "pid" in f]
    survived = [f for f in injected if f.get("survived")]
    by_target = Counter(f["target"].split(":")[0] for f in injected)
    recovery = [f["healthy_after_s"] for f in survived]
    table = [
        "| figure | value |",
        "|---|---|",
        f"| faults injected (SIGKILL) | {len(injected)} |",
        f"| faults survived (node healthy again before the next) | {len(survived)} |",
        f"| jobs completed | {result['completed']} of {len(jobs.started)} |",
        f"| work items lost (completed jobs) | {result['lost']} |",
        f"| work items trained twice (completed jobs) | {result['twice']} |",
        f"| longest stall (no step anywhere) | {jobs.longest_stall_s:.1f} s |",
        f"| node healthy again after a kill, median / max | "
        f"{statistics.median(recovery) if recovery else 0:.1f} s / {max(recovery, default=0):.1f} s |",
        f"| steps per minute: baseline / under chaos (ratio) | {baseline:.1f} / {under_chaos:.1f} "
        f"({under_chaos / baseline if baseline else 0:.2f}) |",
        "",
        "| killed | times |",
        "|---|---|",
        *(f"| {target} | {count} |" for target, count in sorted(by_target.items())),
    ]
    if result["not_completed"]:
        table += ["", "Jobs that did not complete:", ""]
        table += [
            f"- {j['job_id']}: {j.get('status')} {j.get('reason') or ''}"
            for j in result["not_completed"]
        ]
    if brokers:
        table += ["", "Kafka: three brokers (replication 3, min.insync.replicas 2) on 127.0.0.1-3."]
    write_results(
        "chaos_cluster" if args.cluster else "chaos",
        args,
        "Chaos: SIGKILL a random process of a training node every few seconds"
        + (", its Kafka a cluster of three" if args.cluster else ""),
        table,
        faults=faults,
        baseline_steps_per_min=baseline,
        chaos_steps_per_min=under_chaos,
        longest_stall_s=jobs.longest_stall_s,
        jobs=jobs.seen,
        supervision=supervision.said,
        **result,
    )


if __name__ == "__main__":
    main()
