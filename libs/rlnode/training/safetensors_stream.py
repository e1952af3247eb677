"""Write a safetensors file one tensor at a time, hashing the bytes as they are written.

The learner publishes weights this way: each tensor is produced (for a sharded model,
gathered from the ranks and cast to the engines' dtype) just before it is written, so the
peak is one tensor rather than the whole model, and the BLAKE3 digest a WeightVersion
carries comes from the same pass (no second read of the file). The format is safetensors' own: an 8-byte
little-endian header length, a JSON header of names, dtypes, shapes and byte offsets, then
the tensors' bytes in that order; `safetensors.safe_open` and vLLM read it as any other.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
}
# The header is padded with spaces to this alignment (as safetensors' own writer does), so
# that every tensor's bytes start aligned for readers that map the file.
_ALIGN = 8


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]  # called once, in file order, when it is written

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(
    path: Path, tensors: Iterable[TensorSpec], metadata: dict[str, str] | None = None
) -> tuple[str, int]:
    """Write `tensors` to `path` atomically (temporary name, fsync, rename); returns the
    file's BLAKE3 digest (hex) and size. Each tensor is produced, checked against its spec, written and
    hashed, then dropped."""
    specs = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPE_NAMES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be written")
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(len(encoded) + 8) % _ALIGN)
    digest = blake3.blake3()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as out:
            for chunk in (struct.pack("<Q", len(encoded)), encoded):
                out.write(chunk)
                digest.update(chunk)
            for spec in specs:
                tensor = spec.produce().detach().to("cpu", spec.dtype).contiguous()
                if tuple(tensor.shape) != spec.shape:
                    raise ValueError(
                        f"{spec.name}: produced {tuple(tensor.shape)}, declared {spec.shape}"
                    )
                raw: Any = tensor.view(torch.uint8).numpy()  # a view: no copy
                data = memoryview(raw).cast("B") if tensor.numel() else b""
                out.write(data)
                digest.update(data)
                del tensor, data
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # nothing partial is left behind
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return digest.hexdigest(), path.stat().st_size
