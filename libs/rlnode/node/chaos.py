"""Fault injection on an embedded node, for the chaos tests and `make bench-chaos`: the
processes that may be killed (the broker, each service, each managed Task App), their pid
now, the node's own view of its jobs and health, and the supervision `rlnode up` runs, as a
thread, so that whoever kills can watch from the same process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import httpx

from rlnode.bus import TopicReader
from rlnode.messages import topics
from rlnode.node.local import LocalNode, Org
from rlnode.sdk.gateway import GatewayClient
from rlnode.service.registry import GATEWAY, LEARNER
from rlnode.training.loop import trained_work_ids, work_id

BROKER = "broker"
TASK_APP_PREFIX = "taskapp:"  # "taskapp:<org>/<name>": a managed Task App


class Supervision(threading.Thread):
    """A round of `LocalNode.supervise` every 0.2 s, as `rlnode up` runs: a dead service or
    a dead broker is started again. What it did is in `said`."""

    def __init__(self, node: LocalNode) -> None:
        super().__init__(daemon=True, name="node supervision")
        self.node = node
        self.said: list[str] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(0.2):
            self.said.extend(self.node.supervise())

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def task_app_target(org: Org, name: str) -> str:
    return f"{TASK_APP_PREFIX}{org.org_id}/{name}"


def targets(node: LocalNode, task_apps: list[str]) -> list[str]:
    """What may be killed: the broker (when the node runs its own), every service process,
    and the managed Task Apps named by `task_app_target`."""
    own = [BROKER] if node.broker is not None else []
    return own + list(node.processes) + task_apps


def pid_of(node: LocalNode, target: str, orgs: dict[str, Org]) -> int:
    if target == BROKER:
        assert node.broker is not None and node.broker.pid is not None, "the broker runs"
        return node.broker.pid
    if target.startswith(TASK_APP_PREFIX):
        org_id, name = target.removeprefix(TASK_APP_PREFIX).split("/", 1)
        with GatewayClient(node.url(GATEWAY.name), orgs[org_id].token) as gateway:
            pid = gateway.get(name)["managed"]["pid"]
        if not pid:
            raise RuntimeError(f"{target} is not running")
        return pid
    process = node.processes[target].proc
    assert process is not None, f"{target} was started"
    return process.pid


def is_running(node: LocalNode, target: str, orgs: dict[str, Org]) -> bool:
    """Whether `target` runs now: a kill must land on a live process, not on one that died
    on its own and waits for supervision to start it again."""
    if target == BROKER:
        return node.broker is not None and node.broker.running
    if target.startswith(TASK_APP_PREFIX):
        try:
            pid_of(node, target, orgs)
        except (RuntimeError, httpx.HTTPError):
            return False
        return True
    process = node.processes[target].proc
    return process is not None and process.poll() is None


def kill(node: LocalNode, target: str, orgs: dict[str, Org]) -> int:
    """SIGKILL `target`; its pid."""
    pid = pid_of(node, target, orgs)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        raise RuntimeError(
            f"{target} (pid {pid}) had already exited before the kill; wait for "
            "`is_running` first (supervision starts it again)"
        ) from None
    return pid


# What a broker that loses nothing must still hold after any kill.
KEPT_TOPICS = (topics.JOB_REQUESTS, topics.JOB_EVENTS, topics.DEAD_LETTERS)

Held = set[tuple[str, int, int, bytes]]


async def held_records(node: LocalNode, names: tuple[str, ...] = KEPT_TOPICS) -> Held:
    """Every record the broker holds on `names` now: (topic, partition, offset, value)."""
    held: Held = set()
    for name in names:
        async with TopicReader(node.kafka_settings(), name, service="chaos-reader") as reader:
            while not reader.caught_up.is_set():
                records = await asyncio.wait_for(reader.fetch(timeout_ms=200), 60)
                held |= {(r.topic, r.partition, r.offset, r.value or b"") for r in records}
    return held


def learner_jobs(node: LocalNode, org: Org) -> dict[str, dict] | None:
    """The org's jobs as the learner records them (status, step, reason), by id; None while
    the learner does not answer. Not the checkpoint-server's summary: that is built from
    events, and the events a killed broker held are gone."""
    try:
        response = httpx.get(
            node.url(LEARNER.name) + "/v1/jobs",
            headers={"Authorization": f"Bearer {org.token}"},
            timeout=5,
        )
        return {job["job_id"]: job for job in response.raise_for_status().json()}
    except httpx.HTTPError:
        return None


def all_healthy(node: LocalNode) -> bool:
    try:
        return all(
            httpx.get(p.health_url, timeout=5).status_code == 200 for p in node.processes.values()
        )
    except httpx.TransportError:
        return False


def trained_once(
    checkpoints: Path, job_id: str, steps: int, prompts: int, group: int
) -> tuple[int, int]:
    """(work items lost, work items trained more than once) in the chain of a finished
    job's checkpoints, against every item its steps issue."""
    trained = Counter(trained_work_ids(checkpoints))
    expected = {
        str(work_id(job_id, s, p, g))
        for s in range(steps)
        for p in range(prompts)
        for g in range(group)
    }
    lost = len(expected - set(trained))
    twice = sum(count - 1 for count in trained.values() if count > 1)
    return lost, twice
