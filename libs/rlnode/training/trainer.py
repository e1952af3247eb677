"""The trainer: one optimizer step of the clipped objective over a batch of samples,
micro-batched to a token budget, and the files it produces (weights, checkpoints).

Memory, for models the size of the GPU plan's (docs/decisions.md, "Trainer"):
- Master weights, gradients and AdamW state are fp32; over several ranks each rank holds
  only its shard of all three (FSDP2, `fully_shard` per decoder layer and on the whole:
  16 bytes per parameter spread over the ranks). Compute is bf16 on GPUs (the layer being
  computed is gathered in bf16), gradients are reduced in fp32.
- Logprobs of completion tokens come from the final hidden states a chunk of tokens at a
  time (`logit_chunk_tokens`), recomputed in the backward pass: the full-vocabulary logits
  of a micro-batch never exist at once, and prompt positions get none.
- Activation checkpointing of every layer is a job option.
Over several ranks every collective method (step, score, weights, checkpoints) is called on
every rank (`rlnode.training.distributed` drives the others); rank 0 writes the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from rlnode.messages import JobConfig, SamplingSpec, TrainingSpec
from rlnode.models import TIED_INPUT, TIED_OUTPUT
from rlnode.models.hf import load_causal_lm, load_tokenizer
from rlnode.models.safetensors_io import TensorSpec, write_safetensors
from rlnode.training.grpo import Sample, clipped_objective
from rlnode.training.storage import temporary_sibling

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_CPU_THREADS_SET = threading.Lock()  # held while a probe changes torch's CPU threads


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
    logit_chunk_tokens: int = 64
    activation_checkpointing: bool = False

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
            logit_chunk_tokens=training.logit_chunk_tokens,
            activation_checkpointing=training.activation_checkpointing,
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


def _all_reduce(
    values: list[float], device: str, ops: tuple[str, ...] | None = None
) -> list[float]:
    """Sum (or, per value, "max") over the ranks."""
    if _world()[1] == 1:
        return values
    ops = ops or ("sum",) * len(values)
    out = list(values)
    for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        picked = [i for i, o in enumerate(ops) if o == op]
        if picked:
            tensor = torch.tensor([values[i] for i in picked], dtype=torch.float64, device=device)
            dist.all_reduce(tensor, op=reduce_op)
            for i, v in zip(picked, tensor.tolist(), strict=True):
                out[i] = v
    return out


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits = (hidden @ weight.t()).float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
) -> torch.Tensor:
    """log-softmax(hidden @ weight.T / temperature)[target] for each row of `hidden` [N, H],
    `chunk_tokens` rows at a time. With gradients on, each chunk is recomputed in the
    backward pass, so only one chunk's [chunk, vocab] logits exist at any time."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            part = checkpoint(
                _chunk_logprobs,
                hidden[rows],
                weight,
                targets[rows],
                temperature,
                use_reentrant=False,
            )
        else:
            part = _chunk_logprobs(hidden[rows], weight, targets[rows], temperature)
        parts.append(part)
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


class CompletionLogprobs(torch.nn.Module):
    """A causal LM whose forward gives the logprobs of chosen tokens: the unit the trainer
    differentiates (and the FSDP root, so one forward gathers what it needs)."""

    def __init__(self, lm: Any, chunk_tokens: int) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers causal LM (untyped there)
        self.chunk_tokens = chunk_tokens
        if getattr(lm.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("output layers with a bias are not supported")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        temperature: float,
    ) -> torch.Tensor:
        """The logprob of token `input_ids[r, p + 1]` after `input_ids[r, : p + 1]`, for each
        (r, p) in zip(rows, positions)."""
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask)
        chosen = hidden.last_hidden_state[rows, positions]
        weight = self.lm.get_output_embeddings().weight
        return token_logprobs(
            chosen, weight, input_ids[rows, positions + 1], temperature, self.chunk_tokens
        )


def completion_logprobs(
    model: torch.nn.Module, batch: list[Sample], device: str, temperature: float, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (of logits / temperature) of every trained completion token, right-padded
    into a [rows, longest completion] tensor, and the mask of the trained tokens: 0 past a
    row's end and where `Sample.loss_mask` says the environment wrote the token (a merged
    multi-turn trajectory), whose logprob is not computed (0 there). `model` is a
    `CompletionLogprobs` (or a sharded one)."""
    width = max(s.tokens for s in batch)
    longest = max(len(s.completion_ids) for s in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    rows, positions, columns = [], [], []
    for row, s in enumerate(batch):
        ids = s.prompt_ids + s.completion_ids
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        start = len(s.prompt_ids) - 1  # the hidden state at position i predicts token i + 1
        for k in range(len(s.completion_ids)):
            if s.loss_mask is not None and not s.loss_mask[k]:
                continue
            rows.append(row)
            positions.append(start + k)
            columns.append(k)
    index_rows = torch.tensor(rows, device=device)
    flat = model(
        input_ids.to(device),
        attention.to(device),
        index_rows,
        torch.tensor(positions, device=device),
        temperature,
    )
    out = torch.zeros((len(batch), longest), device=device, dtype=flat.dtype)
    out = out.index_put((index_rows, torch.tensor(columns, device=device)), flat)
    mask = torch.zeros((len(batch), longest))
    for row, s in enumerate(batch):
        if s.loss_mask is None:
            mask[row, : len(s.completion_ids)] = 1.0
        else:  # a merged trajectory: the environment's tokens are not trained
            mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=mask.dtype)
    return out, mask.to(device)


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


def equal_micro_batches(samples: list[Sample], token_budget: int, count: int) -> list[list[Sample]]:
    """`micro_batches`, then split further (largest first) to exactly `count` batches: every
    rank of a sharded model must run the same number of forward and backward passes (each
    gathers parameters from all ranks). A rank with fewer samples than `count` gets empty
    batches, which it runs with a zero-weight stand-in."""
    batches = micro_batches(samples, token_budget)
    while len(batches) < count:
        widest = max(range(len(batches)), key=lambda b: len(batches[b]))
        if len(batches[widest]) < 2:
            batches.append([])
            continue
        half = len(batches[widest]) // 2
        batches.append(batches[widest][half:])
        batches[widest] = batches[widest][:half]
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
        torch.manual_seed(config.seed)
        self.config = config
        self.device = device
        self.model_path = Path(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.rank, self.world = _world()
        # fp32 master weights; bf16 compute on GPUs (autocast with one rank, FSDP's
        # mixed precision with several).
        model = load_causal_lm(model_path, dtype=torch.float32)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model.to(device)  # type: ignore[arg-type]  # transformers' stub of the @wraps(Module.to) method wants the model as its first argument
        self.model.train()
        self.policy: torch.nn.Module = CompletionLogprobs(self.model, config.logit_chunk_tokens)
        if self.world > 1:
            self.policy = _shard(self.policy, device)
        self.reference: torch.nn.Module | None = None
        self.reference_device = reference_device or device
        if reference_on_trainer:
            frozen = load_causal_lm(model_path, dtype=self._compute_dtype())
            frozen = frozen.to(self.reference_device).eval()  # type: ignore[arg-type]  # as above
            frozen.requires_grad_(False)
            self.reference = CompletionLogprobs(frozen, config.logit_chunk_tokens)
        # Fused: one kernel over all parameters, without the foreach implementation's
        # parameter-sized temporaries (the peak of a step is the optimizer's when logits are
        # chunked; measured in bench/results/trainer_memory.md).
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            fused=True,
        )
        self.steps = 0
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id

    def _compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.startswith("cuda") and self.world == 1:
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
        if not mine:
            raise ValueError("every rank needs at least one sample; give at least `world` samples")
        my_tokens = sum(len(s.completion_ids) for s in mine)
        batches = micro_batches(mine, self.config.tokens_per_micro_batch)
        total_tokens, most_batches = _all_reduce(
            [float(my_tokens), float(len(batches))], self.device, ("sum", "max")
        )
        if self.world > 1:
            batches = equal_micro_batches(
                mine, self.config.tokens_per_micro_batch, int(most_batches)
            )
        sums = {"loss": 0.0, "clipped_tokens": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0, "kl_rows": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            weight = 1.0
            if not batch:  # this rank's share ran out: the same passes, contributing nothing
                batch, weight = mine[:1], 0.0
            with self._autocast():
                logprobs, mask = completion_logprobs(
                    self.policy, batch, self.device, self.config.temperature, self.pad_id
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
                    mask * weight,
                    self.config.clip_eps,
                    reference,
                    self.config.kl_coef,
                )
                # Gradients are averaged over ranks; x world turns that back into a global sum.
                (loss_sum * self.world / total_tokens).backward()
            sums["loss"] += float(loss_sum.detach())
            sums["clipped_tokens"] += float(metrics["clipped_tokens"])
            sums["ratio_sum"] += float(metrics["ratio_sum"])
            if "kl_sum" in metrics:
                sums["kl_sum"] += float(metrics["kl_sum"])
                sums["kl_rows"] += float((mask * weight).sum())
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
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
            with torch.no_grad():
                logprobs, _ = completion_logprobs(
                    self.reference,
                    batch,
                    self.reference_device,
                    self.config.temperature,
                    self.pad_id,
                )
            return logprobs.to(self.device)
        return None

    # -- what the learner publishes (collective: every rank calls these) --------------------

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> list[float]:
        """Logprob (temperature 1) of each token after the first: the parity probe."""
        self.policy.eval()
        try:
            ids = torch.tensor([token_ids], device=self.device)
            positions = torch.arange(len(token_ids) - 1, device=self.device)
            with self._autocast(), self._one_cpu_thread():
                out = self.policy(
                    ids, torch.ones_like(ids), torch.zeros_like(positions), positions, 1.0
                )
            return out.float().tolist()
        finally:
            self.policy.train()

    @contextlib.contextmanager
    def _one_cpu_thread(self) -> Iterator[None]:
        """A probe of a few dozen tokens on the CPU gains nothing from intra-op threads, and
        on a busy machine their spin-waits cost more than the forward: 30 against 2.3 CPU ms
        for the tiny model's 32-token probe with both cores busy (on the control-plane
        benchmark it was half of the learner's CPU)."""
        if not self.device.startswith("cpu"):
            yield
            return
        # The thread count is the process's: two probes at once (two jobs in one learner)
        # must not interleave their save and restore, or one restores the other's 1 for good.
        with _CPU_THREADS_SET:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                yield
            finally:
                torch.set_num_threads(threads)

    def full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[TensorSpec]:
        """The model's tensors in Hugging Face names, each gathered from the ranks (and cast
        to `dtype`) only when it is produced: at most one whole tensor at a time."""
        for name, tensor in self.model.state_dict().items():
            local: Any = tensor.detach()
            yield TensorSpec(name, tuple(local.shape), dtype or local.dtype, _gatherer(local))

    def save_weights(self, path: Path, dtype: str = "float32") -> tuple[str, int]:
        """Write the weights in `dtype` (the engines'), streamed and hashed in one pass;
        returns (BLAKE3 hex, bytes). Every rank gathers; rank 0 writes (others get ("", 0))."""
        specs = self.full_tensors(WEIGHT_DTYPES[dtype])
        if self.rank == 0:
            return write_safetensors(path, specs)
        for spec in specs:  # take part in each gather
            spec.produce()
        return "", 0

    def save_checkpoint(self, directory: Path, state: dict[str, Any]) -> Path:
        """A full checkpoint (model and tokenizer in HF format, optimizer, trainer and job
        state), written under a temporary name and renamed by rank 0: it exists whole or not
        at all. Every rank takes part in gathering the shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = get_optimizer_state_dict(self.policy, self.optimizer, options=options)
        if self.rank != 0:
            return directory
        temporary = temporary_sibling(directory)
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir(parents=True)
        try:
            self.model.save_pretrained(temporary, state_dict=model_state, safe_serialization=True)
            self.tokenizer.save_pretrained(temporary)
            # Through a Python file, so that a full disk surfaces as the OSError behind
            # torch's RuntimeError (a path is written by C++, which only says "unexpected pos").
            with open(temporary / "optimizer.pt", "wb") as out:
                torch.save(optimizer_state, out)
            (temporary / "trainer_state.json").write_text(
                json.dumps({"steps": self.steps, "config": asdict(self.config), **state}, indent=2)
                + "\n"
            )
            for file in temporary.iterdir():
                _fsync(file)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)  # nothing partial is left behind
            raise
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(temporary, directory)
        _fsync_dir(directory.parent)
        return directory

    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Restore model, optimizer and step from a checkpoint; returns its saved state.
        Rank 0 reads the files and the ranks take their shards from it."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        sharded = self.world > 1
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded)
        model_state: dict[str, Any] = {}
        optimizer_state: dict[str, Any] = {}
        if self.rank == 0 or not sharded:
            for file in sorted(directory.glob("*.safetensors")):
                model_state.update(load_file(str(file)))
            if TIED_OUTPUT not in model_state and self.model.config.tie_word_embeddings:
                model_state[TIED_OUTPUT] = model_state[TIED_INPUT]
            optimizer_state = torch.load(
                directory / "optimizer.pt", map_location="cpu", weights_only=True
            )
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(self.policy, self.optimizer, optimizer_state, options=options)
        state = json.loads((directory / "trainer_state.json").read_text())
        self.steps = state["steps"]
        return state


def _shard(policy: torch.nn.Module, device: str) -> torch.nn.Module:
    """FSDP2 over the process group: each decoder layer a unit, the rest (embeddings, final
    norm, output layer) in the root. bf16 compute and fp32 gradient reduction on GPUs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.startswith("cuda")
        else MixedPrecisionPolicy()
    )
    lm: Any = policy.lm
    for layer in lm.model.layers:
        fully_shard(layer, mp_policy=precision)
    fully_shard(policy, mp_policy=precision)
    return policy


def _gatherer(tensor: Any) -> Callable[[], torch.Tensor]:
    """A function giving the whole of `tensor`, gathered from the ranks if it is sharded."""
    return tensor.full_tensor if hasattr(tensor, "full_tensor") else lambda: tensor


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
