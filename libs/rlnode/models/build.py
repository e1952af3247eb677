"""Models built here with random weights (no download), saved in Hugging Face format so the
same code that loads real models loads them.

`rlnode model init --out DIR [--preset NAME] [--seed N] [--hidden ...]`. A preset names an
architecture, a shape and a tokenizer:

- `tiny` (the demo's and most tests'): Llama, hidden 64, 2 layers, 4 heads of 16, the
  character tokenizer. The torch engine only: vLLM's CPU attention refuses head_dim 16.
- `tiny-llama`: Llama, hidden 128, 2 heads of 64, character tokenizer (vLLM runs it).
- `tiny-qwen2`: Qwen2 (q/k/v biases, grouped-query attention 4 heads on 2 KV heads of 64),
  byte-level BPE with ChatML: tokenisation as with Qwen, small enough for CPU tests.
- `small-qwen2`: the same shape family at ~30M parameters, for generation-bound benchmarks.
- `qwen2.5-0.5b`, `qwen2.5-7b`: the published shapes (vocab 151,936 / 152,064) with random
  weights and the BPE tokenizer, for memory and weight-sync measurements. Their vocab is
  larger than the tokenizer's, as Qwen's own is.
Deterministic for a given preset, overrides and seed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rlnode.models.tokenizers import TokenizerKind, build_tokenizer

Architecture = Literal["llama", "qwen2"]


@dataclass(frozen=True)
class ModelShape:
    architecture: Architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tokenizer: TokenizerKind
    vocab: int | None = None  # None: the tokenizer's size
    tie_embeddings: bool = True
    max_positions: int = 512
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape("llama", 64, 2, 4, 4, 256, "char"),
    "tiny-llama": ModelShape("llama", 128, 2, 2, 2, 512, "char"),
    "tiny-qwen2": ModelShape("qwen2", 256, 2, 4, 2, 768, "bpe", max_positions=1024),
    "small-qwen2": ModelShape("qwen2", 512, 8, 8, 2, 1536, "bpe", max_positions=2048),
    "qwen2.5-0.5b": ModelShape(
        "qwen2", 896, 24, 14, 2, 4864, "bpe", 151_936, True, 32_768, 1_000_000.0
    ),
    "qwen2.5-7b": ModelShape(
        "qwen2", 3584, 28, 28, 4, 18_944, "bpe", 152_064, False, 32_768, 1_000_000.0
    ),
}


def shape_of(preset: str, **overrides: Any) -> ModelShape:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    shape = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    shape.check()
    return shape


def build_model(shape: ModelShape, vocab_size: int, special_ids: dict[str, int], seed: int) -> Any:
    """A randomly initialised causal LM of this shape (float32, eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": shape.tie_embeddings,
        "rope_theta": shape.rope_theta,
        "dtype": "float32",
        **special_ids,
    }
    torch.manual_seed(seed)
    model: Any
    if shape.architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(rms_norm_eps=1e-6, **common))
    model.eval()
    return model


def init_model(out: Path, preset: str = "tiny", seed: int = 0, **overrides: Any) -> Path:
    """Write a model of `preset` (with `overrides` of its shape fields) and its tokenizer to
    `out` (created); returns `out`."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shape = shape_of(preset, **overrides)
    tokenizer = build_tokenizer(shape.tokenizer)
    vocab = shape.vocab or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    special = {
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    model = build_model(shape, vocab, special, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    (out / "rlnode-model.json").write_text(
        json.dumps({"preset": preset, "seed": seed, "parameters": parameters, **asdict(shape)})
        + "\n"
    )
    return out


def init_tiny_model(
    out: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4
) -> Path:
    """The demo's model: the `tiny` preset, optionally resized (kept for its many callers)."""
    return init_model(
        out,
        "tiny",
        seed,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=heads,
        intermediate=hidden * 4,
    )
