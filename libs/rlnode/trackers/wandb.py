"""Weights & Biases: a job is a run named by its id in the project "rlnode", written under
`out`. Offline unless WANDB_MODE says otherwise (`wandb sync <out>/wandb/offline-run-*`
uploads it later); W&B keeps only rising steps, so a resumed job's repeated steps are
dropped there. It needs `wandb` (pip install 'rlnode[trackers]')."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlnode.messages import JobEvent, JobEventType
from rlnode.trackers.metrics import metrics_of
from rlnode.trackers.registry import TrackerUnavailable

PROJECT = "rlnode"
EXIT_CODE = {JobEventType.COMPLETED: 0, JobEventType.FAILED: 1, JobEventType.CANCELLED: 1}


class WandbTracker:
    def __init__(self, job_id: str, out: Path) -> None:
        try:
            import wandb
        except ImportError as e:
            raise TrackerUnavailable(
                f"W&B needs its client ({e}): pip install 'rlnode[trackers]' (or pip install wandb)"
            ) from None
        out.mkdir(parents=True, exist_ok=True)
        self.run: Any = wandb.init(
            project=PROJECT,
            name=job_id,
            dir=str(out),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            config={"job_id": job_id},
            reinit="create_new",
        )
        self.lines: list[str] = []
        self.exit_code = 0
        self.last_step = 0

    def log(self, event: JobEvent) -> None:
        self.exit_code = EXIT_CODE.get(event.type, self.exit_code)
        metrics = metrics_of(event, self.last_step)
        if metrics is None:
            return
        if metrics.scalars and metrics.step >= self.last_step:
            self.run.log(metrics.scalars, step=metrics.step)
        self.last_step = max(self.last_step, metrics.step)
        if metrics.text is not None:
            self.lines.append(f"{event.ts.isoformat()} step {metrics.step} {metrics.text}")

    def close(self) -> None:
        self.run.summary["events"] = "\n".join(self.lines)
        self.run.finish(exit_code=self.exit_code)
