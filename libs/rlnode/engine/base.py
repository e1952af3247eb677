"""The inference engine interface the rollout-generator (and the checkpoint-server) use.
Two implementations: `TorchEngine` (transformers, CPU or GPU) and `VLLMEngine` (vLLM's CUDA
build on GPUs, its CPU build elsewhere); tests/engine_conformance holds both to this contract.

A sampled token's logprob is its log-probability in the distribution it was drawn from:
log-softmax of logits / temperature, renormalised over the top-p nucleus when top_p < 1
(vLLM's "processed" logprobs; temperature 0 means greedy, scored at temperature 1). With
top_p 1, the RL default, that is exactly what the learner computes, so the importance
ratio is 1 when the weights are equal. `score` gives prompt logprobs at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import blake3

from rlnode.messages.config import LoraSpec
from rlnode.models import TIED_OUTPUT


class EngineError(RuntimeError):
    pass


class BadPrompt(EngineError):
    """The request is at fault (the caller gets 400), not the engine."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_k: int = -1  # the k most likely tokens only (-1: all)
    seed: int | None = None  # the same seed and prompt sample the same completion


FinishReason = Literal["stop", "length"]


@dataclass
class GenerationResult:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int  # the weights its first token was sampled under
    # The weights its last token was sampled under, when a newer version went in while it
    # was generated (vLLM's in-flight swap); each logprob is that of the weights its token
    # was sampled under.
    last_policy_version: int | None = None


class Engine(Protocol):
    tokenizer: Any
    vocab_size: int  # token ids a prompt may hold: 0 .. vocab_size - 1
    policy_version: int
    model_path: Path
    closed: bool

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Sample a completion; concurrent calls are batched together."""

    async def load_weights(
        self,
        path: Path,
        version: int,
        digest: str | None = None,
        adapter: LoraSpec | None = None,
    ) -> float:
        """Load a safetensors state dict between batches (never during one); returns the
        seconds it took. Requests after it see `version`. Given `digest` (BLAKE3, hex), a file
        whose bytes hash otherwise is refused (EngineError) and nothing is loaded. Given
        `adapter`, the file holds LoRA adapters for the base model (rlnode.models.lora):
        they replace the last version's adapters (vLLM serves them as an adapter, the torch
        engine merges them into the base weights)."""

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """For each sequence, the logprob of every token after the first given those before
        it (temperature 1)."""

    async def close(self) -> None: ...

    def failures(self) -> dict[str, str]:
        """{what: why} for the engine's background work that is down (its service's /health
        answers 503 naming it); empty while it works."""


def check_prompt(prompt_ids: list[int], vocab_size: int) -> None:
    """Refuse a prompt the model cannot embed before it joins a batch: one bad request must
    fail alone, not the requests batched with it."""
    if not prompt_ids:
        raise BadPrompt("empty prompt")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise BadPrompt(
            f"token id {bad} is outside this model's vocabulary (ids 0 to {vocab_size - 1})"
        )


def check_weights_fit(
    expected: dict[str, tuple[int, ...]], offered: dict[str, tuple[int, ...]]
) -> None:
    """Refuse weights whose tensor names or shapes differ from the model's, before any reaches
    the engine (a wrong shape inside vLLM's reload takes its worker down)."""
    missing = sorted(k for k in expected.keys() - offered.keys() if k != TIED_OUTPUT)
    unexpected = sorted(k for k in offered.keys() - expected.keys() if k != TIED_OUTPUT)
    reshaped = sorted(k for k in expected.keys() & offered.keys() if expected[k] != offered[k])
    if missing or unexpected or reshaped:
        raise EngineError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"other shapes {reshaped[:5]}"
        )


def check_digest(path: Path, data: Any, expected: str | None) -> None:
    """Refuse weights whose BLAKE3 digest is not the one published: of `data` (the file's
    bytes, e.g. its mapping) or, given None, of the file read in blocks."""
    if expected is None:
        return
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if data is not None:
        digest.update(data)
    else:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    actual = digest.hexdigest()
    if actual != expected:
        raise EngineError(
            f"the BLAKE3 digest of {path.name} is {actual[:16]}…, the WeightVersion says "
            f"{expected[:16]}…"
        )


def cut_at_stop(text: str, stop: list[str]) -> str:
    """OpenAI semantics: the text ends before the first stop string."""
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt token ids for chat messages (and the tools offered), by the model's own chat
    template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise EngineError(
            "this model's tokenizer has no chat template; use /v1/completions with a prompt"
        )
    if tools and "tools" not in str(template):
        # A template that never reads `tools` would drop them without a word.
        raise EngineError(
            "this model's chat template does not render tools: call without `tools`, or "
            "train a model whose template shows them (e.g. Qwen2.5's, or rlnode model init "
            "--preset tiny-qwen2)"
        )
    ids = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
