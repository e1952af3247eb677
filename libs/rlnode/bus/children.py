"""What the embedded broker and its object store share as child processes of ours: a free
port to listen on, whether they run, and a stop that asks first (SIGTERM) and insists
after a timeout (SIGKILL)."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ChildProcess:
    _proc: subprocess.Popen | None = None

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
