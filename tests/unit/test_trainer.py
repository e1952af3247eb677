"""The trainer on the tiny model: on-policy steps, micro-batching invariance, weights the
engine loads with parity, checkpoints that restore exactly, and 2-process data parallelism."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import socket
import threading
import time

import blake3
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rlnode.engine.torch_engine import TorchEngine
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec, LrScheduleSpec
from rlnode.models.build import init_tiny_model
from rlnode.training.distributed import DataParallelError, DataParallelTrainer
from rlnode.training.grpo import Sample
from rlnode.training.trainer import Trainer, TrainerConfig, micro_batches, minibatch_parts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _samples(trainer_or_engine, n: int = 8) -> list[Sample]:
    """Copy-task-like samples with behaviour logprobs from the model itself (on-policy)."""
    engine = trainer_or_engine
    tokenizer = engine.tokenizer
    samples = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Copy: {'abcd'[i % 4] * 3}"}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        completion = tokenizer("abcd"[i % 4] * 3)["input_ids"] + [tokenizer.eos_token_id]
        samples.append(
            Sample(prompt, completion, [0.0] * len(completion), advantage=1.0 if i % 2 else -1.0)
        )
    for s in samples:
        s.behaviour_logprobs = engine.score(s.prompt_ids + s.completion_ids)[
            len(s.prompt_ids) - 1 :
        ]
    return samples


def _config(**changes) -> TrainerConfig:
    return TrainerConfig.of(
        TrainingSpec(**{"optimizer": AdamWSpec(lr=1e-2), "tokens_per_micro_batch": 4096, **changes})
    )


def test_an_on_policy_step_has_ratio_one_and_moves_toward_the_advantage(model_dir) -> None:
    trainer = Trainer(model_dir, _config())
    samples = _samples(trainer)
    good = [s for s in samples if s.advantage > 0]
    before = [
        sum(trainer.score(s.prompt_ids + s.completion_ids)[len(s.prompt_ids) - 1 :]) for s in good
    ]
    metrics = trainer.step(samples)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-5) and metrics.clip_fraction == 0.0
    assert metrics.tokens == sum(len(s.completion_ids) for s in samples) and metrics.grad_norm > 0
    after = [
        sum(trainer.score(s.prompt_ids + s.completion_ids)[len(s.prompt_ids) - 1 :]) for s in good
    ]
    assert all(a > b for a, b in zip(after, before, strict=True))


def test_bf16_passes_on_the_cpu_keep_fp32_masters_and_the_fp32_parity_probe(model_dir) -> None:
    fp32, bf16 = (
        Trainer(model_dir, _config()),
        Trainer(model_dir, _config(compute_dtype="bfloat16")),
    )
    samples = _samples(fp32)
    assert bf16.score(samples[0].prompt_ids) == fp32.score(samples[0].prompt_ids)
    metrics = bf16.step(samples)
    # on-policy up to bf16's rounding of the logprobs; the update still lands in fp32
    assert metrics.ratio_mean == pytest.approx(1.0, abs=0.05) and metrics.grad_norm > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in bf16.model.parameters())


def _gradient(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


def _copy_is_the_masters_rounded(trainer: Trainer) -> bool:
    pairs = zip(trainer.model.parameters(), trainer.compute_model.parameters(), strict=True)
    return all(torch.equal(copy, master.to(torch.bfloat16)) for master, copy in pairs)


def test_passes_on_a_bf16_copy_of_the_weights_train_the_fp32_masters(model_dir, tmp_path) -> None:
    bf16 = {"compute_dtype": "bfloat16", "weights_in_compute_dtype": True}
    fp32, copied = (
        Trainer(model_dir, _config()),
        Trainer(model_dir, _config(tokens_per_micro_batch=20, **bf16)),
    )
    samples = _samples(fp32)
    assert len(copied._sample_batches(samples)) > 1  # gradients carried over several passes
    fp32.step(samples)
    metrics = copied.step(samples)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=0.05) and metrics.grad_norm > 0
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32
        for p in copied.model.parameters()
    )
    assert all(
        p.dtype == torch.bfloat16 and p.grad is None for p in copied.compute_model.parameters()
    )
    cosine = torch.nn.functional.cosine_similarity(_gradient(copied), _gradient(fp32), dim=0)
    assert cosine > 0.99  # the same gradient up to bf16's rounding of the passes
    assert _copy_is_the_masters_rounded(copied)
    # The probe stays the fp32 masters' on the CPU.
    assert copied.score(samples[0].prompt_ids) == pytest.approx(
        fp32.score(samples[0].prompt_ids), abs=0.05
    )
    resumed = Trainer(model_dir, _config(**bf16))
    resumed.load_checkpoint(copied.save_checkpoint(tmp_path / "step-1", {}))
    for a, b in zip(copied.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _copy_is_the_masters_rounded(resumed)
    fp32_passes = Trainer(model_dir, _config(weights_in_compute_dtype=True))
    assert fp32_passes.compute_model is fp32_passes.model  # nothing to copy in fp32


def test_micro_batching_does_not_change_the_update(model_dir) -> None:
    whole, split = (
        Trainer(model_dir, _config()),
        Trainer(model_dir, _config(tokens_per_micro_batch=20)),
    )
    samples = _samples(whole)
    assert len(micro_batches(samples, 20)) > 2
    whole.step(samples)
    split.step(samples)
    # Compare gradients: Adam's first step is ~lr x sign(g), which turns float noise in a
    # near-zero gradient into a full-size difference in the parameters.
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-8)


def test_minibatch_parts_deal_every_sample_once_the_same_way_on_every_rank(model_dir) -> None:
    samples = _samples(Trainer(model_dir, _config()), n=9)
    assert minibatch_parts(samples, 1) == [samples]  # one part: as given
    parts = minibatch_parts(samples, 2, seed="0:3")
    assert [len(p) for p in parts] == [5, 4]
    assert sorted(id(s) for part in parts for s in part) == sorted(map(id, samples))
    assert parts == minibatch_parts(samples, 2, seed="0:3")  # every rank deals alike
    assert parts != minibatch_parts(samples, 2, seed="0:4")  # a new order every step
    assert len(minibatch_parts(samples, 8, world=2)) == 4  # each part keeps a sample per rank


def test_minibatches_are_optimizer_steps_on_the_parts(model_dir) -> None:
    """minibatches=2: the same as two plain steps on the two parts, one after the other,
    reported as one step with token-weighted metrics."""
    two, reference = Trainer(model_dir, _config(minibatches=2)), Trainer(model_dir, _config())
    samples = _samples(two)
    metrics = two.step(samples)
    first, second = minibatch_parts(samples, 2, seed="0:0")
    a, b = reference.step(first), reference.step(second)
    for x, y in zip(two.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)
    assert two.steps == 1 and metrics.samples == len(samples)
    assert metrics.tokens == a.tokens + b.tokens
    assert metrics.loss == pytest.approx((a.loss * a.tokens + b.loss * b.tokens) / metrics.tokens)
    assert metrics.ratio_mean != pytest.approx(1.0)  # the second part was off-policy by then


def test_published_weights_load_in_the_engine_with_parity(model_dir, tmp_path) -> None:
    trainer = Trainer(model_dir, _config())
    trainer.step(_samples(trainer))
    digest, size = trainer.save_weights(tmp_path / "weights" / "v1.safetensors")
    assert len(digest) == 64 and size > 0
    assert [p.name for p in (tmp_path / "weights").iterdir()] == [
        "v1.safetensors"
    ]  # no temp file left
    # The tied output layer is the embedding: in the file once, and the engine's logits
    # follow the trained embedding.
    written = load_file(str(tmp_path / "weights" / "v1.safetensors"))
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
    unique = {p.data_ptr(): p.numel() * 4 for p in trainer.model.state_dict().values()}
    assert sum(unique.values()) < size < sum(unique.values()) + 16_384  # plus the header
    engine = TorchEngine(model_dir)
    asyncio.run(engine.load_weights(tmp_path / "weights" / "v1.safetensors", version=1))
    probe = [1, 4, 44, 30, 31, 40, 83, 100, 16]
    assert engine.score_sync([probe])[0] == pytest.approx(trainer.score(probe), abs=1e-5)


def test_a_checkpoint_restores_model_optimizer_and_state(model_dir, tmp_path) -> None:
    # A warmup then a linear decay: the resumed trainer must take the schedule's next rate.
    schedule = LrScheduleSpec(warmup_steps=1, decay="linear")
    config = _config(steps=3, optimizer=AdamWSpec(lr=1e-2, betas=(0.8, 0.99), schedule=schedule))
    trainer = Trainer(model_dir, config)
    samples = _samples(trainer)
    assert trainer.step(samples).learning_rate == pytest.approx(5e-3)
    path = trainer.save_checkpoint(
        tmp_path / "ckpt" / "step-1", {"trained_ids": ["a", "b"], "sampler": 7}
    )
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-1"]
    trainer.step(samples)  # the continuation we expect
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-2) and group["betas"] == (0.8, 0.99)

    resumed = Trainer(model_dir, config)
    state = resumed.load_checkpoint(path)
    assert state["trained_ids"] == ["a", "b"] and state["sampler"] == 7 and resumed.steps == 1
    assert resumed.step(samples).learning_rate == pytest.approx(1e-2)
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)  # same optimizer moments, same next step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Budgets sized from measurement: both ranks take each other's figures (one pass
        # either way, so the update is the one process's).
        trainer = Trainer(model_dir, _config(tokens_per_micro_batch="measured"))
        metrics = trainer.step(_samples(trainer))
        assert metrics.micro_batch_tokens == 1024 and trainer.micro_batches.bytes_per_token > 0
        # Each rank holds a shard of every parameter and of its gradient.
        shard = next(trainer.model.parameters())
        assert shard.to_local().shape[0] < shard.shape[0]
        gradients = {k: p.grad.full_tensor() for k, p in trainer.model.named_parameters()}
        if rank == 0:
            torch.save({"loss": metrics.loss, "gradients": gradients}, out)
        # Both ranks done before teardown: gloo aborts a process whose peer vanished first.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_sharded_processes_make_the_same_loss_and_update_as_one(model_dir, tmp_path) -> None:
    out = tmp_path / "sharded.pt"
    mp.spawn(_sharded_worker, args=(2, _free_port(), str(model_dir), str(out)), nprocs=2, join=True)
    single = Trainer(model_dir, _config())
    metrics = single.step(_samples(single))
    parallel = torch.load(out, weights_only=True)  # gradients (see the micro-batching test)
    # On-policy with advantages of +-1 the loss is ~0: its float noise needs an absolute bound.
    assert parallel["loss"] == pytest.approx(metrics.loss, rel=1e-5, abs=1e-6)
    for name, parameter in single.model.named_parameters():
        assert torch.allclose(parameter.grad, parallel["gradients"][name], rtol=1e-4, atol=1e-8), (
            name
        )


def test_the_data_parallel_trainer_matches_one_process_step_after_step(model_dir, tmp_path) -> None:
    """This process is rank 0 and a spawned worker is rank 1, as inside the learner; weights,
    the parity probe and checkpoints are gathered from both ranks' shards."""
    batch = _samples(Trainer(model_dir, _config()))
    probe = [1, 4, 44, 30, 31, 40, 83, 100, 16]
    single = Trainer(model_dir, _config())  # before the process group exists: world 1
    for _ in range(2):  # a second step catches shards that drifted apart
        single.step(batch)
    single.save_weights(tmp_path / "single.safetensors")
    parallel = DataParallelTrainer(model_dir, _config(), ["cpu", "cpu"])
    try:
        assert parallel.world == 2 and parallel.tokenizer is not None
        for _ in range(2):
            assert parallel.step(batch).samples == len(batch)
        digest, size = parallel.save_weights(tmp_path / "parallel.safetensors")
        assert len(digest) == 64 and size > 0
        expected = load_file(str(tmp_path / "single.safetensors"))
        for name, tensor in load_file(str(tmp_path / "parallel.safetensors")).items():
            # Adam turns float-order differences in the reduced gradients into ~1e-5
            # differences; each step moves a weight by up to lr = 1e-2.
            assert torch.allclose(tensor, expected[name], rtol=0, atol=1e-4), name
        assert parallel.score(probe) == pytest.approx(single.score(probe), abs=1e-4)
        checkpoint = parallel.save_checkpoint(tmp_path / "step-2", {"step": 2})
        with pytest.raises(ValueError, match="cannot be split over 2"):
            parallel.step(batch[:1])
    finally:
        parallel.close()
    assert not dist.is_initialized()
    assert all(not w.is_alive() for w in parallel._workers)
    # The sharded checkpoint restores in one process, optimizer moments included.
    resumed = Trainer(model_dir, _config())
    assert resumed.load_checkpoint(checkpoint)["step"] == 2 and resumed.steps == 2
    resumed.step(batch)
    single.step(batch)
    for (name, a), b in zip(
        single.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.allclose(a, b, rtol=0, atol=2e-4), name


def test_a_dead_rank_is_reported_not_waited_for(model_dir) -> None:
    parallel = DataParallelTrainer(model_dir, _config(), ["cpu", "cpu"])
    try:
        parallel._workers[0].kill()
        parallel._workers[0].join()
        with pytest.raises(DataParallelError, match="rank1 exited"):
            parallel.step(_samples(parallel))
    finally:
        parallel.close()
    assert not dist.is_initialized()


def test_a_rank_that_dies_before_the_rendezvous_is_reported_at_once(model_dir) -> None:
    """SIGKILLed while it starts (spawning, importing torch): the process group's own
    rendezvous would have waited out its whole timeout (10 minutes) for it."""
    import psutil

    def kill_rank1_as_it_starts() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "spawn_main" in " ".join(child.cmdline()):
                        child.kill()
                        return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_rank1_as_it_starts)
    killer.start()
    # Waited out, the rendezvous would say "exited; the job cannot go on" 10 minutes later.
    with pytest.raises(DataParallelError, match=r"rank1 exited \(code -9\) before it reached"):
        DataParallelTrainer(model_dir, _config(), ["cpu", "cpu"])
    killer.join()
    assert not dist.is_initialized()


def _pending_signals(pid: int) -> int:
    """The signals waiting for a process (its own and its thread group's), from /proc."""
    fields = dict(
        line.split(":", 1)
        for line in open(f"/proc/{pid}/status").read().splitlines()
        if ":" in line
    )
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def test_a_rank_stuck_in_a_step_fails_it_with_that_ranks_stack(model_dir) -> None:
    """A rank that lives but does not answer (SIGSTOPped here, as a rank stuck in a kernel
    or a deadlock would be): rank 0's collective times out and the error carries the stuck
    rank's Python stack, asked for with SIGUSR1. #49's two-rank hang left no log at all."""
    samples = _samples(Trainer(model_dir, _config()))
    timeout = datetime.timedelta(seconds=10)
    parallel = DataParallelTrainer(model_dir, _config(), ["cpu", "cpu"], collective_timeout=timeout)
    try:
        parallel.step(samples)  # both ranks answer
        rank1 = parallel._workers[0]
        assert rank1.pid is not None
        os.kill(rank1.pid, signal.SIGSTOP)

        def continue_once_asked() -> None:
            # A stopped process takes SIGUSR1 (and writes its stack) when it runs again.
            while rank1.is_alive():
                if _pending_signals(rank1.pid) & (1 << (signal.SIGUSR1 - 1)):
                    os.kill(rank1.pid, signal.SIGCONT)
                    return
                time.sleep(0.02)

        resumer = threading.Thread(target=continue_once_asked)
        resumer.start()
        with pytest.raises(DataParallelError, match="while every training rank lived") as failed:
            parallel.step(samples)
        resumer.join()
        said = str(failed.value)
        # Its main thread's Python frames, wherever it stopped (its command, or the end of
        # the step before: rank 0 does not wait for a rank's optimizer step).
        assert "rlnode-trainer-rank1" in said and "in _worker" in said, said
    finally:
        parallel.close()
    assert not dist.is_initialized()


def test_chunked_logprobs_and_their_gradients_equal_a_full_log_softmax() -> None:
    from rlnode.training.trainer import token_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    full = torch.log_softmax(hidden @ weight.t() / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    (full_grads) = torch.autograd.grad(full.sum(), (hidden, weight))
    chunked = token_logprobs(hidden, weight, targets, 0.7, chunk_tokens=8)
    chunked_grads = torch.autograd.grad(chunked.sum(), (hidden, weight))
    assert torch.allclose(chunked, full, atol=1e-6)
    for a, b in zip(chunked_grads, full_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_chunk_size_and_activation_checkpointing_do_not_change_the_update(model_dir) -> None:
    plain = Trainer(model_dir, _config(logit_chunk_tokens=65_536))
    lean = Trainer(model_dir, _config(logit_chunk_tokens=3, activation_checkpointing=True))
    samples = _samples(plain)
    a, b = plain.step(samples), lean.step(samples)
    assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-6)  # the loss may be ~0
    for x, y in zip(plain.model.parameters(), lean.model.parameters(), strict=True):
        assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-8)


def test_weights_are_published_in_the_engines_dtype(model_dir, tmp_path) -> None:
    from safetensors import safe_open

    trainer = Trainer(model_dir, _config())
    digest, size = trainer.save_weights(tmp_path / "v1.safetensors", "bfloat16")
    assert digest == blake3.blake3((tmp_path / "v1.safetensors").read_bytes()).hexdigest()
    fp32_bytes = sum(p.numel() * 4 for p in trainer.model.state_dict().values())
    assert size < fp32_bytes / 2 + 4096  # half the bytes (plus the header)
    with safe_open(str(tmp_path / "v1.safetensors"), framework="pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}
    engine = TorchEngine(model_dir)
    asyncio.run(engine.load_weights(tmp_path / "v1.safetensors", version=1))
    probe = [1, 4, 44, 30, 31, 40, 83, 100, 16]
    # bf16 rounding of the weights: close to the fp32 trainer, not equal.
    assert engine.score_sync([probe])[0] == pytest.approx(trainer.score(probe), abs=5e-2)


def test_lora_over_several_devices_is_refused_before_any_rank_starts(model_dir) -> None:
    config = TrainerConfig.of(TrainingSpec(lora={"rank": 4}))
    with pytest.raises(ValueError, match="training_gpus = 1"):
        DataParallelTrainer(model_dir, config, ["cpu", "cpu"])
    assert not dist.is_initialized()
