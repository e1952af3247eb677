"""MLflow: a job is a run named by its id in the experiment "rlnode", at a tracking URI (a
server, or a database), its lifecycle kept as the run's `events.txt`. A directory becomes
`sqlite:///<dir>/mlflow.db` with the artifacts beside it (MLflow 3 keeps its file store in
maintenance only). It needs `mlflow-skinny` (pip install 'rlnode[trackers]')."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rlnode.messages import JobEvent, JobEventType
from rlnode.trackers.metrics import EventTracker
from rlnode.trackers.registry import need

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


class MlflowTracker(EventTracker):
    def __init__(self, job_id: str, out: str) -> None:
        super().__init__()
        mlflow = need("mlflow", "MLflow", "mlflow-skinny")
        self._metric = mlflow.entities.Metric
        self.client = mlflow.tracking.MlflowClient(tracking_uri(out))
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(EXPERIMENT, artifact_location=artifact_root(out))
        )
        self.run_id = self.client.create_run(experiment_id, run_name=job_id).info.run_id
        self.client.set_tag(self.run_id, "rlnode.job_id", job_id)
        self.status = "RUNNING"

    def log(self, event: JobEvent) -> None:
        self.status = STATUS.get(event.type, self.status)
        super().log(event)

    def write_scalars(self, step: int, scalars: dict[str, float], at: datetime) -> None:
        # MLflow's names allow "/" (its UI groups by them, as TensorBoard's does).
        millis = int(at.timestamp() * 1000)
        batch = [self._metric(name, value, millis, step) for name, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        if self.lines:
            self.client.log_text(self.run_id, "\n".join(self.lines) + "\n", "events.txt")
        self.client.set_terminated(self.run_id, status=self.status)
