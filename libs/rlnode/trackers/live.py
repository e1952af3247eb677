"""A job's `[logging]`: its events, as they happen, into the trackers it names, under the
job's directory (`<dir>/tensorboard/`, `<dir>/mlflow/`, `<dir>/wandb/`).

One thread writes them, fed by a queue: the job loop never waits on a tracker's disk or
import, and a tracker that fails is reported once and dropped, never failing the job."""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any

from rlnode.messages import JobEvent
from rlnode.messages.config import LoggingSpec
from rlnode.trackers.registry import Tracker, open_tracker

log = logging.getLogger("rlnode.trackers.live")

_CLOSE = object()


class LiveTrackers:
    def __init__(self, job_id: str, spec: LoggingSpec, directory: Path) -> None:
        self.job_id = job_id
        self.spec = spec
        self.directory = directory
        self.failures: dict[str, str] = {}  # tracker -> why it was dropped
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._write, name=f"trackers {job_id}", daemon=True)
        self._thread.start()

    def where(self) -> str:
        """Where each tracker writes, for people."""
        return ", ".join(f"{name} in {self.directory / name}" for name in self.spec.trackers)

    def log(self, event: JobEvent) -> None:
        self._queue.put(event)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued, close every tracker; give up waiting after `timeout_s`."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("job %s: trackers still writing after %.0fs", self.job_id, timeout_s)

    def _open(self) -> dict[str, Tracker]:
        opened: dict[str, Tracker] = {}
        for name in self.spec.trackers:
            options: dict[str, Any] = {}
            if name == "wandb" and self.spec.wandb is not None:
                wandb = self.spec.wandb
                options = {"project": wandb.project, "run_name": wandb.run_name, "mode": "offline"}
            try:
                opened[name] = open_tracker(
                    name, self.job_id, str(self.directory / name), **options
                )
            except Exception as e:
                self._drop(name, e)
        return opened

    def _write(self) -> None:
        trackers = self._open()
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                break
            for name, tracker in list(trackers.items()):
                try:
                    tracker.log(item)
                except Exception as e:
                    self._drop(name, e)
                    del trackers[name]
        for name, tracker in trackers.items():
            try:
                tracker.close()
            except Exception as e:
                self._drop(name, e)

    def _drop(self, name: str, error: Exception) -> None:
        self.failures[name] = f"{type(error).__name__}: {error}"
        log.warning("job %s: tracker %s dropped: %s", self.job_id, name, self.failures[name])
