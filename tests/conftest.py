"""Fixtures that give tests real infrastructure (docs/architecture.md §7)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlnode.bus import Bus
from rlnode.bus.settings import KafkaSettings
from rlnode.testing import (
    BrokerHandle,
    broker_with_topics,
    postgres_admin_url,
    temporary_postgres_database,
    waiting_for,
)


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker (and everything it starts) picks free ports from a range of
    its own, below the ephemeral range: two workers asking the kernel at once could both be
    offered the same port before either bound it."""
    from rlnode.bus.children import FREE_PORTS_ENV
    from rlnode.testing import worker_port_range

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    os.environ.setdefault(FREE_PORTS_ENV, worker_port_range(int(worker), int(workers)))
    # Every broker the tests start lives for a minute or two: C1 alone starts it on about
    # half the CPU (rlnode.bus.localbroker.PERFORMANCE_ENV).
    from rlnode.bus.localbroker import JVM_OPTIONS, PERFORMANCE_ENV

    os.environ.setdefault(PERFORMANCE_ENV, " ".join((*JVM_OPTIONS, "-XX:TieredStopAtLevel=1")))


# Test files that share a node of their own (a package-scoped fixture) run on one worker,
# one after the other, so that the node is made once and let go when the last of them ends:
# tests/security's attacked node (two workers each made one, and held it, idle at a fifth of
# a core, to the end of the session).
SHARED_NODE_PACKAGES = ("tests/security/",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with each of SHARED_NODE_PACKAGES one unit of work."""
    from xdist.scheduler import LoadFileScheduling

    class LoadFileAndSharedNodes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for package in SHARED_NODE_PACKAGES:
                if nodeid.startswith(package):
                    return package
            return super()._split_scope(nodeid)

    if config.getoption("dist") != "loadfile":
        return None  # xdist's own for any other mode
    return LoadFileAndSharedNodes(config, log)


# The longest test files (worker-seconds in a whole run here, 2026-12-07): handed out
# first, so that none of them starts last and holds the run while the other worker idles
# (with collection order, the three hosts' 345 s began near the end).
LONGEST_FIRST = (
    "tests/integration/test_tinker_cookbook.py",  # 402
    "tests/integration/test_run_flow.py",  # 350
    "tests/multihost/test_hosts.py",  # 345
    "tests/integration/test_learner.py",  # 309
    "tests/integration/test_rollout_generator.py",  # 303
    "tests/chaos/test_kill_each_process.py",  # 253
    "tests/integration/test_real_model_job.py",  # 240
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        pass
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_data_dir(tmp_path, monkeypatch) -> None:
    """No test writes to the user's ~/.rlnode."""
    monkeypatch.setenv("RLNODE_DATA_DIR", str(tmp_path / "rlnode-data"))


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]
) -> Path:
    """`build(directory)` (a path it makes) once per session, by whichever pytest-xdist
    worker asks first; the others wait for it and share what it made, without writing to it.
    Each worker built its own before: the tool model, 50 CPU-seconds a worker."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the session's, above each worker's own
    directory, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that failed half-way
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    """A tiny Qwen2-shaped model fine-tuned to call the calculator tool (tests/tool_model.py):
    built once per session, for the tests that train on tool use."""
    from tests.tool_model import build_tool_model

    return built_once(tmp_path_factory, "tool-model", build_tool_model)


@pytest.fixture(scope="session")
def smollm2_store(tmp_path_factory) -> Path:
    """A model store holding SmolLM2-135M-Instruct, imported once per session from the GGUF
    its package ships (make setup installs it): the real model's tests share it."""
    from rlnode.models.catalogue import packaged_gguf
    from rlnode.models.gguf import import_gguf

    def imported(store: Path) -> None:
        store.mkdir()
        import_gguf(packaged_gguf("smollm2-135m-instruct"), store, "float32")

    return built_once(tmp_path_factory, "model-store", imported)


@pytest.fixture(scope="session")
def smollm2(smollm2_store: Path) -> Path:
    """The imported SmolLM2-135M-Instruct's HF directory (float32)."""
    (directory,) = smollm2_store.iterdir()
    return directory


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[BrokerHandle]:
    """One broker for the session, with the topics created."""
    with broker_with_topics() as handle:
        yield handle


@pytest.fixture
def kafka_settings(kafka_broker: BrokerHandle) -> KafkaSettings:
    # 6 s is Kafka's minimum session timeout: a member that left without a word (a killed
    # consumer) holds its partitions no longer than that.
    return KafkaSettings(
        bootstrap_servers=kafka_broker.bootstrap_servers,
        session_timeout_ms=6000,
        heartbeat_interval_ms=2000,
    )


@pytest.fixture
async def make_bus(kafka_settings: KafkaSettings) -> AsyncIterator[Callable[..., Bus]]:
    """Build buses that are stopped when the test ends (the broker fixture made the topics)."""
    buses: list[Bus] = []

    def factory(
        service: str = "test", settings: KafkaSettings | None = None, **signing: Any
    ) -> Bus:
        """`signing`: `signer=` to publish as a service would (records:sign), `verifier=`."""
        bus = Bus(settings or kafka_settings, service=service, **signing)
        buses.append(bus)
        return bus

    yield factory
    for bus in reversed(buses):
        with contextlib.suppress(Exception):
            await bus.stop()


@contextlib.contextmanager
def fresh_database(kind: str, directory: Path) -> Iterator[str]:
    """A fresh, empty database of `kind` ("sqlite" or "postgresql"); skips the test when
    PostgreSQL does not answer."""
    if kind == "sqlite":
        yield f"sqlite:///{directory / 'test.sqlite3'}"
        return
    admin = postgres_admin_url()
    if admin is None:
        pytest.skip("PostgreSQL does not answer (DATABASE_URL or 127.0.0.1:5432)")
    with temporary_postgres_database(admin) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> Iterator[str]:
    """A fresh, empty database: SQLite always, PostgreSQL where one answers."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


async def next_matching(
    queue: asyncio.Queue, predicate: Callable[[object], bool], within_s: float = 30.0
):
    """The next item on `queue` that matches (others are dropped: the broker may be shared)."""
    dropped: list[object] = []
    async with waiting_for("matching item", within_s, lambda: f"{len(dropped)} others"):
        while True:
            item = await queue.get()
            if predicate(item):
                return item
            dropped.append(item)


async def eventually(condition: Callable[[], bool], within_s: float, what: str) -> None:
    """Until `condition()` holds (checked every 50 ms); fails naming `what` after `within_s`.
    For state with no event to wait on; never a timing assertion."""
    for _ in range(max(1, int(within_s / 0.05))):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {within_s:g}s: {what}")
