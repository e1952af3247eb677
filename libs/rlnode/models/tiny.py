"""A tiny Llama-architecture model and a character-level tokenizer, built here (no download),
saved in Hugging Face format so the same code that loads real models loads it.

`rlnode model init --out DIR [--seed N]`. Deterministic for a given seed and size.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Printable ASCII without the whitespace other than space and newline.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer():
    """A character-level tokenizer: one token per character, plus chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(
        pattern="", behavior="isolated"
    )  # every character alone
    core.decoder = decoders.Fuse()  # join tokens back without spaces
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(
    vocab_size: int,
    seed: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 512,
):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("<|end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def init_tiny_model(
    out: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4
) -> Path:
    """Write the tiny model and its tokenizer to `out` (created); returns `out`."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed, hidden, layers, heads)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "rlnode-model.json").write_text(
        json.dumps(
            {"kind": "tiny", "seed": seed, "hidden": hidden, "layers": layers, "heads": heads},
            indent=2,
        )
        + "\n"
    )
    return out
