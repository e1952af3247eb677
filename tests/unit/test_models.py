"""The locally built models: presets with the published shapes, the byte-level BPE
tokenizer with ChatML, determinism, and the CLI's errors."""

from __future__ import annotations

import pytest
import torch

from rlnode.cli import main as cli
from rlnode.models.build import PRESETS, build_model, init_model, shape_of
from rlnode.models.tokenizers import bpe_tokenizer


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("qwen") / "m", "tiny-qwen2", seed=0)


def test_the_bpe_tokenizer_is_deterministic_and_round_trips() -> None:
    a, b = bpe_tokenizer(), bpe_tokenizer()
    assert a.get_vocab() == b.get_vocab() and len(a) == 4096
    for text in ["Copy: abcab", "Hello world, 12 + 34 = 46!", "ünïcödé ✓ 漢字", "  two  spaces\n"]:
        ids = a(text)["input_ids"]
        assert a.decode(ids) == text  # byte-level: nothing is unknown
    ids = a("the model answer")["input_ids"]
    assert len(ids) < len("the model answer") / 2  # multi-character tokens
    assert all(len(a.decode([i])) > 1 for i in ids)


def test_the_bpe_chat_template_is_chatml(qwen_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    messages = [{"role": "user", "content": "Copy: abc"}, {"role": "assistant", "content": "abc"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nCopy: abc<|im_end|>\n<|im_start|>assistant\nabc<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer(text)["input_ids"].count(im_start) == 3  # special tokens stay whole


def test_a_preset_model_is_deterministic_and_loads_with_transformers(tmp_path, qwen_dir) -> None:
    from transformers import AutoModelForCausalLM

    again = init_model(tmp_path / "again", "tiny-qwen2", seed=0)
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (qwen_dir / weights).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    assert model.config.model_type == "qwen2"
    config = model.config
    assert config.num_key_value_heads == 2
    assert config.hidden_size // config.num_attention_heads == 64


@pytest.mark.parametrize(
    ("preset", "published"),
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512)],
)
def test_real_model_presets_have_the_published_parameter_count(preset, published) -> None:
    shape = shape_of(preset)
    special = {"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": None}
    with torch.device("meta"):  # shapes only: no memory for the weights
        model = build_model(shape, shape.vocab or 0, special, seed=0)
    assert sum(p.numel() for p in model.parameters()) == published


def test_every_preset_has_a_head_dim_vllm_accepts_except_tiny() -> None:
    for name, shape in PRESETS.items():
        assert shape.head_dim % 64 == 0 or name == "tiny", name


def test_model_init_on_the_command_line(tmp_path, capsys) -> None:
    assert (
        cli(
            [
                "model",
                "init",
                "--out",
                str(tmp_path / "m"),
                "--preset",
                "tiny-qwen2",
                "--layers",
                "1",
            ]
        )
        == 0
    )
    assert "qwen2 model" in capsys.readouterr().out
    assert cli(["model", "init", "--out", str(tmp_path / "bad"), "--heads", "5"]) == 2
    assert "not a multiple of heads 5" in capsys.readouterr().err


def test_streamed_safetensors_read_back_by_safetensors_and_mapped_without_a_copy(tmp_path) -> None:
    import blake3
    from safetensors.torch import load_file

    from rlnode.models.safetensors_io import MappedSafetensors, TensorSpec, write_safetensors

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6).reshape(2, 3),
        "empty": torch.zeros(0, 4),
    }
    specs = [TensorSpec(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    digest, size = write_safetensors(tmp_path / "w.safetensors", specs)
    data = (tmp_path / "w.safetensors").read_bytes()
    assert digest == blake3.blake3(data).hexdigest() and size == len(data)
    for reader in (load_file(str(tmp_path / "w.safetensors")),):
        assert all(torch.equal(reader[k], v) for k, v in tensors.items())
    with MappedSafetensors(tmp_path / "w.safetensors") as mapped:
        assert blake3.blake3(mapped.buffer).hexdigest() == digest
        assert all(torch.equal(mapped.tensors()[k], v) for k, v in tensors.items())


def test_a_failed_write_leaves_nothing_behind(tmp_path) -> None:
    from rlnode.models.safetensors_io import TensorSpec, write_safetensors

    def broken() -> torch.Tensor:
        raise RuntimeError("a rank went away")

    specs = [
        TensorSpec("a", (2,), torch.float32, lambda: torch.ones(2)),
        TensorSpec("b", (2,), torch.float32, broken),
    ]
    with pytest.raises(RuntimeError, match="went away"):
        write_safetensors(tmp_path / "w.safetensors", specs)
    assert list(tmp_path.iterdir()) == []
    wrong = [TensorSpec("a", (3,), torch.float32, lambda: torch.ones(2))]
    with pytest.raises(ValueError, match="declared"):
        write_safetensors(tmp_path / "w.safetensors", wrong)
    assert list(tmp_path.iterdir()) == []


def test_models_load_from_several_threads_at_once(tmp_path) -> None:
    """Two jobs starting together load their models in two threads: transformers alone
    fails that (a lazily imported name missing, meta tensors), rlnode.models.hf makes them
    take turns. A fresh interpreter, so that transformers is imported by the threads."""
    import subprocess
    import sys

    from rlnode.models.build import init_tiny_model

    model = init_tiny_model(tmp_path / "tiny", seed=0)
    script = (
        "import sys, threading\n"
        "from rlnode.engine.torch_engine import TorchEngine\n"
        "errors = []\n"
        "def load(build):\n"
        "    try:\n"
        "        build()\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "threads = [threading.Thread(target=load, args=(lambda: TorchEngine(sys.argv[1]),))\n"
        "           for _ in range(3)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "print(errors)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
