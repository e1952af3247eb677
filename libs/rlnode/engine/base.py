"""The inference engine interface the rollout-generator (and the checkpoint-server) use.
Two implementations: `TorchEngine` (CPU or GPU, the default) and `VLLMEngine` (GPU).

Logprobs, everywhere in rlnode, are log-softmax of logits / temperature: the distribution
the token was sampled from, before top-p truncation (temperature 0 means greedy, scored at
temperature 1). The learner computes the same quantity, so the importance ratio is 1 when
the weights are equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol


class EngineError(RuntimeError):
    pass


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)


FinishReason = Literal["stop", "length"]


@dataclass
class GenerationResult:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int


class Engine(Protocol):
    tokenizer: Any
    policy_version: int
    model_path: Path

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Sample a completion; concurrent calls are batched together."""

    async def load_weights(self, path: Path, version: int) -> float:
        """Load a safetensors state dict between batches (never during one); returns the
        seconds it took. Requests after it see `version`."""

    async def score(
        self, sequences: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """For each sequence, the logprob of every token after the first given those before it."""

    async def close(self) -> None: ...


def cut_at_stop(text: str, stop: list[str]) -> str:
    """OpenAI semantics: the text ends before the first stop string."""
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Prompt token ids for chat messages, by the model's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise EngineError(
            "this model's tokenizer has no chat template; use /v1/completions with a prompt"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
