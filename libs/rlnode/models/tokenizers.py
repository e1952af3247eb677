"""Tokenizers built here (no download), saved in Hugging Face format with the model.

- `char`: one token per printable character plus a few chat tokens. The copy task learns
  fastest with it (every letter is one action), so the demo keeps it.
- `bpe`: a byte-level BPE trained on a generated corpus with Qwen2's pre-tokenizer split,
  special tokens and ChatML template (`<|im_start|>role\\n...<|im_end|>\\n`), so
  tokenisation, multi-character tokens, stop tokens and multi-turn alignment behave as with
  Qwen. Deterministic: the corpus comes from a seeded generator and the trainer breaks
  ties by order.
"""

from __future__ import annotations

import random
import string
from typing import Any, Literal

TokenizerKind = Literal["char", "bpe"]

# -- char ------------------------------------------------------------------------------------

CHAR_SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Printable ASCII without the whitespace other than space and newline.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer() -> Any:
    """One token per character, plus chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(CHAR_SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens back without spaces
    core.add_special_tokens(CHAR_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    return tokenizer


# -- bpe -------------------------------------------------------------------------------------

BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation runs,
# newlines, spaces), applied before the byte-level mapping.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML, with tools as Qwen2.5 renders them: the tools' JSON in the system turn with how to
# call one (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), an assistant's calls
# in that form, and tool results as `<tool_response>` blocks in a user turn. Without tools it
# is plain ChatML, `<|im_start|>role\n...<|im_end|>\n` per message.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_HOWTO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHATML_TEMPLATE = (
    "{% set first = 1 if messages and messages[0]['role'] == 'system' else 0 %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if first %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + TOOLS_HOWTO.replace("\n", "\\n") + "<|im_end|>\n' }}"
    "{% elif first %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages[first:] %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_BPE_VOCAB = 4096

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "copy reward task answer question model token train step episode seed prompt letter "
    "string list value error result check score tool call number sum add plus minus equals "
    "yes right wrong again please thank hello world user assistant system json true false"
).split()


def bpe_corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    """Generated text the BPE is trained on: sentences from a fixed word list, copy-task
    lines, arithmetic, JSON and code-like lines. The same for a given seed everywhere."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    for i in range(lines):
        kind = i % 5
        if kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            words[0] = words[0].capitalize()
            out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
        elif kind == 1:
            text = "".join(
                rng.choice(letters[: rng.randint(3, 26)]) for _ in range(rng.randint(2, 12))
            )
            out.append(f"Copy: {text}\n{text}")
        elif kind == 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(f"{a} + {b} = {a + b}; {a} - {b} = {a - b}")
        elif kind == 3:
            key = rng.choice(_WORDS)
            out.append(f'{{"{key}": {rng.randint(0, 99)}, "ok": {rng.choice(["true", "false"])}}}')
        else:
            name = "_".join(rng.choice(_WORDS) for _ in range(2))
            out.append(
                f"def {name}(x):\n    return x * {rng.randint(2, 9)}  # {rng.choice(_WORDS)}"
            )
    return out


def bpe_tokenizer(vocab_size: int = DEFAULT_BPE_VOCAB, seed: int = 0) -> Any:
    """A byte-level BPE with Qwen2's split, special tokens and ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknowns
        show_progress=False,
    )
    core.train_from_iterator(bpe_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tokenizer(kind: TokenizerKind, vocab_size: int = DEFAULT_BPE_VOCAB) -> Any:
    if kind == "char":
        return char_tokenizer()
    if kind == "bpe":
        return bpe_tokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer {kind!r}: use 'char' or 'bpe'")
