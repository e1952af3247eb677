"""The trainer: one optimizer step of the clipped objective over a batch of samples,
micro-batched to a token budget, optionally data parallel (torch.distributed: NCCL on GPUs,
gloo on the CPU), bf16 autocast on GPU; and the files it produces (weights, checkpoints)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlnode.messages import JobConfig, SamplingSpec, TrainingSpec
from rlnode.messages.weights import sha256_of
from rlnode.training.grpo import Sample, clipped_objective


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer needs of a job, taken from its config in one place (`for_job`): the
    defaults and their meaning live once, on `TrainingSpec` and `SamplingSpec`."""

    learning_rate: float
    weight_decay: float
    max_grad_norm: float
    clip_eps: float
    kl_coef: float
    temperature: float  # the sampling temperature: logprobs are of logits / temperature
    tokens_per_micro_batch: int
    minibatches: int  # optimizer steps per training step (see minibatch_parts)
    seed: int

    @classmethod
    def for_job(cls, config: JobConfig) -> TrainerConfig:
        return cls.of(config.training, config.sampling)

    @classmethod
    def of(cls, training: TrainingSpec, sampling: SamplingSpec | None = None) -> TrainerConfig:
        sampling = sampling or SamplingSpec()
        return cls(
            learning_rate=training.learning_rate,
            weight_decay=training.weight_decay,
            max_grad_norm=training.max_grad_norm,
            clip_eps=training.clip_eps,
            kl_coef=training.kl_coef,
            # Temperature 0 is greedy sampling, scored at temperature 1 (see rlnode.engine).
            temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
            tokens_per_micro_batch=training.tokens_per_micro_batch,
            minibatches=training.minibatches,
            seed=training.seed,
        )


@dataclass
class StepMetrics:
    loss: float
    kl: float | None
    clip_fraction: float
    ratio_mean: float
    grad_norm: float
    tokens: int
    samples: int
    compute_s: float


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(values: list[float], device: str) -> list[float]:
    if _world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def completion_logprobs(model, batch: list[Sample], device: str, temperature: float, pad_id: int):
    """Logprobs (of logits / temperature) of every completion token, right-padded into a
    [rows, max completion] tensor, and the matching mask."""
    width = max(s.tokens for s in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, s in enumerate(batch):
        ids = s.prompt_ids + s.completion_ids
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
    scaled = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    token_logprobs = scaled.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    longest = max(len(s.completion_ids) for s in batch)
    out = torch.zeros((len(batch), longest), device=device)
    mask = torch.zeros((len(batch), longest), device=device)
    for row, s in enumerate(batch):
        start = len(s.prompt_ids) - 1  # the logit at position i predicts token i + 1
        n = len(s.completion_ids)
        out[row, :n] = token_logprobs[row, start : start + n]
        mask[row, :n] = 1.0
    return out, mask


def _padded(rows: list[list[float]], width: int, device: str) -> torch.Tensor:
    out = torch.zeros((len(rows), width), device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def minibatch_parts(
    samples: list[Sample], minibatches: int, world: int = 1, seed: str = "0"
) -> list[list[Sample]]:
    """The parts of a training step's samples that get an optimizer step each: with one,
    the samples as they are; with more, a seeded shuffle (the same on every rank) dealt into
    that many parts, fewer when there are too few samples for every rank to get one per part."""
    count = max(1, min(minibatches, len(samples) // max(1, world)))
    if count == 1:
        return [samples]
    shuffled = list(samples)
    random.Random(seed).shuffle(shuffled)
    return [shuffled[i::count] for i in range(count)]


def micro_batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Pack samples (longest first) so that rows x longest row stays within the budget."""
    ordered = sorted(samples, key=lambda s: s.tokens, reverse=True)
    batches: list[list[Sample]] = []
    for s in ordered:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].tokens <= token_budget:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


class Trainer:
    def __init__(
        self,
        model_path: Path | str,
        config: TrainerConfig,
        *,
        device: str = "cpu",
        reference_on_trainer: bool = False,
        reference_device: str | None = None,
    ) -> None:
        """`reference_device`: where the reference model goes when it is on the learner
        (default: beside the policy; the GPU plan's `dedicated` placement names its GPU)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        torch.manual_seed(config.seed)
        self.config = config
        self.device = device
        self.model_path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model = model.to(device)  # type: ignore[arg-type]  # transformers' stub of the @wraps(Module.to) method wants the model as its first argument
        self.model.train()
        self.reference = None
        self.reference_device = reference_device or device
        if reference_on_trainer:
            reference_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.reference = reference_model.to(self.reference_device).eval()  # type: ignore[arg-type]  # transformers' stub of the @wraps(Module.to) method wants the model as its first argument
            self.reference.requires_grad_(False)
        self.rank, self.world = _world()
        self.wrapped = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.wrapped = DistributedDataParallel(
                self.model,
                device_ids=[torch.device(device).index] if device.startswith("cuda") else None,
            )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        self.steps = 0
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id

    def _autocast(self):
        if self.device.startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, samples: list[Sample]) -> StepMetrics:
        """One training step on `samples` (every rank passes the same list): `minibatches`
        optimizer steps, each on its part of the samples (the same parts on every rank), or
        one step on them all. Metrics are token-weighted over the parts."""
        started = time.perf_counter()
        if not samples:
            raise ValueError("a training step needs at least one sample")
        parts = minibatch_parts(
            samples, self.config.minibatches, self.world, seed=f"{self.config.seed}:{self.steps}"
        )
        results = [self._optimizer_step(part) for part in parts]
        self.steps += 1
        tokens = sum(r.tokens for r in results)
        kls = [(r.kl, r.tokens) for r in results if r.kl is not None]

        def weighted(values: list[tuple[float, int]]) -> float:
            total = sum(n for _v, n in values)
            return sum(v * n for v, n in values) / total if total else 0.0

        return StepMetrics(
            loss=weighted([(r.loss, r.tokens) for r in results]),
            kl=weighted(kls) if kls else None,
            clip_fraction=weighted([(r.clip_fraction, r.tokens) for r in results]),
            ratio_mean=weighted([(r.ratio_mean, r.tokens) for r in results]),
            grad_norm=sum(r.grad_norm for r in results) / len(results),
            tokens=tokens,
            samples=len(samples),
            compute_s=time.perf_counter() - started,
        )

    def _optimizer_step(self, samples: list[Sample]) -> StepMetrics:
        """One optimizer step on `samples` (every rank passes the same list; each trains on
        its share). The loss is the token-mean over the whole batch, whatever the split."""
        started = time.perf_counter()
        mine = samples[self.rank :: self.world]
        my_tokens = sum(len(s.completion_ids) for s in mine)
        (total_tokens,) = _all_reduce([float(my_tokens)], self.device)
        batches = micro_batches(mine, self.config.tokens_per_micro_batch)
        sums = {"loss": 0.0, "clipped_tokens": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0, "kl_rows": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or self.world == 1 else self.wrapped.no_sync()
            with sync, self._autocast():
                logprobs, mask = completion_logprobs(
                    self.wrapped, batch, self.device, self.config.temperature, self.pad_id
                )
                width = logprobs.shape[1]
                behaviour = _padded([s.behaviour_logprobs for s in batch], width, self.device)
                advantages = torch.tensor(
                    [s.advantage for s in batch], device=self.device
                ).unsqueeze(-1)
                reference = self._reference_logprobs(batch, width)
                loss_sum, metrics = clipped_objective(
                    logprobs,
                    behaviour,
                    advantages,
                    mask,
                    self.config.clip_eps,
                    reference,
                    self.config.kl_coef,
                )
                # DDP averages gradients over ranks; x world turns that back into a global sum.
                (loss_sum * self.world / total_tokens).backward()
            sums["loss"] += float(loss_sum.detach())
            sums["clipped_tokens"] += float(metrics["clipped_tokens"])
            sums["ratio_sum"] += float(metrics["ratio_sum"])
            if "kl_sum" in metrics:
                sums["kl_sum"] += float(metrics["kl_sum"])
                sums["kl_rows"] += float(mask.sum())
        if not batches and self.world > 1:
            raise ValueError("every rank needs at least one sample; give at least `world` samples")
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        )
        self.optimizer.step()
        loss, clipped, ratio, kl_sum, kl_rows = _all_reduce(
            [
                sums["loss"],
                sums["clipped_tokens"],
                sums["ratio_sum"],
                sums["kl_sum"],
                sums["kl_rows"],
            ],
            self.device,
        )
        return StepMetrics(
            loss=loss / total_tokens,
            kl=(kl_sum / kl_rows) if kl_rows else None,
            clip_fraction=clipped / total_tokens,
            ratio_mean=ratio / total_tokens,
            grad_norm=grad_norm,
            tokens=int(total_tokens),
            samples=len(samples),
            compute_s=time.perf_counter() - started,
        )

    def _reference_logprobs(self, batch: list[Sample], width: int) -> torch.Tensor | None:
        carried = [s.ref_logprobs for s in batch if s.ref_logprobs is not None]
        if len(carried) == len(batch):  # stacked on inference: they came with the data
            return _padded(carried, width, self.device)
        if self.reference is not None:
            with torch.no_grad(), self._autocast():
                logprobs, _ = completion_logprobs(
                    self.reference,
                    batch,
                    self.reference_device,
                    self.config.temperature,
                    self.pad_id,
                )
            return logprobs.to(self.device)
        return None

    # -- what the learner publishes -------------------------------------------------------

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> list[float]:
        """Logprob (temperature 1) of each token after the first: the parity probe."""
        self.model.eval()
        try:
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(input_ids=ids).logits.float()
            scaled = torch.log_softmax(logits[:, :-1], dim=-1)
            return scaled.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[0].tolist()
        finally:
            self.model.train()

    def state_dict_for_inference(self) -> dict[str, torch.Tensor]:
        # Cloned: tied embeddings share storage, which safetensors refuses to write twice.
        return {
            k: v.detach().to("cpu").contiguous().clone() for k, v in self.model.state_dict().items()
        }

    def save_weights(self, path: Path) -> tuple[str, int]:
        """Write the weights atomically (temp file, fsync, rename); returns (sha256, bytes)."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file(self.state_dict_for_inference(), str(temporary), metadata={"format": "pt"})
        _fsync(temporary)
        os.replace(temporary, path)
        _fsync_dir(path.parent)
        return sha256_of(path), path.stat().st_size

    def save_checkpoint(self, directory: Path, state: dict[str, Any]) -> Path:
        """A full checkpoint (model and tokenizer in HF format, optimizer, trainer and job
        state), written under a temporary name and renamed: it exists whole or not at all."""
        temporary = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir(parents=True)
        self.model.save_pretrained(temporary, safe_serialization=True)
        self.tokenizer.save_pretrained(temporary)
        torch.save(self.optimizer.state_dict(), temporary / "optimizer.pt")
        (temporary / "trainer_state.json").write_text(
            json.dumps({"steps": self.steps, "config": asdict(self.config), **state}, indent=2)
            + "\n"
        )
        for file in temporary.iterdir():
            _fsync(file)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(temporary, directory)
        _fsync_dir(directory.parent)
        return directory

    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Restore model, optimizer and step from a checkpoint; returns its saved state."""
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(
            torch.load(directory / "optimizer.pt", map_location=self.device, weights_only=True)
        )
        state = json.loads((directory / "trainer_state.json").read_text())
        self.steps = state["steps"]
        return state


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
