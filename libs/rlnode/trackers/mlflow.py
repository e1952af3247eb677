"""MLflow: a job is a run named by its id in the experiment "rlnode", at a tracking URI (a
server, or a database), its lifecycle kept as the run's `events.txt`. A directory becomes
`sqlite:///<dir>/mlflow.db` with the artifacts beside it (MLflow 3 keeps its file store in
maintenance only). It needs `mlflow-skinny` (pip install 'rlnode[trackers]')."""

from __future__ import annotations

from pathlib import Path

from rlnode.messages import JobEvent, JobEventType
from rlnode.trackers.metrics import metrics_of
from rlnode.trackers.registry import TrackerUnavailable

EXPERIMENT = "rlnode"
STATUS = {
    JobEventType.COMPLETED: "FINISHED",
    JobEventType.FAILED: "FAILED",
    JobEventType.CANCELLED: "KILLED",
}


def tracking_uri(out: str) -> str:
    """A server or database URI as given; a directory as a SQLite database in it."""
    if "://" in out:
        return out
    directory = Path(out).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{directory / 'mlflow.db'}"


def artifact_root(out: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local database; the server's
    default otherwise."""
    return None if "://" in out else (Path(out).resolve() / "artifacts").as_uri()


class MlflowTracker:
    def __init__(self, job_id: str, out: str) -> None:
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise TrackerUnavailable(
                f"MLflow needs its client ({e}): pip install 'rlnode[trackers]' "
                "(or pip install mlflow-skinny)"
            ) from None
        self._metric = Metric
        self.client = MlflowClient(tracking_uri(out))
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(EXPERIMENT, artifact_location=artifact_root(out))
        )
        self.run_id = self.client.create_run(experiment_id, run_name=job_id).info.run_id
        self.client.set_tag(self.run_id, "rlnode.job_id", job_id)
        self.lines: list[str] = []
        self.status = "RUNNING"
        self.last_step = 0

    def log(self, event: JobEvent) -> None:
        self.status = STATUS.get(event.type, self.status)
        metrics = metrics_of(event, self.last_step)
        if metrics is None:
            return
        self.last_step = max(self.last_step, metrics.step)
        millis = int(event.ts.timestamp() * 1000)
        if metrics.scalars:
            # MLflow's names allow "/" (its UI groups by them, as TensorBoard's does).
            batch = [
                self._metric(name, value, millis, metrics.step)
                for name, value in metrics.scalars.items()
            ]
            self.client.log_batch(self.run_id, metrics=batch)
        if metrics.text is not None:
            self.lines.append(f"{event.ts.isoformat()} step {metrics.step} {metrics.text}")

    def close(self) -> None:
        if self.lines:
            self.client.log_text(self.run_id, "\n".join(self.lines) + "\n", "events.txt")
        self.client.set_terminated(self.run_id, status=self.status)
