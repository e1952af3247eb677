"""Managed Task Apps: the gateway starts the user's command in its sandbox (sandbox.py) on
a free port with the org's key injected as ENVIRONMENT_API_KEY, checks its health,
restarts it with backoff when it dies or stops answering, captures its output (with the key
blanked out), and stops it.

One asyncio task supervises each process; callers wait on `ready()`. Where it answers while
healthy goes to `announce` (the gateway records it for the node's other gateways).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rlnode.bus.localbroker import free_port
from rlnode.service.supervised import Supervised
from rlnode_services.taskapp_gateway.client import TaskAppClient, TaskAppFailure
from rlnode_services.taskapp_gateway.firewall import IsolationUnavailable, TaskAppNetwork
from rlnode_services.taskapp_gateway.keys import KeyProvider, KeyUnavailable
from rlnode_services.taskapp_gateway.sandbox import (
    Sandbox,
    kill_user_processes,
    prepare_home,
    readable_by,
)
from rlnode_services.taskapp_gateway.settings import GatewaySettings

log = logging.getLogger("taskapp_gateway.managed")

REDACTED = b"[REDACTED]"
RESERVED_ENV = frozenset({"ENVIRONMENT_API_KEY", "PORT", "HOST", "HOME", "TMPDIR"})


class State(StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    FAILED = "failed"  # cannot be started at all (e.g. no key); retried with backoff
    STOPPED = "stopped"


@dataclass
class ManagedSpec:
    org_id: str
    name: str
    argv: list[str]
    cwd: str | None
    env: dict[str, str]
    secret: str
    sandbox: Sandbox


def resolve_argv(argv: list[str]) -> list[str]:
    # "python" means the gateway's own interpreter (it has the Task App SDK installed),
    # not whichever python happens to be first on PATH.
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


@dataclass
class Status:
    state: State = State.STARTING
    pid: int | None = None
    port: int | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    last_error: str | None = None
    healthy_since: float | None = None


class ManagedTaskApp:
    def __init__(
        self,
        spec: ManagedSpec,
        keys: KeyProvider,
        client: TaskAppClient,
        settings: GatewaySettings,
        log_path: Path,
        network: TaskAppNetwork,
        announce: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        """`announce(url)` once it is healthy, `announce(None)` once it is not. `network`
        confines its user before it starts (firewall.py)."""
        self.spec = spec
        self.network = network
        self.announce = announce
        self.keys = keys
        self.client = client
        self.settings = settings
        self.log_path = log_path
        self.status = Status()
        self._key: str | None = None
        self._healthy = asyncio.Event()
        self._changed = asyncio.Event()  # replaced each time an attempt ends
        self.failed_attempts = 0  # attempts that ended without ever being healthy
        self._was_healthy = False
        # Supervision itself is supervised: if it died, the Task App would go unwatched.
        self._supervisor = Supervised(
            f"supervising Task App {spec.org_id}/{spec.name}", self._supervise
        )
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False

    @property
    def failure(self) -> str | None:
        """Why supervising this Task App died, while it waits to be started again."""
        return self._supervisor.failure

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.status.port}"

    @property
    def key(self) -> str | None:
        """The key the running process was started with."""
        return self._key

    def start(self) -> None:
        if not self._supervisor.running:
            self._stopping = False
            self._supervisor.start()

    async def ready(self, timeout_s: float) -> tuple[str, str]:
        """(base URL, key) once the process answers its health check. Fails as soon as a
        start attempt fails (exits, or never answers), with the reason, rather than
        waiting out the timeout; a process that was healthy and died is waited for."""
        self.start()
        failures_before = self.failed_attempts
        try:
            async with asyncio.timeout(timeout_s):
                while not self._healthy.is_set():
                    changed = self._changed
                    waiter = asyncio.ensure_future(self._healthy.wait())
                    try:
                        await asyncio.wait(
                            {waiter, asyncio.ensure_future(changed.wait())},
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    finally:
                        waiter.cancel()
                    if not self._healthy.is_set() and self.failed_attempts > failures_before:
                        raise TaskAppFailure(
                            "task_app_unreachable",
                            f"managed Task App {self.spec.name!r} could not be started: {self.status.last_error}",
                        )
        except TimeoutError:
            why = f": {self.status.last_error}" if self.status.last_error else ""
            raise TaskAppFailure(
                "task_app_unreachable",
                f"managed Task App {self.spec.name!r} is {self.status.state.value}, not healthy within {timeout_s:g}s{why}",
            ) from None
        assert self._key is not None
        return self.url, self._key

    async def stop(self) -> None:
        self._stopping = True
        self._healthy.clear()
        await self._supervisor.stop()
        await self._terminate()
        self.status.state = State.STOPPED
        self.status.pid = None

    # -- the supervisor ----------------------------------------------------------------

    async def _supervise(self) -> None:
        backoff = self.settings.restart_backoff_s
        while not self._stopping:
            started = time.monotonic()
            try:
                await self._run_once()
            except asyncio.CancelledError:
                raise
            except KeyUnavailable as e:
                self.status.state, self.status.last_error = State.FAILED, e.message
            except Exception as e:  # a supervisor bug must not end supervision
                log.exception("supervising %s/%s failed", self.spec.org_id, self.spec.name)
                self.status.state, self.status.last_error = State.FAILED, f"{type(e).__name__}: {e}"
            if not self._was_healthy:
                self.failed_attempts += 1
            self._healthy.clear()
            self._changed.set()
            self._changed = asyncio.Event()
            if self._stopping:
                break
            if time.monotonic() - started > self.settings.stable_after_s:
                backoff = self.settings.restart_backoff_s
            if self.status.state is not State.FAILED:
                self.status.state = State.RESTARTING
            self.status.restarts += 1
            log.warning(
                "Task App %s/%s stopped (%s); restart %d in %.1fs",
                self.spec.org_id,
                self.spec.name,
                self.status.last_error,
                self.status.restarts,
                backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.restart_backoff_max_s)

    async def _run_once(self) -> None:
        self._was_healthy = False
        self.status.state = State.STARTING
        key = await self.keys.get(self.spec.org_id, self.spec.secret, fresh=True)
        port = free_port()
        sandbox = self.spec.sandbox
        argv = resolve_argv(self.spec.argv)
        self._check_readable(argv)
        try:
            # Before its first instruction: the rules hold from the process's start.
            await self.network.confine(sandbox.uid)
        except IsolationUnavailable as e:
            raise KeyUnavailable(str(e)) from None
        home = await asyncio.to_thread(prepare_home, sandbox.home, sandbox.uid)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.spec.cwd or home,
                env=sandbox.environment(self.spec.env, key, port),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends its children too
                **sandbox.process_options(self.network.cgroup(sandbox.uid)),
            )
        except (OSError, subprocess.SubprocessError) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise KeyUnavailable(f"cannot start {self.spec.argv[0]!r}: {why}") from None
        self._key = key
        self.status.pid, self.status.port = self._proc.pid, port
        pump = asyncio.create_task(self._pump_output(self._proc, key))
        try:
            if await self._wait_healthy(self._proc):
                self.status.state, self.status.last_error = State.HEALTHY, None
                self.status.healthy_since = time.time()
                self._was_healthy = True
                self._healthy.set()
                await self._announce(self.url)
                await self._watch(self._proc)
        finally:
            self._healthy.clear()
            await self._terminate()  # first: nothing may keep it running
            if self._was_healthy:
                await self._announce(None)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pump, 5)

    async def _announce(self, url: str | None) -> None:
        if self.announce is None:
            return
        try:
            await self.announce(url)
        except Exception as e:  # the other gateways then fail to reach it; this one still can
            log.warning(
                "could not record where %s/%s answers: %s", self.spec.org_id, self.spec.name, e
            )

    def _check_readable(self, argv: list[str]) -> None:
        """A Task App running as a user of its own must be able to read its code: say so
        before it fails with a bare 'Permission denied' in its log."""
        uid = self.spec.sandbox.uid
        if uid is None:
            return
        paths = [a for a in argv if a.startswith("/") and os.path.exists(a)]
        paths += [self.spec.cwd] if self.spec.cwd else []
        for path in paths:
            if not readable_by(path, uid):
                raise KeyUnavailable(
                    f"managed Task Apps run as a user of their own (uid {uid}), who cannot read "
                    f"{path}: make it readable by others (chmod o+r, and o+x on each directory "
                    "above it)"
                )

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> bool:
        deadline = time.monotonic() + self.settings.start_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                self.status.last_exit_code = proc.returncode
                self.status.last_error = (
                    f"exited with code {proc.returncode} while starting; see its log"
                )
                return False
            try:
                await self.client.get_json(self.url, "/health", self._key, timeout_s=2.0)
                return True
            except TaskAppFailure as e:
                last = e.message
            await asyncio.sleep(0.1)
        self.status.last_error = f"not healthy within {self.settings.start_timeout_s:g}s ({last})"
        return False

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Until the process exits or fails its health check `unhealthy_after` times in a row."""
        failures = 0
        exited = asyncio.create_task(proc.wait())
        try:
            while True:
                done, _ = await asyncio.wait({exited}, timeout=self.settings.health_interval_s)
                if done:
                    self.status.last_exit_code = proc.returncode
                    self.status.last_error = f"exited with code {proc.returncode}"
                    return
                try:
                    await self.client.get_json(
                        self.url,
                        "/health",
                        self._key,
                        timeout_s=min(5.0, self.settings.health_interval_s),
                    )
                    failures = 0
                except TaskAppFailure as e:
                    failures += 1
                    if failures >= self.settings.unhealthy_after:
                        self.status.last_error = (
                            f"failed {failures} health checks in a row ({e.message}); restarting it"
                        )
                        return
        finally:
            exited.cancel()

    async def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        try:
            await self._stop_process(proc)
        finally:
            uid = self.spec.sandbox.uid
            if uid is not None:  # what it left running in a session of its own goes too
                await asyncio.to_thread(kill_user_processes, uid)

    async def _stop_process(self, proc: asyncio.subprocess.Process | None) -> None:
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.settings.stop_grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        self.status.last_exit_code = proc.returncode

    async def _pump_output(self, proc: asyncio.subprocess.Process, key: str) -> None:
        """Copy the process's output to its log, with the key blanked out wherever it
        appears. Whole lines are written (a key never spans a newline); a partial line is
        held until its newline, the end of output, or 64 KiB."""
        secret = key.encode()
        pending = b""
        assert proc.stdout is not None
        with open(self.log_path, "ab") as out:  # noqa: ASYNC230 -- small appends to a local log
            while True:
                chunk = await proc.stdout.read(65536)
                pending += chunk
                if not chunk:
                    cut = len(pending)
                elif (newline := pending.rfind(b"\n")) >= 0:
                    cut = newline + 1
                elif len(pending) > 65536:
                    # A very long line: blank the keys it holds, and keep back what could be
                    # the start of one that the next read completes.
                    pending = pending.replace(secret, REDACTED) if secret else pending
                    cut = len(pending) - max(len(secret) - 1, 0)
                else:
                    continue
                out.write(pending[:cut].replace(secret, REDACTED) if secret else pending[:cut])
                out.flush()
                pending = pending[cut:]
                if not chunk:
                    return

    def log_tail(self, max_bytes: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
