"""Service processes: start one of rlnode's services as a child process, wait for its health
check, stop it with SIGTERM. Used by the node, the supervisor and `rlnode doctor`."""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlnode.service.files import private_dir, private_file
from rlnode.service.registry import ServiceSpec
from rlnode.service.stacks import DUMP_SIGNAL

STACK_DUMP_WAIT_S = 2.0  # for a stuck service's stacks to reach its log before SIGKILL
# Signals whose default would end this process on the spot, without `finally:` blocks.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class TerminationUnwinds:
    """While held (by each LocalNode that is up): a SIGTERM or SIGHUP that this process left
    at its default raises SystemExit in the main thread instead, so that `with LocalNode()`
    and `finally:` stop the services. Each runs in a session of its own (so that it takes
    what it started with it) and would otherwise outlive a benchmark or script killed with
    a signal, holding ports, memory and GPUs. A process that handles the signals itself
    (`rlnode up`) keeps its handlers; off the main thread nothing changes."""

    _holders = 0
    _installed: dict[signal.Signals, Any] = {}

    @classmethod
    def hold(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        cls._holders += 1
        if cls._holders > 1:
            return
        for sig in TERMINATING:
            if signal.getsignal(sig) is signal.SIG_DFL:
                cls._installed[sig] = signal.signal(sig, cls._unwind)

    @classmethod
    def release(cls) -> None:
        if threading.current_thread() is not threading.main_thread() or cls._holders == 0:
            return
        cls._holders -= 1
        if cls._holders == 0:
            for sig, previous in cls._installed.items():
                signal.signal(sig, previous)
            cls._installed.clear()

    @staticmethod
    def _unwind(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # the exit status a shell shows for the signal


@dataclass(frozen=True)
class LocalCredentials:
    """The embedded node's own vault master key and admin token, made on first use and kept
    (mode 600) under the data directory. Production sets VAULT_MASTER_KEY(_FILE) and
    VAULT_ADMIN_TOKEN itself."""

    master_key_file: Path
    admin_token_file: Path

    @property
    def admin_token(self) -> str:
        return self.admin_token_file.read_text().strip()

    def vault_env(self) -> dict[str, str]:
        return {
            "VAULT_MASTER_KEY_FILE": str(self.master_key_file),
            "VAULT_ADMIN_TOKEN": self.admin_token,
        }


def ensure_local_credentials(data_dir: Path) -> LocalCredentials:
    directory = private_dir(data_dir / "secrets")
    master, admin = directory / "vault-master.key", directory / "vault-admin.token"
    _write_once(master, base64.b64encode(secrets.token_bytes(32)).decode())
    _write_once(admin, secrets.token_urlsafe(32))
    return LocalCredentials(master, admin)


def _write_once(path: Path, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


class ServiceFailed(RuntimeError):
    pass


class PortTaken(ServiceFailed):
    """Another process answers on the port this service was given."""


class ServiceProcess:
    def __init__(
        self,
        spec: ServiceSpec,
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.spec = spec
        self.host = host
        self.port = port
        self.log_path = log_path
        self.env = {
            **os.environ,
            **(env or {}),
            f"{spec.env_prefix}HOST": host,
            f"{spec.env_prefix}PORT": str(port),
        }
        self.proc: subprocess.Popen | None = None
        self._terminated = False  # SIGTERM sent by terminate(); stop() waits for it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url + self.spec.health_path

    def start(self) -> ServiceProcess:
        self._terminated = False
        private_file(self.log_path)
        with open(self.log_path, "ab") as log:
            self._reap_group()  # what an earlier run of this service left behind
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.spec.package],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # A process group of its own: the processes a service starts (vLLM's engine
                # core and workers, training ranks, managed Task Apps) go with it, even when
                # it was killed before it could stop them (they would hold memory and GPUs).
                start_new_session=True,
            )
        return self

    def _reap_group(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> int | None:
        """SIGKILL it and what it started; its exit code."""
        self._reap_group()
        return self.proc.wait() if self.proc is not None else None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    # A service's start is mostly imports (torch, transformers): six of them importing at
    # once beside a busy neighbour on two cores took 33 s in CI. The wait returns as soon as
    # the service answers, so the bound is for a service that never will.
    HEALTHY_WITHIN_S = 120.0

    def wait_healthy(self, timeout_s: float = HEALTHY_WITHIN_S) -> dict[str, Any]:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServiceFailed(
                    f"{self.spec.name} exited with code {self.proc.returncode} before it was "
                    f"healthy; its log ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                response = httpx.get(self.health_url, timeout=1.0)
                if response.status_code == 200:
                    return self._own_health(response.json())
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise ServiceFailed(
            f"{self.spec.name} was not healthy at {self.url} within {timeout_s:.0f}s; "
            f"its log ({self.log_path}):\n{self.log_tail()}"
        )

    def _own_health(self, body: dict[str, Any]) -> dict[str, Any]:
        """The health of this process, not of another that answers on its port: a port
        picked free can be taken before the service binds it (a restarted service of another
        node on this machine took one in CI, and the node then talked to that one)."""
        assert self.proc is not None
        answered = body.get("pid")
        if answered is not None and answered != self.proc.pid:
            self.kill()
            raise PortTaken(
                f"{self.spec.name}: port {self.port} answers as pid {answered} "
                f"({body.get('service')}), not as this {self.spec.name} (pid {self.proc.pid}): "
                "another process holds the port; stop it, or pick other ports (--port-base)"
            )
        return body

    def terminate(self) -> None:
        """SIGTERM without waiting, so that several stop at once; stop() waits for it."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL if it has not stopped within `timeout_s`; the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # Its stacks into its log first: what it was waiting on (service/stacks.py).
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(DUMP_SIGNAL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(STACK_DUMP_WAIT_S)
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._reap_group()
        return self.proc.returncode
