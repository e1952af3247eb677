"""Training ranks on other hosts (rlnode.training.rank_hosts): this process is the learner
(rank 0, hosting the rendezvous on 127.0.0.1) and a rank host is torchrun on "127.0.0.2",
started with the command `rlnode trainer-ranks` runs. Two hosts x one rank make the same
loss and update as one host x two ranks; the rank host serves one job after another, also
after a job failed; a rank host that is missing, or killed mid-job, fails the job naming it
within the timeout. The tests share one rank host and run in this order."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlnode.cli.ranks import torchrun_command, torchrun_environment
from rlnode.examples import example_job
from rlnode.models.build import init_tiny_model
from rlnode.training.distributed import DataParallelError, DataParallelTrainer
from rlnode.training.loop import JobFailed, JobRunner
from rlnode.training.rank_hosts import RankHub
from rlnode.training.trainer import Trainer
from rlnode.training.transport import InMemoryTransport
from tests.unit.test_trainer import _config, _samples

HOST = "127.0.0.2"
TIMEOUT_S = 30.0  # the collectives' (and a rank host's model loading) bound in these tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def hub() -> RankHub:
    return RankHub("127.0.0.1:0", [HOST], join_timeout_s=60, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def rank_host(hub: RankHub) -> Iterator[subprocess.Popen[bytes]]:
    command = torchrun_command(hub.endpoint, nproc=1, host=HOST, device="cpu")
    process = subprocess.Popen(command, env=torchrun_environment())
    yield process
    _kill_tree(process)


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """The whole host at once: torchrun's agent and its workers (each in a session of its
    own, so not one process group)."""
    if process.poll() is not None:
        return
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=10)
    process.wait()


def test_two_hosts_train_like_one_host_with_two_ranks(model_dir, hub, rank_host, tmp_path) -> None:
    untrained = Trainer(model_dir, _config())
    batch = _samples(untrained)
    untrained.save_weights(tmp_path / "initial.safetensors")
    probe = [1, 4, 44, 30, 31, 40, 83, 100, 16]

    def train(parallel: DataParallelTrainer, out: str) -> tuple[list[float], list[float]]:
        try:
            assert parallel.world == 2
            losses = [parallel.step(batch).loss for _ in range(2)]
            parallel.save_weights(tmp_path / out)
            scores = parallel.score(probe)
        finally:
            parallel.close()
        assert not dist.is_initialized()
        return losses, scores

    one_host = train(DataParallelTrainer(model_dir, _config(), ["cpu", "cpu"]), "one.safetensors")
    two_hosts = train(
        DataParallelTrainer(model_dir, _config(), ["cpu"], rank_hosts=hub), "two.safetensors"
    )
    # Same ranks, same shards, same gloo collectives: only the wire differs. Measured: equal
    # to the last bit on this machine; the bounds leave room for another reduction order.
    assert two_hosts[0] == pytest.approx(one_host[0], rel=1e-6, abs=1e-7)
    assert two_hosts[1] == pytest.approx(one_host[1], abs=1e-6)
    expected = load_file(str(tmp_path / "one.safetensors"))
    initial = load_file(str(tmp_path / "initial.safetensors"))
    for name, tensor in load_file(str(tmp_path / "two.safetensors")).items():
        update, expected_update = tensor - initial[name], expected[name] - initial[name]
        assert torch.allclose(update, expected_update, rtol=0, atol=1e-6), name
    assert rank_host.poll() is None  # the rank host waits for the next job


def test_a_job_that_fails_here_mid_step_leaves_the_rank_host_to_the_next(
    model_dir, hub, rank_host, monkeypatch
) -> None:
    """Rank 0 fails inside a step (the rank host is left in a collective that will not
    complete): the job's error is rank 0's own, the rank host's worker ends at the abort and
    torchrun starts a fresh one, which serves the next job."""
    batch = _samples(Trainer(model_dir, _config()))
    parallel = DataParallelTrainer(model_dir, _config(), ["cpu"], rank_hosts=hub)
    try:

        def fail(_samples: object, _index: int | None) -> None:
            raise ValueError("rank 0 failed")

        monkeypatch.setattr(parallel.trainer, "step", fail)
        with pytest.raises(ValueError, match="rank 0 failed"):
            parallel.step(batch)
    finally:
        parallel.close()
    parallel = DataParallelTrainer(model_dir, _config(), ["cpu"], rank_hosts=hub)
    try:
        assert parallel.step(batch).samples == len(batch)
    finally:
        parallel.close()
    assert rank_host.poll() is None


def test_a_rank_host_killed_mid_job_fails_the_job_naming_it(model_dir, hub, rank_host) -> None:
    batch = _samples(Trainer(model_dir, _config()))
    parallel = DataParallelTrainer(model_dir, _config(), ["cpu"], rank_hosts=hub)
    try:
        parallel.step(batch)
        _kill_tree(rank_host)
        started = time.monotonic()
        with pytest.raises(DataParallelError, match=rf"training rank 1 on rank host {HOST}") as e:
            parallel.step(batch)
        assert time.monotonic() - started < TIMEOUT_S
        assert "stopped answering" in str(e.value)
        with pytest.raises(DataParallelError, match="out of step"):
            parallel.score([1, 2, 3])
    finally:
        parallel.close()
    assert not dist.is_initialized()


def test_a_missing_rank_host_fails_the_job_naming_it_after_the_join_timeout(
    model_dir, tmp_path
) -> None:
    lonely = RankHub("127.0.0.1:0", ["10.9.9.9"], join_timeout_s=1, timeout_s=TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises(DataParallelError, match=r"rank host 10\.9\.9\.9 has not joined") as e:
        DataParallelTrainer(model_dir, _config(), ["cpu"], rank_hosts=lonely)
    assert f"rlnode trainer-ranks --join {lonely.endpoint}" in str(e.value)
    assert time.monotonic() - started < 5
    assert not dist.is_initialized()
    # The learner's job loop: the job fails with that reason (job.failed says it).
    job = example_job("copy_task", model_dir, steps=1, prompts_per_step=2, group_size=2)
    runner = JobRunner(
        "ranks", "org", job, InMemoryTransport(), tmp_path, ["cpu"], 60.0, rank_hosts=lonely
    )
    with pytest.raises(JobFailed, match=r"training ranks could not start: rank host 10\.9"):
        asyncio.run(runner.run())
