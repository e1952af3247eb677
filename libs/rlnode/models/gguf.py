"""GGUF files (llama.cpp's format) in as Hugging Face directories, by transformers' own
GGUF loader, once per file.

A GGUF holds the weights (often block-quantized: Q4_1 stores 32 weights as 4-bit codes with
one fp16 scale and one fp16 minimum), the tokenizer, its chat template and the special
tokens. Every engine and the trainer load Hugging Face directories, so a GGUF is
dequantized once into one: `from_pretrained(gguf_file=..., dequantize=True)` unpacks each
block to `scale * code + min` (exact in float32, so the fp32 import computes what the file
encodes), the quantization entry leaves the config (transformers refuses to save a model
that says it is quantized), and the weights, tokenizer, chat template and generation
config are saved in the stated dtype. The directory is named by the file's BLAKE3 digest and
the dtype, so the same file is converted once however often a job names it, and written
under a temporary name and renamed, so a half-written import is never loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3

GGUF_MAGIC = b"GGUF"
ImportDtype = Literal["float32", "bfloat16", "float16"]
IMPORT_DTYPES: tuple[ImportDtype, ...] = ("float32", "bfloat16", "float16")
# The record an import leaves in its directory (and the mark of a finished one).
IMPORT_RECORD = "rlnode-model.json"
# Unquantized tensor types: stored as they are (in the chosen dtype).
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# Architectures transformers' GGUF loader maps that are decoder-only language models (its
# table also has encoder-decoders, which rlnode's engines do not run).
NOT_CAUSAL = frozenset({"general", "tokenizer", "t5", "umt5"})
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class GgufError(ValueError):
    """A file that cannot be imported; the message says what is wrong with it and what to do."""


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    architecture: str
    name: str
    quantizations: dict[str, int]  # tensor type -> how many tensors of it
    tensors: int
    parameters: int
    bytes: int


@dataclass(frozen=True)
class ImportedModel:
    path: Path
    blake3: str
    dtype: ImportDtype
    reused: bool  # this file was converted before; nothing was written now
    seconds: float


def is_gguf_file(source: str | Path) -> bool:
    """True when `source` is a file on this machine that starts as a GGUF does."""
    path = Path(source).expanduser()
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def supported_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_CAUSAL)


def supported_quantizations() -> list[str]:
    """The tensor types the `gguf` package can dequantize (and so transformers can load)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    unpackable = {t.name for t in _type_traits} | FLOAT_TYPES
    return [t.name for t in GGMLQuantizationType if t.name in unpackable]


def inspect_gguf(path: Path) -> GgufInfo:
    """Read a GGUF's header (no weights): its architecture and tensor types, checked against
    what can be imported."""
    path = path.expanduser()
    if not path.is_file():
        raise GgufError(f"{path} is not a file")
    if not is_gguf_file(path):
        raise GgufError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GgufError(
            "importing a GGUF needs the gguf and accelerate packages: pip install 'rlnode[models]'"
        ) from None
    try:
        reader = GGUFReader(path)
        architecture = _field_text(reader, "general.architecture")
        name = _field_text(reader, "general.name") or path.stem
        types = Counter(t.tensor_type.name for t in reader.tensors)
        parameters = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as e:  # the parser meets a damaged file with whatever fails first
        raise GgufError(f"{path} could not be read as GGUF ({type(e).__name__}: {e})") from None
    info = GgufInfo(
        path, architecture, name, dict(types), len(reader.tensors), parameters, path.stat().st_size
    )
    archs = supported_architectures()
    if architecture not in archs:
        raise GgufError(
            f"{path.name} holds a {architecture or 'unnamed'!r} model; GGUF imports support the "
            f"decoder-only architectures transformers maps: {', '.join(archs)}"
        )
    unsupported = sorted(set(types) - set(supported_quantizations()))
    if unsupported:
        raise GgufError(
            f"{path.name} has tensors of type {', '.join(unsupported)}, which cannot be "
            f"dequantized here; supported: {', '.join(supported_quantizations())}"
        )
    return info


def _field_text(reader: object, key: str) -> str:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def file_digest(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(path)
    return hasher.hexdigest()


def import_dir_name(info: GgufInfo, digest: str, dtype: ImportDtype) -> str:
    return f"{_UNSAFE.sub('-', info.path.stem)}-{digest[:16]}-{dtype}"


def import_gguf(path: Path, store: Path, dtype: ImportDtype = "float32") -> ImportedModel:
    """The Hugging Face directory of `path` in the model store `store`: converted now, or
    found from an earlier conversion of the same file (same BLAKE3 digest) to `dtype`."""
    if dtype not in IMPORT_DTYPES:
        raise GgufError(f"dtype {dtype!r} is not one of {', '.join(IMPORT_DTYPES)}")
    started = time.perf_counter()
    path = path.expanduser().resolve()
    info = inspect_gguf(path)
    digest = file_digest(path)
    target = store / import_dir_name(info, digest, dtype)
    if (target / IMPORT_RECORD).is_file():
        return ImportedModel(target, digest, dtype, True, time.perf_counter() - started)
    store.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        parameters = _convert(path, temporary, dtype)
        record = {
            "source": "gguf",
            "gguf_file": path.name,
            "blake3": digest,
            "name": info.name,
            "architecture": info.architecture,
            "quantizations": info.quantizations,
            "dtype": dtype,
            "parameters": parameters,
            "seconds": round(time.perf_counter() - started, 2),
        }
        (temporary / IMPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        try:
            temporary.rename(target)
        except OSError:
            if not (target / IMPORT_RECORD).is_file():
                raise
            # Another process imported the same file meanwhile: its directory serves.
            shutil.rmtree(temporary, ignore_errors=True)
            return ImportedModel(target, digest, dtype, True, time.perf_counter() - started)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return ImportedModel(target, digest, dtype, False, time.perf_counter() - started)


def _convert(path: Path, out: Path, dtype: ImportDtype) -> int:
    """Dequantize `path` into the HF directory `out`; returns the parameter count."""
    import torch
    from transformers import GgufConfig

    from rlnode.models.hf import load_causal_lm, load_tokenizer

    directory, name = str(path.parent), path.name
    tokenizer = load_tokenizer(directory, gguf_file=name)
    model = load_causal_lm(
        directory,
        gguf_file=name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    # Dense now: the entry that says "quantized" goes, or save_pretrained refuses.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = path.stem
    generation = model.generation_config
    generation.bos_token_id = tokenizer.bos_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for written in out.iterdir():  # the store is read by every service of the node
        written.chmod(0o644)
    return sum(p.numel() for p in model.parameters())
