"""TensorBoard: a job is a run directory `<out>/<job_id>` of event files, written with
torch's SummaryWriter (it needs the `tensorboard` package: pip install 'rlnode[trackers]')."""

from __future__ import annotations

from pathlib import Path

from rlnode.messages import JobEvent
from rlnode.trackers.metrics import metrics_of
from rlnode.trackers.registry import TrackerUnavailable


class TensorBoardTracker:
    def __init__(self, job_id: str, out: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerUnavailable(
                f"TensorBoard needs its package ({e}): pip install 'rlnode[trackers]' "
                "(or pip install tensorboard)"
            ) from None
        self.run_dir = out / job_id
        self.writer = SummaryWriter(log_dir=str(self.run_dir))
        self.last_step = 0

    def log(self, event: JobEvent) -> None:
        metrics = metrics_of(event, self.last_step)
        if metrics is None:
            return
        self.last_step = max(self.last_step, metrics.step)
        wall_time = event.ts.timestamp()
        for name, value in metrics.scalars.items():
            self.writer.add_scalar(name, value, metrics.step, walltime=wall_time)
        if metrics.text is not None:
            self.writer.add_text("events", metrics.text, metrics.step, walltime=wall_time)

    def close(self) -> None:
        self.writer.close()
