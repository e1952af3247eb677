"""TensorBoard: a job is a run directory `<out>/<job_id>` of event files, written with
torch's SummaryWriter (it needs the `tensorboard` package: pip install 'rlnode[trackers]')."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rlnode.trackers.metrics import EventTracker
from rlnode.trackers.registry import need


class TensorBoardTracker(EventTracker):
    def __init__(self, job_id: str, out: Path) -> None:
        super().__init__()
        need("tensorboard", "TensorBoard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = out / job_id
        self.writer = SummaryWriter(log_dir=str(self.run_dir))

    def write_scalars(self, step: int, scalars: dict[str, float], at: datetime) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step, walltime=at.timestamp())

    def write_text(self, step: int, text: str, at: datetime) -> None:
        self.writer.add_text("events", text, step, walltime=at.timestamp())

    def close(self) -> None:
        self.writer.close()
