"""A job whose store fills up (a small tmpfs this test mounts, filled with ballast during the
run): the write pauses the job with the reason and leaves no partial files; the job goes on
by itself once space returns; past the wait it fails saying where, how much is free and what
to do, and the same job resumed writes again once there is room. The real `JobRunner`,
trainer and torch engine, in one process (as tests/unit/test_job_loop.py runs them)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples import example_job
from rlnode.examples.taskapps import copy_task
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.training.inprocess import InProcessGenerator
from rlnode.training.loop import JobFailed, JobRunner
from rlnode.training.transport import InMemoryTransport
from tests.conftest import eventually

pytestmark = pytest.mark.asyncio
JOB = "job-disk"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def small_store(tmp_path) -> Iterator[Path]:
    """A 16 MiB tmpfs: room for this job's checkpoints and weights, and quick to fill."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    store = tmp_path / "store"
    store.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(store)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield store
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)


def fill(store: Path, leave: int = 0) -> Path:
    """Fill `store` with a ballast file, leaving about `leave` bytes free."""
    ballast = store / "ballast"
    with open(ballast, "wb", buffering=0) as out:
        try:
            while True:
                out.write(bytes(2**16))
        except OSError as e:
            assert e.errno == errno.ENOSPC
        out.truncate(max(0, out.tell() - leave))
    return ballast


def leftovers(store: Path) -> list[str]:
    """Anything a reader could take for a checkpoint or weights that is not one."""
    return sorted(p.name for p in store.rglob("*.tmp-*"))


def steps_of(checkpoints: Path) -> list[int]:
    return [
        json.loads((p / "trainer_state.json").read_text())["step"]
        for p in sorted(checkpoints.glob("step-*"))
    ]


class Run:
    """A runner on the store with an in-process generator, as the learner runs them."""

    def __init__(self, model: Path, store: Path, **runner_options) -> None:
        small = {"prompts_per_step": 2, "group_size": 4, "max_async": 1}
        job = example_job("copy_task", model, steps=4, checkpoint_every=2, **small)
        self.transport = InMemoryTransport()
        self.runner = JobRunner(
            JOB, "org", job, self.transport, store, ["cpu"], 60.0, **runner_options
        )
        self.engine = TorchEngine(model, dtype="float32", max_wait_ms=1)
        InProcessGenerator(self.engine, copy_task.DEFINITION, self.runner.offer).attach(
            self.transport
        )

    def saved(self) -> list[int]:
        return [
            e.data["step"] for e in self.transport.events if e.type is JobEventType.CHECKPOINT_SAVED
        ]

    async def run(self) -> None:
        try:
            await self.runner.run()
        finally:
            await self.engine.close()


async def test_a_full_checkpoint_store_pauses_the_job_until_space_returns(
    tiny_model, small_store, tmp_path
):
    # Weights elsewhere: the checkpoint is what does not fit. The room left takes the model
    # file but not the optimizer's, so the write fails half-way through.
    run = Run(tiny_model, small_store, weights_dir=tmp_path / "shm", disk_full_wait_s=120)
    ballast: list[Path] = []
    run.runner.on_progress = lambda step: (
        ballast.append(fill(small_store, 800_000)) if step == 2 else None
    )
    task = asyncio.create_task(run.run())
    await eventually(lambda: run.runner.waiting_for_room is not None or task.done(), 60, "a pause")
    why = run.runner.waiting_for_room
    assert why is not None, task
    assert "checkpoint step-000004" in why and str(small_store) in why
    assert "No space left on device" in why and "MiB free" in why
    checkpoints = small_store / "org" / JOB / "checkpoints"
    assert leftovers(small_store) == [] and steps_of(checkpoints) == [2]

    ballast.pop().unlink()  # space returns
    await asyncio.wait_for(task, 60)
    assert run.saved() == [2, 4] and steps_of(checkpoints) == [2, 4]
    assert run.runner.waiting_for_room is None and leftovers(small_store) == []


async def test_past_the_wait_the_job_fails_saying_why_and_resumes_once_there_is_room(
    tiny_model, small_store
):
    first = Run(tiny_model, small_store, disk_full_wait_s=1.0)
    ballast: list[Path] = []
    first.runner.on_progress = lambda step: ballast.append(fill(small_store)) if step == 2 else None
    with pytest.raises(JobFailed) as failed:
        await asyncio.wait_for(first.run(), 60)
    reason = str(failed.value)
    job = small_store / "org" / JOB
    assert f"weights v000003 could not be written to {job / 'weights'}" in reason, reason
    assert "No space left on device (0.0 MiB free there)" in reason
    assert "LEARNER_DISK_FULL_WAIT_S" in reason and "free space there" in reason
    assert f"{job / 'checkpoints' / 'step-000002'}, is whole" in reason
    assert leftovers(small_store) == [] and steps_of(job / "checkpoints") == [2]

    # Space returns; a learner that died mid-write left temporaries behind.
    ballast.pop().unlink()
    stale = job / "checkpoints" / ".step-000003.tmp-99999"
    stale.mkdir()
    (stale / "optimizer.pt").write_bytes(b"half")
    (job / "weights" / ".v000009.safetensors.tmp-99999").write_bytes(b"half")
    second = Run(tiny_model, small_store, disk_full_wait_s=1.0)
    await asyncio.wait_for(second.run(), 60)
    started = [e.message for e in second.transport.events if e.type is JobEventType.STARTED]
    assert started == ["training from step 2 of 4 (resumed)"]
    assert second.saved() == [4] and steps_of(job / "checkpoints") == [2, 4]
    assert leftovers(small_store) == []
