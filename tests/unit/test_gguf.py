"""GGUF files that cannot be imported are refused before anything is written, saying why
(rlnode.models.gguf); GGUFs written here with the `gguf` package's own writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlnode.models.gguf import GgufError, import_gguf, inspect_gguf, is_gguf_file


def _write_gguf(path: Path, architecture: str) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, architecture)
    writer.add_name("made-here")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_header_is_read_without_the_weights(tmp_path: Path) -> None:
    info = inspect_gguf(_write_gguf(tmp_path / "m.gguf", "llama"))
    assert (info.architecture, info.name, info.quantizations) == ("llama", "made-here", {"F32": 1})
    assert info.parameters == 32
    assert is_gguf_file(info.path)


def test_an_architecture_the_engines_do_not_run_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bert.gguf", "bert")
    with pytest.raises(GgufError, match=r"holds a 'bert' model; .*llama.*qwen2"):
        import_gguf(path, tmp_path / "store")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"not": "a model"}', "is not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00garbage", "could not be read as GGUF"),
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, "could not be read as GGUF"),
    ],
)
def test_a_file_that_is_not_a_whole_gguf_is_refused(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=message):
        import_gguf(path, tmp_path / "store")


def test_a_missing_file_and_an_unknown_dtype_are_refused(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="is not a file"):
        inspect_gguf(tmp_path / "nowhere.gguf")
    path = _write_gguf(tmp_path / "m.gguf", "llama")
    with pytest.raises(GgufError, match="dtype 'int8' is not one of float32"):
        import_gguf(path, tmp_path / "store", "int8")  # type: ignore[arg-type]
