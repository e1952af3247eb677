"""A job's events into TensorBoard, read back with TensorBoard's own reader."""

from __future__ import annotations

import zlib
from datetime import UTC, datetime, timedelta

import pytest

from rlnode.messages import JobEvent, JobEventType
from rlnode.testing import wait_until
from rlnode.trackers import metrics_of, open_tracker

pytest.importorskip("tensorboard", reason="make setup installs it (the dev extra)")


def event(kind: JobEventType, second: int, message: str = "", **data) -> JobEvent:
    return JobEvent(
        job_id="job-t",
        org_id="org-t",
        type=kind,
        source="learner",
        message=message or kind.value,
        data=data,
        ts=datetime(2026, 12, 2, tzinfo=UTC) + timedelta(seconds=second),
    )


def train_step(step: int, reward: float) -> JobEvent:
    return event(
        JobEventType.TRAIN_STEP,
        step,
        step=step,
        total_steps=3,
        loss=0.5 / step,
        reward_mean=reward,
        reward_std=0.1,
        kl=None,
        clip_fraction=0.0,
        staleness_min=0,
        staleness_mean=0.5,
        staleness_max=1,
        tokens_per_s=100.0,
        wait_s=0.2,
        compute_s=0.1,
    )


def test_the_mapping_places_batches_at_the_step_that_trains_them() -> None:
    batch = event(
        JobEventType.ROLLOUT_BATCH, 0, step=0, count=8, failed=2, reward_mean=0.25, reward_std=0.0
    )
    metrics = metrics_of(batch, last_step=0)
    assert metrics is not None and metrics.step == 1
    assert metrics.scalars == {
        "rollouts/count": 8.0,
        "rollouts/failed": 2.0,
        "rollouts/reward_mean": 0.25,
        "rollouts/reward_std": 0.0,
    }
    trained = metrics_of(train_step(2, 0.5), last_step=1)
    assert trained is not None and trained.step == 2 and "train/kl" not in trained.scalars
    assert "train/total_steps" not in trained.scalars
    done = metrics_of(event(JobEventType.COMPLETED, 9, "completed 3 steps", steps=3), last_step=3)
    assert done is not None and done.step == 3 and done.text == "job.completed: completed 3 steps"
    published = event(
        JobEventType.WEIGHTS_PUBLISHED, 1, version=1, step=1, uri="file:///w", blake3="0"
    )
    assert metrics_of(published, last_step=1) is None
    evaluated = event(
        JobEventType.EVAL_COMPLETED,
        2,
        step=2,
        version=2,
        seeds=4,
        samples_per_seed=2,
        count=8,
        failed=0,
        reward_mean=0.75,
        reward_std=0.25,
        pass_at_1=0.5,
        pass_at_k=0.75,
        k=2,
        pass_threshold=1.0,
        temperature=0.0,
        duration_s=1.5,
        per_seed=[],
    )
    round_ = metrics_of(evaluated, last_step=3)
    assert round_ is not None and round_.step == 2  # at the step evaluated, not the last seen
    assert round_.scalars == {
        "eval/reward_mean": 0.75,
        "eval/reward_std": 0.25,
        "eval/pass_at_1": 0.5,
        "eval/pass_at_k": 0.75,
        "eval/count": 8.0,
        "eval/failed": 0.0,
    }


def test_tensorboard_holds_every_step_and_value(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = open_tracker("tensorboard", "job-t", str(tmp_path))
    rewards = [0.1, 0.4, 0.7]
    tracker.log(event(JobEventType.ACCEPTED, 0, steps=3))
    for step, reward in enumerate(rewards, start=1):
        batch = {
            "step": step - 1,
            "count": 8,
            "failed": 0,
            "reward_mean": reward,
            "reward_std": 0.0,
        }
        tracker.log(event(JobEventType.ROLLOUT_BATCH, step, **batch))
        tracker.log(train_step(step, reward))
    tracker.log(event(JobEventType.COMPLETED, 9, "completed 3 steps", steps=3))
    tracker.close()

    run = EventAccumulator(str(tmp_path / "job-t"))
    run.Reload()
    read = run.Scalars("train/reward_mean")
    assert [s.step for s in read] == [1, 2, 3]
    assert [s.value for s in read] == pytest.approx(rewards)
    assert read[0].wall_time == pytest.approx(
        datetime(2026, 12, 2, 0, 0, 1, tzinfo=UTC).timestamp()
    )
    assert [s.step for s in run.Scalars("rollouts/count")] == [1, 2, 3]
    assert "train/loss" in run.Tags()["scalars"]


def test_an_unknown_tracker_names_the_known_ones(tmp_path) -> None:
    with pytest.raises(ValueError, match="no tracker 'neptune'; choose one of mlflow, tensorboard"):
        open_tracker("neptune", "job-t", str(tmp_path))


def test_mlflow_holds_every_step_and_value_and_the_runs_end(tmp_path) -> None:
    pytest.importorskip("mlflow", reason="make setup installs it (the dev extra)")
    from mlflow.tracking import MlflowClient

    from rlnode.trackers.mlflow import EXPERIMENT, tracking_uri

    tracker = open_tracker("mlflow", "job-t", str(tmp_path / "mlruns"))
    rewards = [0.1, 0.4, 0.7]
    tracker.log(event(JobEventType.ACCEPTED, 0, steps=3))
    for step, reward in enumerate(rewards, start=1):
        tracker.log(train_step(step, reward))
    tracker.log(event(JobEventType.COMPLETED, 9, "completed 3 steps", steps=3))
    tracker.close()

    client = MlflowClient(tracking_uri(str(tmp_path / "mlruns")))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "job-t" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx(rewards)
    events = client.download_artifacts(run.info.run_id, "events.txt", str(tmp_path))
    assert "job.completed: completed 3 steps" in open(events).read()


class PartialRunFile(AssertionError):
    """A chunk cut short or failing its checksum: W&B's service is still writing the file."""


def wandb_records(path):
    """The records of a W&B run file: after its 7-byte header (":W&B", magic, version),
    LevelDB-log chunks in 32 KiB blocks (crc32 of type and data, length, type; full, first,
    middle, last), each checked."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    position, block, parts, records = 7, 32768, [], []
    while position + 7 <= len(data):
        left = block - position % block
        checksum, length, kind = (
            int.from_bytes(data[position : position + 4], "little"),
            int.from_bytes(data[position + 4 : position + 6], "little"),
            data[position + 6],
        )
        if left < 7 or (kind == 0 and length == 0):  # the block's padding
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            raise PartialRunFile(
                f"{path.name}: chunk at byte {position} of {len(data)} is cut short"
            )
        parts.append(chunk)
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(b"".join(parts))
            parts = []
    return records


def read_wandb_history(out) -> list[dict]:
    """The history rows of the one offline run under `out`, decoded with W&B's own record
    schema (its Python reader of run files is gone since the Go core). W&B's service may
    still be writing the file's end when `finish` returns: read until it is whole."""
    import json

    from wandb.proto import wandb_internal_pb2

    (path,) = out.glob("wandb/offline-run-*/run-*.wandb")

    def whole() -> list[bytes] | None:
        try:
            return wandb_records(path)
        except PartialRunFile:
            return None

    rows = []
    for data in wait_until(whole, 30.0, what=f"{path} written whole"):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def test_wandb_offline_holds_every_step_and_value(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="make setup installs it (the dev extra)")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = open_tracker("wandb", "job-t", str(tmp_path))
    rewards = [0.1, 0.4, 0.7]
    for step, reward in enumerate(rewards, start=1):
        tracker.log(train_step(step, reward))
    tracker.log(train_step(2, 0.0))  # a resumed job's step again: W&B keeps rising steps
    tracker.log(event(JobEventType.COMPLETED, 9, "completed 3 steps", steps=3))
    tracker.close()
    rows = [row for row in read_wandb_history(tmp_path) if "train/reward_mean" in row]
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert [row["train/reward_mean"] for row in rows] == pytest.approx(rewards)
