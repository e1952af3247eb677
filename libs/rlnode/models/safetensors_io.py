"""Write a safetensors file one tensor at a time, hashing the bytes as they are written; map
one back as tensors that are views of the file (no copy).

The learner publishes weights this way: each tensor is produced (for a sharded model,
gathered from the ranks and cast to the engines' dtype) just before it is written, so the
peak is one tensor rather than the whole model, and the BLAKE3 digest a WeightVersion
carries comes from the same pass (no second read of the file). The format is safetensors' own: an 8-byte
little-endian header length, a JSON header of names, dtypes, shapes and byte offsets, then
the tensors' bytes in that order; `safetensors.safe_open` and vLLM read it as any other.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

DTYPES_BY_NAME = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}
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
        return math.prod(self.shape) * self.dtype.itemsize


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
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
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


class MappedSafetensors:
    """A safetensors file mapped into memory (copy-on-write, so nothing is written back):
    `tensors` are views of the mapping, `buffer` is the whole file for hashing. Reading
    either touches the file's pages once; on /dev/shm they are memory already. Use as a
    context manager: the views are invalid once it closes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "rb")  # closed in close()
        try:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self._file.close()
            raise
        self.buffer = memoryview(self._map)

    def tensors(self) -> dict[str, torch.Tensor]:
        (length,) = struct.unpack("<Q", self.buffer[:8])
        header = json.loads(bytes(self.buffer[8 : 8 + length]))
        start = 8 + length
        out: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES_BY_NAME.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{self.path.name}: {name} has dtype {entry['dtype']}")
            begin, end = entry["data_offsets"]
            if end == begin:  # frombuffer refuses a count of 0
                out[name] = torch.empty(entry["shape"], dtype=dtype)
                continue
            flat = torch.frombuffer(
                self._map, dtype=torch.uint8, count=end - begin, offset=start + begin
            )
            out[name] = flat.view(dtype).view(entry["shape"])
        return out

    def close(self) -> None:
        self.buffer.release()
        self._map.close()
        self._file.close()

    def __enter__(self) -> MappedSafetensors:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
