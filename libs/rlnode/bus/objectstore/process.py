"""The object store as a child process, and its access key.

`LocalObjectStore(data_dir).start()` serves `data_dir` on a loopback port (the same one
when started again, so a broker configured with it finds it back); `client_env()` is the
environment that points an object_store (AWS) client at it. The access key is minted on
first use into a file only its owner can read, like the node's other secrets."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlnode.bus.children import ChildProcess, free_port
from rlnode.bus.objectstore.sigv4 import Credentials

BUCKET = "tansu"


# How often the store applies the broker's topic retention (rlnode.bus.objectstore.retention).
RETENTION_EVERY_S = 30.0


class ObjectStoreError(RuntimeError):
    pass


def ensure_credentials(path: Path) -> Credentials:
    """The access key in `path`, minted (0600, written once) if it is not there yet."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    minted = {
        "access_key_id": "RLNODE" + secrets.token_hex(7).upper(),
        "secret_access_key": secrets.token_urlsafe(30),
        "region": "us-east-1",
    }
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(minted) + "\n")
    return read_credentials(path)


def read_credentials(path: Path) -> Credentials:
    try:
        return Credentials(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ObjectStoreError(f"cannot read the object store's access key from {path}: {e}") from e


class LocalObjectStore(ChildProcess):
    def __init__(
        self,
        data_dir: Path,
        credentials_path: Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 15.0,
        retention_every_s: float = RETENTION_EVERY_S,
        once_read_s: dict[str, float] | None = None,
    ) -> None:
        """`retention_every_s`: how often the broker's topic retention is applied to the
        records held here (rlnode.bus.objectstore.retention; 0: never); `once_read_s`: the
        topics whose records go once their groups have read them, and after how long."""
        self.data_dir = data_dir
        self.retention_every_s = retention_every_s
        self.once_read_s = dict(once_read_s or {})
        self.credentials_path = credentials_path or data_dir / "credentials.json"
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def credentials(self) -> Credentials:
        return read_credentials(self.credentials_path)

    def client_env(self) -> dict[str, str]:
        """What an object_store / AWS client needs to use this store."""
        credentials = self.credentials
        return {
            "AWS_ENDPOINT": self.url,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": credentials.access_key_id,
            "AWS_SECRET_ACCESS_KEY": credentials.secret_access_key,
            "AWS_DEFAULT_REGION": credentials.region,
            "AWS_REGION": credentials.region,
        }

    def start(self) -> LocalObjectStore:
        if self.running:
            return self
        ensure_credentials(self.credentials_path)
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        command = [sys.executable, "-m", "rlnode.bus.objectstore", "--data-dir", str(self.data_dir)]
        command += ["--credentials", str(self.credentials_path), "--bucket", BUCKET]
        command += ["--host", self.host, "--port", str(self.port)]
        command += ["--retention-every-s", str(self.retention_every_s)]
        for topic, seconds in sorted(self.once_read_s.items()):
            command += ["--once-read", f"{topic}={seconds}"]
        self._spawn(command, "rlnode-objectstore-")
        deadline = time.monotonic() + self.start_timeout_s
        while not _listening(self.host, self.port):
            if self._proc is None or self._proc.poll() is not None or time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise ObjectStoreError(
                    f"the object store did not listen on {self.url} (log {self.log_path}):\n{tail}"
                )
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._terminate(timeout_s)

    def __enter__(self) -> LocalObjectStore:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
        return True
    return False
