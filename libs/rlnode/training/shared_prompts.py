"""Samples that share a prompt, trained as one row: the prompt once, then each sample's
completion, each attending to the prompt and to its own earlier tokens only (a block mask)
at the positions it would have alone.

The logprobs, and so the gradients, are those of one row per sample: a completion token sees
exactly what it would see alone, and the prompt's activations get the sum of its completions'
gradients, as the per-sample rows' copies of them would. What changes is the work: a GRPO
group of 8 completions of ~12 tokens after a ~40-token prompt is 8 x 52 = 416 tokens as
rows of its own, 40 + 8 x 11 = 128 packed (a completion's last token is only a target, never
an input). Packing is by identical prompt token ids, so it needs no group ids and applies to
any samples that happen to share a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlnode.training.grpo import Sample

# The attention implementations a block mask can be given to (transformers' names): sdpa
# takes a boolean [rows, 1, width, width] mask as it is, eager an additive one.
BLOCK_MASK_ATTENTION = ("sdpa", "eager")


@dataclass
class PromptGroup:
    """Samples with the same prompt, to be one packed row."""

    samples: list[Sample]

    @property
    def tokens(self) -> int:
        """The packed row's length: the prompt, then each completion but its last token."""
        return len(self.samples[0].prompt_ids) + sum(
            _inputs(len(s.completion_ids)) for s in self.samples
        )


def _inputs(completion: int) -> int:
    return max(0, completion - 1)


def prompt_groups(samples: Sequence[Sample], token_budget: int) -> list[PromptGroup]:
    """`samples` grouped by identical prompt (groups in order of first appearance, samples
    in their order), a group split into more rows where one would pass `token_budget`."""
    return [
        PromptGroup([samples[i] for i in row]) for row in _rows_by_prompt(samples, token_budget)
    ]


def shares_prompts(batch: Sequence[Sample]) -> bool:
    """Whether packing saves anything: two samples of `batch` have the same prompt."""
    return len({tuple(s.prompt_ids) for s in batch}) < len(batch)


def _rows_by_prompt(batch: Sequence[Sample], token_budget: int | None = None) -> list[list[int]]:
    """The indices of `batch`'s samples, one list per packed row: a row per distinct prompt
    (in order of first appearance), a new one where the prompt's row would pass
    `token_budget` (None: never)."""
    open_rows: dict[tuple[int, ...], list[int]] = {}
    open_tokens: dict[tuple[int, ...], int] = {}  # each open row's length so far
    rows: list[list[int]] = []
    for i, s in enumerate(batch):
        key = tuple(s.prompt_ids)
        added = _inputs(len(s.completion_ids))
        row = open_rows.get(key)
        if row is not None and (token_budget is None or open_tokens[key] + added <= token_budget):
            row.append(i)
            open_tokens[key] += added
            continue
        open_rows[key] = [i]
        open_tokens[key] = len(s.prompt_ids) + added
        rows.append(open_rows[key])
    return rows


def _row_tokens(batch: Sequence[Sample], members: list[int]) -> int:
    return PromptGroup([batch[i] for i in members]).tokens


def packed_tokens(batch: Sequence[Sample]) -> int:
    """The padded tokens (rows x widest row) of `batch` packed by prompt."""
    rows = _rows_by_prompt(batch)
    return len(rows) * max(_row_tokens(batch, members) for members in rows)


@dataclass
class PackedBatch:
    """A micro-batch's samples packed by prompt, as the model takes them, and where each
    trained completion token is read: the logprob of `targets[i]` comes from the hidden
    state at (`rows[i]`, `positions[i]`) and belongs to sample `samples[i]`, column
    `columns[i]` of its completion."""

    input_ids: torch.Tensor  # [rows, width]
    allowed: torch.Tensor  # [rows, 1, width, width], bool: query i may attend to key j
    position_ids: torch.Tensor  # [rows, width]
    rows: list[int]
    positions: list[int]
    targets: list[int]
    samples: list[int]
    columns: list[int]


def pack(batch: Sequence[Sample], pad_id: int) -> PackedBatch:
    """`batch` as rows of shared prompts (every sample's trained tokens, in batch order of
    their groups). Padding attends only to itself, so no row of the mask is empty (an
    all-masked query gives NaN in sdpa, which a backward pass would carry)."""
    rows = _rows_by_prompt(batch)
    width = max(_row_tokens(batch, members) for members in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1, 1)
    out = PackedBatch(input_ids, allowed, position_ids, [], [], [], [], [])
    for row, members in enumerate(rows):
        prompt = batch[members[0]].prompt_ids
        start = len(prompt)
        input_ids[row, :start] = torch.tensor(prompt)
        position_ids[row, :start] = torch.arange(start)
        allowed[row, 0, :start, :start] = torch.ones(start, start, dtype=torch.bool).tril()
        for i in members:
            s = batch[i]
            inputs = _inputs(len(s.completion_ids))
            end = start + inputs
            if inputs:
                input_ids[row, start:end] = torch.tensor(s.completion_ids[:-1])
                position_ids[row, start:end] = torch.arange(len(prompt), len(prompt) + inputs)
                allowed[row, 0, start:end, : len(prompt)] = True
                allowed[row, 0, start:end, start:end] = torch.ones(
                    inputs, inputs, dtype=torch.bool
                ).tril()
            for k, target in enumerate(s.completion_ids):
                if s.loss_mask is not None and not s.loss_mask[k]:
                    continue
                # Token k is predicted by the prompt's last position (k = 0), else by the
                # completion's token k - 1, at start + k - 1 in the row.
                out.rows.append(row)
                out.positions.append(len(prompt) - 1 if k == 0 else start + k - 1)
                out.targets.append(target)
                out.samples.append(i)
                out.columns.append(k)
            start = end
    return out
