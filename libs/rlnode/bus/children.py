"""What the node's broker shares with other child processes of ours: a free
port to listen on, whether they run, and a stop that asks first (SIGTERM) and insists
after a timeout (SIGKILL)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import BinaryIO

# Ports this process handed out lately: free to the kernel until their process binds them,
# so it can offer one again; a node starting its services gave the gateway's to a generator.
_HANDED_OUT: deque[int] = deque(maxlen=4096)
_HANDED_OUT_LOCK = threading.Lock()

# Where free ports come from when set ("LOW-HIGH"), instead of the kernel's choice: processes
# that pick ports side by side (a test run's workers) each get a range of their own, below the
# kernel's ephemeral range, so no two of them, and no outgoing connection, take the same port
# between its pick and its bind.
FREE_PORTS_ENV = "RLNODE_FREE_PORTS"


def free_port_range() -> tuple[int, int] | None:
    """The range `RLNODE_FREE_PORTS` names (both ends included), None when it is unset."""
    value = os.environ.get(FREE_PORTS_ENV, "").strip()
    if not value:
        return None
    try:
        low, high = (int(end) for end in value.split("-"))
    except ValueError:
        raise ValueError(
            f"{FREE_PORTS_ENV}={value!r}: expected LOW-HIGH, e.g. 20000-25999"
        ) from None
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"{FREE_PORTS_ENV}={value!r}: expected 1024 <= LOW < HIGH <= 65535")
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, and none this process handed out lately (from
    `RLNODE_FREE_PORTS` when it is set)."""
    span = free_port_range()
    with _HANDED_OUT_LOCK:
        for _ in range(100 if span is None else 1000):
            with socket.socket() as s:
                try:
                    s.bind((host, 0 if span is None else random.randint(*span)))
                except OSError:  # taken (or in TIME_WAIT): another pick
                    continue
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    where = f" in {FREE_PORTS_ENV}={span[0]}-{span[1]}" if span else ""
    raise OSError(f"no free port on {host}{where} that this process has not handed out lately")


def open_log(path: Path) -> BinaryIO:
    """`path` opened for appending, made 0600 (in a 0700 directory if it makes one): what a
    broker or store logs is the node's, like the rest of its data dir."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    if os.fstat(fd).st_uid == os.geteuid():  # one an earlier version left readable
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


class ChildProcess:
    _proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def _spawn(self, argv: list[str], log_prefix: str, env: dict[str, str] | None = None) -> None:
        """Start `argv` as this child: in a session of its own (Ctrl-C in a terminal reaches
        us, and we stop it in order), its output appended to its log (a temporary file
        named from `log_prefix` unless it has one), what it writes readable by this user
        alone (umask 077: a broker's log directories hold every org's records)."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open_log(self.log_path) as log:
            self._proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                umask=0o077,
            )

    def _log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def _terminate(self, timeout_s: float) -> None:
        """SIGTERM the process, SIGKILL it if it has not exited within `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
