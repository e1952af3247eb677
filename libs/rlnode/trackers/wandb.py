"""Weights & Biases: a job is a run named by its id in the project "rlnode", written under
`out`. Offline unless WANDB_MODE says otherwise (`wandb sync <out>/wandb/offline-run-*`
uploads it later); W&B keeps only rising steps, so a resumed job's repeated steps are
dropped there. It needs `wandb` (pip install 'rlnode[trackers]')."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

from rlnode.messages import JobEvent, JobEventType
from rlnode.trackers.metrics import EventTracker
from rlnode.trackers.registry import need

PROJECT = "rlnode"
EXIT_CODE = {JobEventType.COMPLETED: 0, JobEventType.FAILED: 1, JobEventType.CANCELLED: 1}


class WandbTracker(EventTracker):
    def __init__(
        self,
        job_id: str,
        out: Path,
        project: str | None = None,
        run_name: str | None = None,
        mode: str | None = None,
    ) -> None:
        """`mode`: default WANDB_MODE, else offline."""
        super().__init__()
        wandb = need("wandb", "W&B", "wandb")
        out.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(
            project=project or PROJECT,
            name=run_name or job_id,
            dir=str(out),
            mode=mode or os.environ.get("WANDB_MODE", "offline"),
            config={"job_id": job_id},
            reinit="create_new",
        )
        self.exit_code = 0

    def log(self, event: JobEvent) -> None:
        self.exit_code = EXIT_CODE.get(event.type, self.exit_code)
        super().log(event)

    def write_scalars(self, step: int, scalars: dict[str, float], at: datetime) -> None:
        if step >= self.last_step:  # W&B drops (with a warning) a step below its last
            self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.summary["events"] = "\n".join(self.lines)
        self.run.finish(exit_code=self.exit_code)
