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

The Tinker API's datums carry no prompt boundary and a target at every position; they are
packed on the longest prefixes they share (`pack_sequences`), each shared position scored
once for every datum whose target there is the same.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

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
class PackedRows:
    """Rows of shared prefixes as the model takes them, and the reads of them: the hidden
    state at (`rows[k]`, `positions[k]`) scores `targets[k]`. Each row holds its prefix once,
    then each member's rest, attending to the prefix and to its own earlier tokens at the
    positions it would have alone; padding attends only to itself, so no row of the mask is
    empty (an all-masked query gives NaN in sdpa, which a backward pass would carry)."""

    input_ids: torch.Tensor  # [rows, width]
    allowed: torch.Tensor  # [rows, 1, width, width], bool: query i may attend to key j
    position_ids: torch.Tensor  # [rows, width]
    rows: list[int]
    positions: list[int]
    targets: list[int]

    @classmethod
    def padded(cls, rows: int, width: int, pad_id: int, **reads: Any) -> Self:
        return cls(
            torch.full((rows, width), pad_id, dtype=torch.long),
            torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1, 1),
            torch.zeros((rows, width), dtype=torch.long),
            [],
            [],
            [],
            **reads,
        )

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def write_prefix(self, row: int, prefix: Sequence[int]) -> int:
        """`prefix` at the start of `row`, causal; returns where the members start."""
        n = len(prefix)
        self.input_ids[row, :n] = torch.tensor(prefix, dtype=torch.long)
        self.position_ids[row, :n] = torch.arange(n)
        self.allowed[row, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        return n

    def write_member(self, row: int, start: int, prefix: int, rest: Sequence[int]) -> int:
        """A member's tokens after a `prefix`-token prefix, from `start` in `row`, at the
        positions they would have alone; returns where the next member starts."""
        end = start + len(rest)
        if rest:
            self.input_ids[row, start:end] = torch.tensor(rest, dtype=torch.long)
            self.position_ids[row, start:end] = torch.arange(prefix, prefix + len(rest))
            self.allowed[row, 0, start:end, :prefix] = True
            self.allowed[row, 0, start:end, start:end] = torch.ones(
                len(rest), len(rest), dtype=torch.bool
            ).tril()
        return end


@dataclass
class PackedBatch(PackedRows):
    """A micro-batch's samples packed by prompt: read k is the trained completion token of
    sample `samples[k]`, column `columns[k]` of its completion."""

    samples: list[int]
    columns: list[int]


def pack(batch: Sequence[Sample], pad_id: int) -> PackedBatch:
    """`batch` as rows of shared prompts (every sample's trained tokens, in batch order of
    their groups)."""
    rows = _rows_by_prompt(batch)
    width = max(_row_tokens(batch, members) for members in rows)
    out = PackedBatch.padded(len(rows), width, pad_id, samples=[], columns=[])
    for row, members in enumerate(rows):
        prompt = batch[members[0]].prompt_ids
        start = out.write_prefix(row, prompt)
        for i in members:
            s = batch[i]
            end = out.write_member(row, start, len(prompt), s.completion_ids[:-1])
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


# -- sequences that share a prefix (the Tinker API's datums) ----------------------------------


@dataclass
class PackedSequences(PackedRows):
    """Sequences packed on their shared prefixes: sequence i's position j reads entry
    `reads[i][j]` (sequences sharing a prefix share its positions' entries where their
    targets agree)."""

    reads: list[list[int]]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# Sequences one packed row may hold: bounds the split's search (identical sequences add no
# tokens to a run, so nothing else would end it) at a row of ~16 groups of 16.
LONGEST_RUN = 256


def _rows_by_prefix(
    inputs: Sequence[Sequence[int]], token_budget: int | None = None
) -> list[tuple[int, list[int]]]:
    """(shared prefix length, member indices) per packed row, the rows computing the fewest
    tokens in all. Sorted, sequences with the longest common prefixes are neighbours, and a
    row is a run of them (its prefix the least of its neighbours' common prefixes): the
    best split into runs is found exactly (each run: the prefix once, then each member's
    rest; no run past `token_budget` unless it is one sequence). A greedy merge would join
    two groups on the chat template's opening and then repeat each group's prompt."""
    order = sorted(range(len(inputs)), key=lambda i: tuple(inputs[i]))
    lengths = [len(inputs[i]) for i in order]
    adjacent = [_common_prefix(inputs[a], inputs[b]) for a, b in itertools.pairwise(order)]
    fewest = [0.0] + [math.inf] * len(order)  # tokens of the best rows of the first j
    run_from = [0] * (len(order) + 1)
    for i in range(len(order)):
        total, shared = 0, lengths[i]
        for j in range(i + 1, len(order) + 1):  # the run order[i:j]
            total += lengths[j - 1]
            if j - i > 1:
                shared = min(shared, adjacent[j - 2])
            tokens = total - (j - i - 1) * shared
            if token_budget is not None and j - i > 1 and tokens > token_budget:
                break  # a longer run only adds tokens
            if j - i > LONGEST_RUN:
                break
            if fewest[i] + tokens < fewest[j]:
                fewest[j], run_from[j] = fewest[i] + tokens, i
    rows: list[tuple[int, list[int]]] = []
    j = len(order)
    while j > 0:
        i = run_from[j]
        members = order[i:j]
        shared = min([lengths[i], *adjacent[i : j - 1]])
        rows.append((shared, members))
        j = i
    return rows[::-1]


@dataclass
class PrefixRow:
    """Sequences (by index) to be one packed row, and that row's length."""

    members: list[int]
    tokens: int


def prefix_rows(inputs: Sequence[Sequence[int]], token_budget: int) -> list[PrefixRow]:
    """`inputs` grouped as `pack_sequences` packs them, each row within `token_budget` (or
    one sequence): what the micro-batching fills passes with, so that sequences sharing a
    prefix land in the same pass."""
    return [
        PrefixRow(members, _row_length(inputs, shared, members))
        for shared, members in _rows_by_prefix(inputs, token_budget)
    ]


def _row_length(inputs: Sequence[Sequence[int]], shared: int, members: list[int]) -> int:
    """A packed row's tokens: the shared prefix once, then each member's rest."""
    return shared + sum(len(inputs[m]) - shared for m in members)


def pack_sequences(
    inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pad_id: int
) -> PackedSequences:
    """`inputs` (each scored against its `targets`, one per position) as rows of shared
    prefixes: each row the prefix once, then each member's rest, attending to the prefix and
    to its own earlier tokens at the positions it would have alone, so every position sees
    what it would see in a row of its own."""
    rows = _rows_by_prefix(inputs)
    width = max(_row_length(inputs, shared, members) for shared, members in rows)
    out = PackedSequences.padded(len(rows), width, pad_id, reads=[[] for _ in inputs])
    entries: dict[tuple[int, int, int], int] = {}
    for row, (shared, members) in enumerate(rows):
        start = out.write_prefix(row, inputs[members[0]][:shared])
        for m in members:
            end = out.write_member(row, start, shared, inputs[m][shared:])
            for j, target in enumerate(targets[m]):
                key = (row, j if j < shared else start + j - shared, target)
                if key not in entries:
                    entries[key] = len(out.rows)
                    out.rows.append(key[0])
                    out.positions.append(key[1])
                    out.targets.append(key[2])
                out.reads[m].append(entries[key])
            start = end
    return out
