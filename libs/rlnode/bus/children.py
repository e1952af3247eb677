"""What the embedded broker and its object store share as child processes of ours: a free
port to listen on, whether they run, and a stop that asks first (SIGTERM) and insists
after a timeout (SIGKILL)."""

from __future__ import annotations

import os
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, and none this process handed out lately."""
    with _HANDED_OUT_LOCK:
        for _ in range(100):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    raise OSError(f"no free port on {host} that this process has not handed out lately")


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
        named from `log_prefix` unless it has one)."""
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
