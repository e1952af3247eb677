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
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from rlnode.messages import JobConfig, SamplingSpec, TrainingSpec
from rlnode.messages.config import AdamWSpec, LoraSpec
from rlnode.models import TIED_INPUT, TIED_OUTPUT
from rlnode.models.hf import load_causal_lm, load_tokenizer
from rlnode.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, peft_config, saved_in_full
from rlnode.models.safetensors_io import TensorSpec, write_safetensors
from rlnode.training.grpo import Sample, trained_tokens
from rlnode.training.losses import LossInputs, LossSettings, loss_settings, make_loss
from rlnode.training.losses.tinker import TokenLoss
from rlnode.training.micro_batch_sizing import MicroBatchSizer
from rlnode.training.schedule import learning_rate_at
from rlnode.training.shared_prompts import (
    BLOCK_MASK_ATTENTION,
    PackedRows,
    PackedSequences,
    pack,
    pack_sequences,
    packed_tokens,
    prefix_rows,
    prompt_groups,
    shares_prompts,
)
from rlnode.training.storage import temporary_sibling

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_CPU_THREADS_SET = threading.Lock()  # held while a probe changes torch's CPU threads


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer needs of a job, taken from its config in one place (`for_job`): the
    defaults and their meaning live once, on `TrainingSpec` and `SamplingSpec`."""

    optimizer: AdamWSpec  # AdamW's settings and the learning-rate schedule
    total_steps: int  # the job's training steps: where a decay's schedule ends by default
    algorithm: str  # the policy loss (rlnode.training.losses)
    loss: LossSettings
    temperature: float  # the sampling temperature: logprobs are of logits / temperature
    tokens_per_micro_batch: int | None  # None: sized from measurement (MicroBatchSizer)
    minibatches: int  # optimizer steps per training step (see minibatch_parts)
    seed: int
    logit_chunk_tokens: int = 64
    compute_dtype: str = "auto"  # TrainingSpec.compute_dtype
    # The passes on a copy of the weights in compute_dtype, not autocast (one rank).
    weights_in_compute_dtype: bool = False
    activation_checkpointing: bool = False
    # With activation_checkpointing: a pass of fewer (padded) tokens keeps its activations,
    # as recomputing them costs a quarter of its time (0: every pass recomputes).
    recompute_from_tokens: int = 0
    lora: LoraSpec | None = None  # train adapters on a frozen base (rlnode.models.lora)
    # Samples with the same prompt (a group's) trained as one row: the same logprobs and
    # gradients for fewer tokens (rlnode.training.shared_prompts). False: a row each.
    share_prompts: bool = True

    @classmethod
    def for_job(cls, config: JobConfig) -> TrainerConfig:
        return cls.of(config.training, config.sampling)

    @classmethod
    def of(cls, training: TrainingSpec, sampling: SamplingSpec | None = None) -> TrainerConfig:
        sampling = sampling or SamplingSpec()
        return cls(
            optimizer=training.optimizer,
            total_steps=training.steps,
            algorithm=training.algorithm,
            loss=loss_settings(training, sampling),
            # Temperature 0 is greedy sampling, scored at temperature 1 (see rlnode.engine).
            temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
            tokens_per_micro_batch=None
            if training.tokens_per_micro_batch == "measured"
            else training.tokens_per_micro_batch,
            minibatches=training.minibatches,
            seed=training.seed,
            logit_chunk_tokens=training.logit_chunk_tokens,
            compute_dtype=training.compute_dtype,
            weights_in_compute_dtype=training.weights_in_compute_dtype,
            activation_checkpointing=training.activation_checkpointing,
            lora=training.lora,
            share_prompts=training.share_prompts,
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
    # k3 of KL(sampler ‖ trainer) over the step's tokens before its first update: the
    # engines' numerical gap plus the samples' staleness (None: nothing trained).
    mismatch_kl: float | None = None
    micro_batch_tokens: int = 0  # the budget its micro-batches were packed to (the largest)
    learning_rate: float = 0.0  # the schedule's rate for the step


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
        self.attention = getattr(lm.config, "_attn_implementation", None)
        # Whether rows of shared prompts can be passed (rlnode.training.shared_prompts).
        self.takes_block_masks = self.attention in BLOCK_MASK_ATTENTION
        if getattr(lm.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("output layers with a bias are not supported")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        temperature: float,
        targets: torch.Tensor | None = None,
        graded: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logprob of token `input_ids[r, p + 1]` (or `targets[i]`) after
        `input_ids[r, : p + 1]`, for each (r, p) in zip(rows, positions); where `graded`
        (one bool per pair) is False, without a gradient. `attention_mask` is the rows'
        padding [rows, width], or which keys each query sees [rows, 1, width, width] (bool;
        with `position_ids`: packed rows of shared prompts)."""
        if attention_mask.dim() == 4 and self.attention == "eager":  # eager adds its mask
            blocked = torch.finfo(self.lm.get_input_embeddings().weight.dtype).min
            allowed = attention_mask.bool()
            attention_mask = torch.zeros(allowed.shape, device=allowed.device)
            attention_mask = attention_mask.masked_fill(~allowed, blocked)
        hidden = self.lm.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        chosen = hidden.last_hidden_state[rows, positions]
        weight = self.lm.get_output_embeddings().weight
        if targets is None:
            targets = input_ids[rows, positions + 1]
        # Trainer.forward_backward passes a datum with no graded position without gradients,
        # so a pass with gradients has at least one here.
        if graded is None or not torch.is_grad_enabled() or bool(graded.all()):
            return token_logprobs(chosen, weight, targets, temperature, self.chunk_tokens)
        with torch.no_grad():
            out = token_logprobs(chosen, weight, targets, temperature, self.chunk_tokens)
        picked = graded.nonzero().squeeze(-1)
        with_grad = token_logprobs(
            chosen[picked], weight, targets[picked], temperature, self.chunk_tokens
        )
        return out.index_put((picked,), with_grad)


def completion_logprobs(
    model: torch.nn.Module,
    batch: list[Sample],
    device: str,
    temperature: float,
    pad_id: int,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (of logits / temperature) of every trained completion token, right-padded
    into a [rows, longest completion] tensor, and the mask of the trained tokens: 0 past a
    row's end and where `Sample.loss_mask` says the environment wrote the token (a merged
    multi-turn trajectory), whose logprob is not computed (0 there). `model` is a
    `CompletionLogprobs` (or a sharded one). With `share_prompts`, samples with the same
    prompt are one row (rlnode.training.shared_prompts) where the model takes it."""
    if share_prompts and getattr(model, "takes_block_masks", False) and shares_prompts(batch):
        return _shared_prompt_logprobs(model, batch, device, temperature, pad_id)
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
    return out, _trained_mask(batch, longest, device)


def _shared_prompt_logprobs(
    model: torch.nn.Module, batch: list[Sample], device: str, temperature: float, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` of `batch` packed by prompt: the same values, fewer tokens."""
    packed = pack(batch, pad_id)
    flat = _packed_pass(model, packed, device, temperature)
    longest = max(len(s.completion_ids) for s in batch)
    out = torch.zeros((len(batch), longest), device=device, dtype=flat.dtype)
    where = (
        torch.tensor(packed.samples, device=device),
        torch.tensor(packed.columns, device=device),
    )
    return out.index_put(where, flat), _trained_mask(batch, longest, device)


def _packed_pass(
    model: torch.nn.Module,
    packed: PackedRows,
    device: str,
    temperature: float,
    graded: list[bool] | None = None,
) -> torch.Tensor:
    """`model`'s logprob of each read of `packed` (samples' or datums' rows), in order;
    where `graded` is False, without a gradient."""
    return model(
        packed.input_ids.to(device),
        packed.allowed.to(device),
        torch.tensor(packed.rows, device=device),
        torch.tensor(packed.positions, device=device),
        temperature,
        torch.tensor(packed.targets, device=device),
        torch.tensor(graded, device=device) if graded is not None else None,
        packed.position_ids.to(device),
    )


def _trained_mask(batch: list[Sample], longest: int, device: str) -> torch.Tensor:
    """1 at each row's trained completion tokens, 0 past its end and at the environment's
    tokens of a merged multi-turn trajectory."""
    mask = torch.zeros((len(batch), longest))
    for row, s in enumerate(batch):
        if s.loss_mask is None:
            mask[row, : len(s.completion_ids)] = 1.0
        else:  # a merged trajectory: the environment's tokens are not trained
            mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=mask.dtype)
    return mask.to(device)


def datum_logprobs(
    model: torch.nn.Module,
    batch: list[TokenDatum],
    device: str,
    pad_id: int,
    loss: TokenLoss | None = None,
    packed: PackedSequences | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (temperature 1) of each datum's target at every position, right-padded into
    [rows, longest datum], and the mask of real positions. With `loss`, only the positions
    it has a gradient at are differentiable. With `packed` (`pack_datums`), the datums'
    shared prefixes are computed once."""
    if packed is not None:
        return _packed_datum_logprobs(model, batch, device, packed, loss)
    width = max(d.tokens for d in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width))
    rows: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    graded: list[bool] = []
    for row, d in enumerate(batch):
        input_ids[row, : d.tokens] = torch.tensor(d.input_ids)
        mask[row, : d.tokens] = 1.0
        rows.extend([row] * d.tokens)
        positions.extend(range(d.tokens))
        targets.extend(d.targets)
        if loss is not None:
            graded.extend(loss.differentiated(d.inputs, d.tokens))
    index_rows, index_positions = torch.tensor(rows), torch.tensor(positions)
    flat = model(
        input_ids.to(device),
        mask.to(device, dtype=torch.long),
        index_rows.to(device),
        index_positions.to(device),
        1.0,
        torch.tensor(targets, device=device),
        torch.tensor(graded, device=device) if loss is not None else None,
    )
    out = torch.zeros((len(batch), width), device=device, dtype=flat.dtype)
    out = out.index_put((index_rows.to(device), index_positions.to(device)), flat)
    return out, mask.to(device)


def pack_datums(
    model: torch.nn.Module, batch: list[TokenDatum], pad_id: int
) -> PackedSequences | None:
    """`batch` packed on the prefixes its datums share (a group's prompt), where the model
    takes packed rows and they compute fewer tokens than a row each; else None."""
    if not getattr(model, "takes_block_masks", False) or len(batch) < 2:
        return None
    packed = pack_sequences([d.input_ids for d in batch], [d.targets for d in batch], pad_id)
    return packed if packed.padded_tokens < len(batch) * max(d.tokens for d in batch) else None


def _packed_datum_logprobs(
    model: torch.nn.Module,
    batch: list[TokenDatum],
    device: str,
    packed: PackedSequences,
    loss: TokenLoss | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`datum_logprobs` from `packed`: each shared position scored once, read by every
    datum sharing it (its gradient the sum of theirs, as the rows' copies would get)."""
    graded: list[bool] | None = None
    if loss is not None:
        graded = [False] * len(packed.rows)
        for d, entries in zip(batch, packed.reads, strict=True):
            differentiated_at = loss.differentiated(d.inputs, d.tokens)
            for entry, differentiated in zip(entries, differentiated_at, strict=True):
                graded[entry] = graded[entry] or bool(differentiated)
    flat = _packed_pass(model, packed, device, 1.0, graded)
    width = max(d.tokens for d in batch)
    index = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width))
    for row, entries in enumerate(packed.reads):
        index[row, : len(entries)] = torch.tensor(entries, dtype=torch.long)
        mask[row, : len(entries)] = 1.0
    mask = mask.to(device)
    return torch.where(mask.bool(), flat[index.to(device)], 0.0), mask


def _tied_output_name(model: Any) -> str | None:
    """The state-dict name of the output layer's weight when it is the input embedding's
    tensor (tied weights), else None."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return None
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or embedding is None or output.weight is not embedding.weight:
        return None
    for name, module in model.named_modules(remove_duplicate=False):
        if module is output:
            return f"{name}.weight"
    return None


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


class _Row(Protocol):
    @property
    def tokens(self) -> int: ...


Row = TypeVar("Row", bound=_Row)


@dataclass
class TokenDatum:
    """A Tinker Datum as the trainer takes it: the model's input tokens, the token to score
    at each position (`targets`), and the loss's other inputs, one value per position."""

    input_ids: list[int]
    targets: list[int]
    inputs: dict[str, list[float]]

    @property
    def tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class TokenPass:
    """What a forward(-backward) pass over datums gives back: each datum's logprobs of its
    targets, and the loss summed over all of them."""

    logprobs: list[list[float]]
    loss_sum: float
    tokens: int


def micro_batches(samples: list[Row], token_budget: int) -> list[list[Row]]:
    """Pack samples (longest first) so that rows x longest row stays within the budget."""
    ordered = sorted(samples, key=lambda s: s.tokens, reverse=True)
    batches: list[list[Row]] = []
    for s in ordered:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].tokens <= token_budget:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


def equal_micro_batches(samples: list[Row], token_budget: int, count: int) -> list[list[Row]]:
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
        # mixed precision with several), on the CPU where the job asks for it (autocast,
        # or with `weights_in_compute_dtype` passes on a bf16 copy of the weights).
        model = load_causal_lm(model_path, dtype=torch.float32)
        if config.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model.to(device)  # type: ignore[arg-type]  # transformers' stub of the @wraps(Module.to) method wants the model as its first argument
        # With LoRA, PEFT puts adapters into the model's linear layers in place and freezes
        # the rest: `self.model` stays the causal LM the logprobs are computed from.
        self.adapted: Any = _with_adapters(self.model, config.lora) if config.lora else None
        self.model.train()
        policy = CompletionLogprobs(self.model, config.logit_chunk_tokens)
        self.share_prompts = config.share_prompts and policy.takes_block_masks
        self.policy: torch.nn.Module = policy
        if self.world > 1:
            self.policy = _shard(self.policy, device, self._compute_dtype())
        self.micro_batches = MicroBatchSizer(
            device,
            fixed=config.tokens_per_micro_batch,
            reduce=lambda values, ops: _all_reduce(values, device, ops),
        )
        # The passes' model: the policy itself, or a copy of its weights in the compute
        # dtype (see `_compute_copy`), whose gradients are carried into the fp32 masters.
        self.compute_model, self.compute_policy = self.model, self.policy
        self._copied: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        lower = self._compute_dtype() != torch.float32
        if config.weights_in_compute_dtype and lower and self.world == 1:
            self.compute_model = _compute_copy(self.model, self._compute_dtype())
            self.compute_policy = CompletionLogprobs(self.compute_model, config.logit_chunk_tokens)
            self._copied = list(
                zip(self.model.parameters(), self.compute_model.parameters(), strict=True)
            )
        self.micro_batches.exclude([*self.policy.parameters(), *self.compute_policy.parameters()])
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
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=config.optimizer.lr,
            betas=config.optimizer.betas,
            eps=config.optimizer.eps,
            weight_decay=config.optimizer.weight_decay,
            fused=True,
        )
        self.loss = make_loss(config.loss, config.algorithm)
        self.steps = 0
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id

    def _compute_dtype(self) -> torch.dtype:
        if self.config.compute_dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return WEIGHT_DTYPES[self.config.compute_dtype]

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self._compute_dtype()
        cuda = self.device.startswith("cuda")
        if dtype == torch.float32 or (cuda and self.world > 1):  # FSDP casts on GPUs
            return contextlib.nullcontext()
        return torch.autocast("cuda" if cuda else "cpu", dtype=dtype)

    def _pass_precision(self) -> contextlib.AbstractContextManager[Any]:
        """The training passes': autocast, or nothing where their weights are the copy
        already in the compute dtype."""
        return contextlib.nullcontext() if self._copied else self._autocast()

    def _carry_gradients(self) -> None:
        """Adds the compute copy's gradients (one pass's) to the fp32 masters': accumulated
        over micro-batches in fp32, as autocast's are."""
        for master, copy in self._copied:
            if copy.grad is None:
                continue
            if master.grad is None:
                master.grad = copy.grad.to(master.dtype)
            else:
                master.grad.add_(copy.grad)
            copy.grad = None

    @torch.no_grad()
    def _refresh_compute_copy(self, trained_only: bool = True) -> None:
        """The compute copy's weights rounded from the masters (after an optimizer step: the
        trained ones; after loading a checkpoint: all)."""
        for master, copy in self._copied:
            if master.requires_grad or not trained_only:
                copy.copy_(master)

    def step(self, samples: list[Sample], index: int | None = None) -> StepMetrics:
        """One training step on `samples` (every rank passes the same list): `minibatches`
        optimizer steps, each on its part of the samples (the same parts on every rank), or
        one step on them all, at the schedule's rate for the job's step `index` (from 0;
        default: the steps this trainer took, which a job's skipped steps do not count).
        Metrics are token-weighted over the parts; `mismatch_kl` is the first part's,
        measured before any update."""
        started = time.perf_counter()
        if not samples:
            raise ValueError("a training step needs at least one sample")
        rate = self.learning_rate_at(self.steps if index is None else index)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        parts = minibatch_parts(
            samples, self.config.minibatches, self.world, seed=f"{self.config.seed}:{self.steps}"
        )
        # Truncated IS over several optimizer steps needs the policy before the first one.
        proximal = (
            self._proximal_logprobs(samples)
            if self.config.loss.tis_cap is not None and len(parts) > 1
            else None
        )
        results = [self._optimizer_step(part, proximal) for part in parts]
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
            mismatch_kl=results[0].mismatch_kl,
            micro_batch_tokens=max(r.micro_batch_tokens for r in results),
            learning_rate=rate,
        )

    def learning_rate_at(self, index: int) -> float:
        """The job's rate at its training step `index` (rlnode.training.schedule)."""
        return learning_rate_at(self.config.optimizer, index, self.config.total_steps)

    def _sample_batches(
        self, samples: list[Sample], count: int | None = None
    ) -> list[list[Sample]]:
        """`samples` in micro-batches within the budget (exactly `count` of them, when
        given: see `equal_micro_batches`); with shared prompts, a group's samples together,
        each micro-batch's packed rows within the budget."""
        if not self.share_prompts:
            return self._filled(samples, count)
        rows = prompt_groups(samples, self.micro_batches.budget)
        return [
            [s for group in batch for s in group.samples] for batch in self._filled(rows, count)
        ]

    def _filled(self, rows: list[Row], count: int | None) -> list[list[Row]]:
        """`rows` in micro-batches within the budget (exactly `count` of them, when given)."""
        budget = self.micro_batches.budget
        if count is None:
            return micro_batches(rows, budget)
        return equal_micro_batches(rows, budget, count)

    def _padded_tokens(self, batch: list[Sample]) -> int:
        """The tokens a micro-batch's pass computes, padding included."""
        if self.share_prompts and shares_prompts(batch):
            return packed_tokens(batch)
        return len(batch) * max(s.tokens for s in batch)

    def _logprobs(
        self, model: torch.nn.Module, batch: list[Sample], device: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`completion_logprobs` of `batch` under `model` (the policy or the reference)."""
        return completion_logprobs(
            model, batch, device, self.config.temperature, self.pad_id, self.share_prompts
        )

    def _proximal_logprobs(self, samples: list[Sample]) -> dict[int, list[float]]:
        """The policy's logprobs of every sample's completion before the step (by the
        sample's id()), for truncated IS across several optimizer steps."""
        mine = samples[self.rank :: self.world]
        out: dict[int, list[float]] = {}
        with torch.no_grad(), self._pass_precision():
            for batch in self._sample_batches(mine):
                logprobs, _ = self._logprobs(self.compute_policy, batch, self.device)
                for row, sample in enumerate(batch):
                    out[id(sample)] = logprobs[row, : len(sample.completion_ids)].float().tolist()
        return out

    def _optimizer_step(
        self, samples: list[Sample], proximal: dict[int, list[float]] | None = None
    ) -> StepMetrics:
        """One optimizer step on `samples` (every rank passes the same list; each trains on
        its share). The loss is the algorithm's sum over the whole batch divided by its
        normaliser (rlnode.training.losses), whatever the split."""
        started = time.perf_counter()
        mine = samples[self.rank :: self.world]
        if not mine:
            raise ValueError("every rank needs at least one sample; give at least `world` samples")
        trained = [trained_tokens(s) for s in samples]
        total_tokens = float(sum(trained))
        normaliser = self.loss.normaliser(samples)
        budget = self.micro_batches.budget
        batches = self._sample_batches(mine)
        (most_batches,) = _all_reduce([float(len(batches))], self.device, ("max",))
        if self.world > 1:
            batches = self._sample_batches(mine, int(most_batches))
        sums = dict.fromkeys(("loss", "clipped", "ratio", "kl", "kl_tokens", "mismatch"), 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            weight = 1.0
            if not batch:  # this rank's share ran out: the same passes, contributing nothing
                batch, weight = mine[:1], 0.0
            padded = self._padded_tokens(batch)
            with self._pass_precision(), self.micro_batches.measure(padded):
                logprobs, mask = self._logprobs(self.compute_policy, batch, self.device)
                width = logprobs.shape[1]
                mask = mask * weight
                terms = self.loss(
                    LossInputs(
                        logprobs=logprobs,
                        behaviour=_padded(
                            [s.behaviour_logprobs for s in batch], width, self.device
                        ),
                        advantages=torch.tensor(
                            [s.advantage for s in batch], device=self.device
                        ).unsqueeze(-1),
                        mask=mask,
                        reference=self._reference_logprobs(batch, width),
                        proximal=_padded([proximal[id(s)] for s in batch], width, self.device)
                        if proximal is not None
                        else None,
                    )
                )
                # Gradients are averaged over ranks; x world turns that back into a global sum.
                (terms.total * self.world / normaliser).backward()
            self._carry_gradients()
            sums["loss"] += float(terms.total.detach())
            sums["clipped"] += float(terms.clipped_tokens)
            sums["ratio"] += float(terms.ratio_sum)
            if terms.mismatch_kl_sum is not None:
                sums["mismatch"] += float(terms.mismatch_kl_sum)
            if terms.kl_sum is not None:
                sums["kl"] += float(terms.kl_sum)
                sums["kl_tokens"] += float(mask.sum())
        norm = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), self.config.optimizer.max_grad_norm
        )
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self._refresh_compute_copy()
        self.micro_batches.step_done()
        loss, clipped, ratio, kl_sum, kl_tokens, mismatch = _all_reduce(
            [sums[k] for k in ("loss", "clipped", "ratio", "kl", "kl_tokens", "mismatch")],
            self.device,
        )
        return StepMetrics(
            loss=loss / normaliser,
            kl=(kl_sum / kl_tokens) if kl_tokens else None,
            clip_fraction=clipped / total_tokens if total_tokens else 0.0,
            ratio_mean=ratio / total_tokens if total_tokens else 0.0,
            grad_norm=grad_norm,
            tokens=int(total_tokens),
            samples=len(samples),
            compute_s=time.perf_counter() - started,
            mismatch_kl=mismatch / total_tokens if total_tokens else None,
            micro_batch_tokens=budget,
        )

    # -- the Tinker API's steps: passes that add to the gradients, then an optimizer step ----

    def forward_backward(
        self, datums: list[TokenDatum], loss: TokenLoss, backward: bool = True
    ) -> TokenPass:
        """The loss of `datums` (every rank passes the same list; each computes its share),
        summed, and with `backward` its gradients added to those already accumulated: the
        next `optim_step` applies them all. Returns every datum's logprobs of its targets.
        With shared prompts, datums that share a prefix (a group's prompt) are packed on it:
        the same logprobs and gradients for fewer tokens."""
        if not datums:
            raise ValueError("a forward pass needs at least one datum")
        logprobs: dict[int, list[float]] = {}
        # A datum the loss has no gradient at (every advantage 0: a group of equal rewards)
        # is only scored, as the job loop drops such groups: no backward pass for it.
        graded = [backward and any(loss.differentiated(d.inputs, d.tokens)) for d in datums]
        loss_sum = 0.0
        for differentiate in (True, False):
            chosen = [i for i, g in enumerate(graded) if g == differentiate]
            if chosen:  # the same on every rank: they all pass the same datums
                loss_sum += self._passes(datums, chosen, loss, differentiate, logprobs)
        (loss_sum,) = _all_reduce([loss_sum], self.device)
        if self.world > 1:
            shares: list[Any] = [None] * self.world
            dist.all_gather_object(shares, logprobs)
            for share in shares:
                logprobs.update(share)
        return TokenPass(
            logprobs=[logprobs[i] for i in range(len(datums))],
            loss_sum=loss_sum,
            tokens=sum(d.tokens for d in datums),
        )

    def _passes(
        self,
        datums: list[TokenDatum],
        chosen: list[int],
        loss: TokenLoss,
        backward: bool,
        logprobs: dict[int, list[float]],
    ) -> float:
        """This rank's share of `chosen` datums in micro-batches: their logprobs into
        `logprobs` (by datum index), and with `backward` their gradients accumulated.
        Returns this rank's loss sum."""
        order = chosen[self.rank :: self.world]
        mine = [datums[i] for i in order]
        batches = self._datum_batches(mine)
        if self.world > 1:  # every rank runs as many passes (each gathers the shards)
            (most,) = _all_reduce([float(len(batches))], self.device, ("max",))
            batches = self._datum_batches(mine, int(most))
        loss_sum = 0.0
        position = {id(d): i for i, d in zip(order, mine, strict=True)}
        for batch in batches:
            weight = 1.0
            if not batch:  # this rank's share ran out: the same passes, contributing nothing
                batch, weight = mine[:1] or [datums[chosen[0]]], 0.0
            packed = (
                pack_datums(self.compute_policy, batch, self.pad_id) if self.share_prompts else None
            )
            padded = packed.padded_tokens if packed else len(batch) * max(d.tokens for d in batch)
            self._recompute_activations(padded)
            measured = self.micro_batches.measure(padded) if backward else contextlib.nullcontext()
            with torch.set_grad_enabled(backward), self._pass_precision(), measured:
                lp, mask = datum_logprobs(
                    self.compute_policy, batch, self.device, self.pad_id, loss, packed
                )
                width = lp.shape[1]
                inputs = {
                    key: _padded([d.inputs[key] for d in batch], width, self.device)
                    for key in batch[0].inputs
                }
                total = (loss.per_token(lp.float(), inputs) * mask).sum() * weight
                if backward:
                    # Gradients are averaged over ranks; x world turns that into a global sum.
                    (total * self.world).backward()
                    self._carry_gradients()
            loss_sum += float(total.detach())
            if weight:
                for row, d in enumerate(batch):
                    logprobs[position[id(d)]] = lp[row, : d.tokens].detach().float().tolist()
        return loss_sum

    def _datum_batches(
        self, datums: list[TokenDatum], count: int | None = None
    ) -> list[list[TokenDatum]]:
        """`datums` in micro-batches within the budget (exactly `count`, when given); with
        shared prompts, datums sharing a prefix together, as packed rows within it."""
        if not self.share_prompts:
            return self._filled(datums, count)
        rows = prefix_rows([d.input_ids for d in datums], self.micro_batches.budget)
        batches = self._filled(rows, count)
        return [[datums[i] for row in batch for i in row.members] for batch in batches]

    def _recompute_activations(self, tokens: int) -> None:
        if not self.config.activation_checkpointing:
            return
        recompute = tokens >= self.config.recompute_from_tokens
        for module in self.compute_model.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = recompute

    def optim_step(
        self,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> float:
        """One AdamW step on the gradients accumulated since the last (decoupled weight
        decay; the global gradient norm clipped to `grad_clip_norm` when it is > 0), with
        this step's hyperparameters. Returns the gradient norm before clipping."""
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        limit = grad_clip_norm if grad_clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), limit)
        self.optimizer.step()
        self._refresh_compute_copy()
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_batches.step_done()
        self.steps += 1
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _reference_logprobs(self, batch: list[Sample], width: int) -> torch.Tensor | None:
        carried = [s.ref_logprobs for s in batch if s.ref_logprobs is not None]
        if len(carried) == len(batch):  # stacked on inference: they came with the data
            return _padded(carried, width, self.device)
        if self.reference is not None:
            with torch.no_grad():
                logprobs, _ = self._logprobs(self.reference, batch, self.reference_device)
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
            # The probe is bf16 where the engines are (GPUs); fp32 on the CPU, whatever
            # the passes compute in, as the CPU engines do.
            precision = self._autocast() if self.device.startswith("cuda") else None
            with precision or contextlib.nullcontext(), self._one_cpu_thread():
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
        """The model's tensors in Hugging Face names (with LoRA: the adapters' alone, in
        PEFT's names), each gathered from the ranks (and cast to `dtype`) only when it is
        produced: at most one whole tensor at a time."""
        for name, tensor in self._published_state().items():
            local: Any = tensor.detach()
            yield TensorSpec(name, tuple(local.shape), dtype or local.dtype, _gatherer(local))

    def _published_state(self) -> dict[str, Any]:
        if self.adapted is None:
            state = dict(self.model.state_dict())
            # A tied output layer is the embedding: written once, as save_pretrained does
            # (SmolLM2's version was 651 MB for 538 MB of parameters); loaders tie it back.
            tied = _tied_output_name(self.model)
            if tied is not None:
                state.pop(tied, None)
            return state
        from peft import get_peft_model_state_dict

        state = dict(get_peft_model_state_dict(self.adapted))
        # Modules trained in full travel beside the adapters, as PEFT saves modules_to_save.
        state.update((PREFIX + name, p) for name, p in _saved_in_full(self.model, self.config.lora))
        return state

    def published_parameters(self) -> int:
        """Parameters in a weight version: the model's, or the adapters' with LoRA."""
        return sum(int(t.numel()) for t in self._published_state().values())

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
        model_state: dict[str, Any]
        if self.adapted is not None:  # the adapters alone; the config names the base
            model_state = {
                name: _gatherer(t)().cpu() for name, t in self._published_state().items()
            }
        else:
            model_state = dict(get_model_state_dict(self.model, options=options))
        optimizer_state = get_optimizer_state_dict(self.policy, self.optimizer, options=options)
        if self.rank != 0:
            return directory
        temporary = temporary_sibling(directory)
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir(parents=True)
        try:
            if self.adapted is not None:
                from safetensors.torch import save_file

                assert self.config.lora is not None
                save_file(model_state, str(temporary / ADAPTER_WEIGHTS))
                (temporary / ADAPTER_CONFIG).write_text(
                    json.dumps(peft_config(self.config.lora, self.model_path), indent=2) + "\n"
                )
            else:
                self.model.save_pretrained(
                    temporary, state_dict=model_state, safe_serialization=True
                )
            self.tokenizer.save_pretrained(temporary)
            # Through a Python file, so that a full disk surfaces as the OSError behind
            # torch's RuntimeError (a path is written by C++, which only says "unexpected pos").
            with open(temporary / "optimizer.pt", "wb") as out:
                torch.save(optimizer_state, out)
            (temporary / "trainer_state.json").write_text(
                json.dumps(
                    {"steps": self.steps, "config": asdict(self.config), **state},
                    indent=2,
                    default=_jsonable,
                )
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

    def load_checkpoint(self, directory: Path, with_optimizer: bool = True) -> dict[str, Any]:
        """Restore model, optimizer and step from a checkpoint; returns its saved state.
        Rank 0 reads the files and the ranks take their shards from it. Without
        `with_optimizer`, the weights alone: the optimizer starts afresh, the step stays."""
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
        if self.adapted is not None:
            from peft import set_peft_model_state_dict

            adapter = load_file(str(directory / ADAPTER_WEIGHTS))
            full = saved_in_full(adapter)
            set_peft_model_state_dict(
                self.adapted, {k: v for k, v in adapter.items() if k not in full}
            )
            self.model.load_state_dict({full[k]: adapter[k] for k in full}, strict=False)
        elif self.rank == 0 or not sharded:
            for file in sorted(directory.glob("*.safetensors")):
                model_state.update(load_file(str(file)))
            if TIED_OUTPUT not in model_state and self.model.config.tie_word_embeddings:
                model_state[TIED_OUTPUT] = model_state[TIED_INPUT]
        if with_optimizer and (self.rank == 0 or not sharded):
            optimizer_state = torch.load(
                directory / "optimizer.pt", map_location="cpu", weights_only=True
            )
        if self.adapted is None:
            set_model_state_dict(self.model, model_state, options=options)
        state = json.loads((directory / "trainer_state.json").read_text())
        if with_optimizer:
            set_optimizer_state_dict(self.policy, self.optimizer, optimizer_state, options=options)
            self.steps = state["steps"]
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.state.clear()
        self._refresh_compute_copy(trained_only=False)
        return state


def _compute_copy(model: Any, dtype: torch.dtype) -> Any:
    """A copy of `model` with its parameters in `dtype` (tied ones still tied; adapters and
    what is frozen as in `model`) for the passes to run on: bf16 matmuls without
    autocast's cast of every weight at every use. Buffers keep their dtype (the rotary
    frequencies stay fp32, as a model loaded in bf16 keeps them)."""
    copy = deepcopy(model)
    for parameter in copy.parameters():
        parameter.data = parameter.data.to(dtype)
    return copy


def _shard(policy: torch.nn.Module, device: str, compute: torch.dtype) -> torch.nn.Module:
    """FSDP2 over the process group: each decoder layer a unit, the rest (embeddings, final
    norm, output layer) in the root. On GPUs the layers are gathered in the compute dtype
    (bf16 by default) and gradients reduced in fp32; on the CPU they stay fp32 (autocast
    casts there)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = (
        MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        if device.startswith("cuda") and compute != torch.float32
        else MixedPrecisionPolicy()
    )
    lm: Any = policy.lm
    for layer in lm.model.layers:
        fully_shard(layer, mp_policy=precision)
    fully_shard(policy, mp_policy=precision)
    return policy


def _with_adapters(model: Any, lora: LoraSpec) -> Any:
    """PEFT's LoRA layers in `model`'s target modules (in place); the base frozen."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(lora.target_modules) - present)
    if missing:
        raise ValueError(
            f"training.lora.target_modules {missing} are not modules of this model; its "
            f"linear layers include {sorted(n for n in present if n.endswith('proj'))[:12]}"
        )
    adapted = get_peft_model(
        model,
        LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
        ),
    )
    # modules_to_save: the base module itself trained (not PEFT's copy of it, which would
    # untie a tied output layer from its embedding and leave the engines' merge different).
    trained = {name.rsplit(".", 2)[-2] for name, _ in _saved_in_full(model, lora)}
    untrained = sorted(set(lora.modules_to_save) - trained)
    if untrained:
        raise ValueError(
            f"training.lora.modules_to_save {untrained} name no parameters of their own in "
            "this model (an output layer tied to the embedding trains as embed_tokens)"
        )
    for _name, parameter in _saved_in_full(model, lora):
        parameter.requires_grad_(True)
    return adapted


def _saved_in_full(model: Any, lora: LoraSpec | None) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of the LoRA job's modules_to_save, by base model name (a parameter
    shared by tied modules once)."""
    if lora is None or not lora.modules_to_save:
        return []
    wanted = set(lora.modules_to_save)
    return [
        (name, p)
        for name, p in model.named_parameters()
        if ".lora_" not in name and name.rsplit(".", 2)[-2] in wanted
    ]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


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
