"""An engine that answers at once with fixed tokens: for measuring what the services cost
around generation (`make bench-control-plane`), never for training. Every completion is the
same few tokens with the same logprobs, so every rollout of a group earns the same reward and
the learner has nothing to train on: what remains is the control plane (broker, gateway,
Task App, generator, learner bookkeeping).

It has the model's real tokenizer (chat templates render as in a run) and no weights: a
weight version is taken as loaded; scores are zeros."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlnode.engine.base import FinishReason, GenerationRequest, GenerationResult, check_prompt
from rlnode.models.hf import load_tokenizer

# What every completion says (the copy task's alphabet), then the end of turn.
COMPLETION_TEXT = "abc"
LOGPROB = -1.0


class InstantEngine:
    def __init__(self, model_path: Path | str, **_options: Any) -> None:
        """`_options` (device, dtype, batch sizes) are accepted and ignored: there is no
        model to place."""
        self.model_path = Path(model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.vocab_size = len(self.tokenizer)
        self.policy_version = 0
        self.closed = False
        eos = self.tokenizer.eos_token_id
        text = list(self.tokenizer(COMPLETION_TEXT, add_special_tokens=False)["input_ids"])
        self._completion = text + ([eos] if eos is not None else [])

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        check_prompt(request.prompt_ids, self.vocab_size)
        ids = self._completion[: request.max_tokens]
        finish: FinishReason = "stop" if len(ids) == len(self._completion) else "length"
        return GenerationResult(ids, [LOGPROB] * len(ids), finish, self.policy_version)

    async def load_weights(
        self, path: Path, version: int, digest: str | None = None, adapter: object = None
    ) -> float:
        self.policy_version = version  # the generator checked the file is there
        return 0.0

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return [[0.0] * (len(s) - 1) for s in sequences]

    async def close(self) -> None:
        self.closed = True

    def failures(self) -> dict[str, str]:
        return {}
