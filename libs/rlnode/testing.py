"""Real infrastructure for tests (docs/architecture.md §7): a broker and databases.

Broker, in order: the one named by KAFKA_BOOTSTRAP_SERVERS; else a testcontainers Kafka
container where a Docker engine answers; else a local Apache Kafka subprocess (one per test
session and worker). RLNODE_TEST_BROKER=local|docker forces one of the last two. Each is an
open broker (PLAINTEXT, no ACLs), as a Kafka of a user's own may be: what the bus and the
services do is the same on any Kafka. A node's own broker (users, ACLs, TLS) is the one
every LocalNode test runs on. Tests must not depend on which one they got: the broker may be
shared, so they use unique job ids and groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlnode.bus import ensure_topics
from rlnode.bus.localbroker import LocalBroker
from rlnode.bus.settings import KafkaSettings

BrokerKind = Literal["external", "testcontainers", "local"]
KAFKA_IMAGE = "apache/kafka:4.4.0"  # the version deploy/kafka/pom.xml pins


@dataclass
class BrokerHandle:
    bootstrap_servers: str
    kind: BrokerKind
    local: LocalBroker | None = None


def docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@contextlib.contextmanager
def provide_broker() -> Iterator[BrokerHandle]:
    explicit = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    forced = os.environ.get("RLNODE_TEST_BROKER", "").lower()
    if explicit and not forced:
        yield BrokerHandle(explicit, "external")
        return
    if forced == "docker" or (forced != "local" and docker_engine_answers()):
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer(KAFKA_IMAGE).with_kraft() as container:
            yield BrokerHandle(container.get_bootstrap_server(), "testcontainers")
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rlnode-test-kafka-") as directory:
        with LocalBroker(Path(directory)) as local:
            yield BrokerHandle(local.bootstrap_servers, "local", local)


@contextlib.contextmanager
def broker_with_topics() -> Iterator[BrokerHandle]:
    """A broker (as `provide_broker`) with the topics created, as on a node (`rlnode up`
    creates them before any service starts): a service that subscribed first would otherwise
    leave the broker to auto-create a topic with its own partition count."""
    with provide_broker() as handle:
        asyncio.run(ensure_topics(KafkaSettings(bootstrap_servers=handle.bootstrap_servers)))
        yield handle


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def postgres_admin_url() -> str | None:
    """A PostgreSQL server URL to create test databases on, if one answers: DATABASE_URL
    when it names PostgreSQL, else the local server on 127.0.0.1:5432."""
    from sqlalchemy.engine import make_url

    from rlnode.service.db import normalise_url

    url = os.environ.get("DATABASE_URL")
    if url and url.startswith(("postgres://", "postgresql")):
        parsed = make_url(normalise_url(url))
    else:
        parsed = make_url("postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    try:
        with socket.create_connection((parsed.host or "127.0.0.1", parsed.port or 5432), timeout=1):
            pass
    except OSError:
        return None
    return parsed.set(database="postgres").render_as_string(hide_password=False)


@contextlib.contextmanager
def temporary_postgres_database(admin_url: str) -> Iterator[str]:
    """Create a fresh database for one test and drop it afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    parsed = make_url(admin_url)
    name = f"rlnode_test_{uuid.uuid4().hex[:16]}"
    conninfo = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield parsed.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class ThreadedServer:
    """An ASGI app served by uvicorn on a loopback port in a background thread: a real HTTP
    server for tests (policies, Task Apps) without a separate program file."""

    def __init__(self, app, port: int | None = None) -> None:
        import threading

        import uvicorn

        from rlnode.bus.localbroker import free_port

        self.port = port or free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        # Not the main thread: uvicorn (>= 0.29) installs signal handlers only from that one.
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        import time

        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the test server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def processes_with(marker: str) -> list[int]:
    """Pids of processes (other than this one) whose environment mentions `marker`: what a
    test started under a temporary data directory and should have stopped."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int(proc.name) != os.getpid() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def free_port_block() -> int:
    """A base port such that every service's port in a node's block is free on loopback now,
    the block below the kernel's ephemeral range: there an outgoing connection (a Kafka
    client's, a health check's) may take a service's port between this check and its bind,
    and hold it for as long as it stays open (the service then never starts). Within
    `RLNODE_FREE_PORTS` when it is set (a test worker's own range)."""
    from rlnode.service.registry import SERVICES, port_offset

    offsets = [port_offset(spec) for spec in SERVICES]
    import random

    from rlnode.bus.children import free_port_range

    low, high = free_port_range() or _below_ephemeral()
    for _ in range(200):
        base = random.randrange(low, high - max(offsets))
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports found")


def worker_port_range(worker: int, workers: int) -> str:
    """Test worker `worker`'s share (of `workers`) of the ports below the kernel's ephemeral
    range, as `RLNODE_FREE_PORTS` takes it: disjoint, so no two workers pick the same port."""
    low, high = _below_ephemeral()
    size = (high - low + 1) // workers
    return f"{low + worker * size}-{low + (worker + 1) * size - 1}"


def _below_ephemeral() -> tuple[int, int]:
    """The ports tests pick from (both ends included): from 10,000 up to the ephemeral range."""
    return 10_000, _ephemeral_ports()[0] - 1


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' ports from (Linux's default where it
    cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def run_rlnode(
    env: dict[str, str], *args: str, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`rlnode ARGS` as a user runs it: a child process with exactly `env`, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rlnode.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def readable_directory(prefix: str = "rlnode-shared-") -> Path:
    """A new directory any user may read: where a test puts the code of a managed Task App,
    which runs as a user of its own (pytest's own temporary directories are 0700)."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix=prefix))
    directory.chmod(0o755)
    return directory


def wait_until(check, timeout_s: float, what: str, interval_s: float = 0.5):
    """`check()`'s first truthy value within `timeout_s`, else TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"not within {timeout_s:.0f}s: {what}")


@contextlib.asynccontextmanager
async def waiting_for(
    what: str, within_s: float, progress: Callable[[], object] | None = None
) -> AsyncIterator[None]:
    """`asyncio.timeout(within_s)` that says, when it gives up, what it waited for and (from
    `progress()`) how far it got: a test that only says TimeoutError leaves a CI run's reader
    nothing to go on."""
    try:
        async with asyncio.timeout(within_s):
            yield
    except TimeoutError:
        seen = f"; so far: {progress()}" if progress is not None else ""
        raise AssertionError(f"no {what} within {within_s:g} s{seen}") from None


def fit_completions(
    model_dir: Path,
    pairs: list[tuple[list[int], list[int]]],
    steps: int,
    learning_rate: float = 1e-2,
    batch_size: int = 8,
    seed: int = 0,
) -> float:
    """Supervised fine-tuning in place, for tests that need a model that already does
    something (a random tiny model never writes a tool call by chance): the model at
    `model_dir` learns each completion after its prompt (cross entropy on the completion's
    tokens only; the output layer runs on those positions alone, most of the cost with a
    long prompt and a short answer). Returns the last batch's loss."""
    import random

    import torch

    from rlnode.models.hf import load_causal_lm

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = load_causal_lm(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    pad = model.config.pad_token_id or 0
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = [rng.choice(pairs) for _ in range(batch_size)]
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        rows: list[int] = []
        positions: list[int] = []
        targets: list[int] = []
        for row, (prompt, completion) in enumerate(batch):
            sequence = prompt + completion
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
            # The position before each completion token predicts it.
            rows += [row] * len(completion)
            positions += range(len(prompt) - 1, len(sequence) - 1)
            targets += completion
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[torch.tensor(rows), torch.tensor(positions)])
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return loss.item()
