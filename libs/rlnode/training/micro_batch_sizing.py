"""The token budget of the trainer's micro-batches, sized from its own passes.

A fixed budget is wrong one way or the other: too large and a pass runs out of memory, too
small and a GPU idles between passes; on the CPU every budget from 512 to 4096 runs SmolLM2
within 8% while the peak memory grows sixfold (bench B14). So the budget is measured:

- Memory: every pass counts the bytes its autograd graph saves for the backward pass (a
  saved-tensors hook; parameters left out) and, on a GPU, the allocator's peak. The largest
  bytes per token seen, against the memory at hand (a share of the GPU's free memory, or of
  the host's MemAvailable and cgroup limit on the CPU), caps the budget.
- Speed: a hill climb over powers of two below that cap. Each optimizer step runs at one
  budget and is timed (padded tokens through forward and backward per second); from `start`
  the next step doubles the budget while the doubled one proves fastest, then halves the
  fastest while a half is untried and wins, then the budget stays at the fastest. A budget
  takes the place of the best so far only when `MARGIN` faster.

A step whose passes were all much smaller than its budget (the whole step fits in half of it)
says nothing about a larger budget: the climb goes no higher. Over several ranks the
figures are combined (slowest rank, largest bytes, least memory) so every rank settles on the
same budget.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

MARGIN = 0.05  # a budget must be this much faster to be preferred (one step each is noisy)
FLOOR_TOKENS = 256
CEILING_TOKENS = 1 << 17
MEMORY_SHARE = 0.5  # of the memory at hand a micro-batch's activations may take

# sum and max over ranks, per value ("sum" or "max"); identity on one rank
Reduce = Callable[[list[float], tuple[str, ...]], list[float]]


@dataclass
class _Trial:
    tokens: float = 0.0
    seconds: float = 0.0
    largest_pass: int = 0


@dataclass
class MicroBatchSizer:
    """`budget` for the next passes; `measure(tokens)` around each pass (forward and
    backward); `step_done()` after each optimizer step. With `fixed` the budget never moves
    (what a job that names `tokens_per_micro_batch` gets)."""

    device: str
    fixed: int | None = None
    start: int = 1024
    reduce: Reduce = field(default=lambda values, _ops: values)
    memory_share: float = MEMORY_SHARE
    budget: int = field(init=False)
    settled: bool = field(init=False)
    bytes_per_token: float = field(init=False, default=0.0)
    speeds: dict[int, float] = field(init=False, default_factory=dict)
    _trial: _Trial = field(init=False, default_factory=_Trial)
    _parameters: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.budget = self.fixed or self.start
        self.settled = self.fixed is not None

    def exclude(self, parameters: Iterable[torch.Tensor]) -> None:
        """Tensors that exist whatever the pass (weights the graph saves): not counted."""
        local = (getattr(p, "_local_tensor", p) for p in parameters)  # a DTensor's shard
        self._parameters = {key[0] for key in map(_storage, local) if key is not None}

    @contextlib.contextmanager
    def measure(self, padded_tokens: int) -> Iterator[None]:
        """Times one pass of `padded_tokens` (rows x width) and counts its memory."""
        if self.settled:  # nothing left to learn: no hooks, no synchronisation
            yield
            return
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = _storage(tensor)
            if key is not None and key[0] not in self._parameters:
                saved[key[0]] = key[1]
            return tensor

        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        if cuda:
            torch.cuda.synchronize(self.device)
        self._trial.seconds += time.perf_counter() - started
        self._trial.tokens += padded_tokens
        self._trial.largest_pass = max(self._trial.largest_pass, padded_tokens)
        used = float(sum(saved.values()))
        if cuda:
            used = max(used, float(torch.cuda.max_memory_allocated(self.device) - before))
        self.bytes_per_token = max(self.bytes_per_token, used / max(padded_tokens, 1))

    def step_done(self) -> int:
        """Takes the step's measurement and picks the next budget; returns it."""
        if self.settled:
            return self.budget
        trial, self._trial = self._trial, _Trial()
        if trial.tokens == 0:
            return self.budget
        seconds, bytes_per_token, largest, negative_memory = self.reduce(
            [
                trial.seconds,
                self.bytes_per_token,
                float(trial.largest_pass),
                -memory_at_hand(self.device),
            ],
            ("max", "max", "max", "max"),
        )
        self.bytes_per_token = bytes_per_token
        self.speeds[self.budget] = trial.tokens / seconds if seconds > 0 else 0.0
        cap = self._cap(-negative_memory)
        best = self.best()
        up, down = best * 2, best // 2
        bound = largest > self.budget // 2  # a larger budget would have changed the passes
        if self.budget == best and up not in self.speeds and bound and up <= cap:
            self.budget = up
        elif FLOOR_TOKENS <= down <= cap and down not in self.speeds:
            self.budget = down
        else:
            self.budget, self.settled = min(best, cap), True
        return self.budget

    def best(self) -> int:
        """The fastest budget tried: the first one unless another was `MARGIN` faster."""
        tried = iter(self.speeds.items())
        best, speed = next(tried)
        for budget, other in tried:
            if other > speed * (1 + MARGIN):
                best, speed = budget, other
        return best

    def _cap(self, memory: float) -> int:
        if self.bytes_per_token <= 0:
            return CEILING_TOKENS
        fits = int(memory * self.memory_share / self.bytes_per_token)
        cap = FLOOR_TOKENS
        while cap * 2 <= min(fits, CEILING_TOKENS):
            cap *= 2
        return cap


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """A tensor's storage as (address, bytes); None for one without a storage of its own
    (a DTensor: its shard is counted where it is saved)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def memory_at_hand(device: str) -> float:
    """Bytes a pass may still use: the GPU's free memory (and what torch holds unused), or on
    the CPU the host's MemAvailable, bounded by the cgroup's limit less its use."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(device)
        return float(
            free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        )
    available = _meminfo_bytes("MemAvailable")
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, float(int(limit) - used))
    except (OSError, ValueError):
        pass
    return max(available, 0.0)


def _meminfo_bytes(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key}")
