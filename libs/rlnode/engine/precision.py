"""Which dtype a CPU generates and trains in: bfloat16 where the cores compute it natively
(AMX or AVX512-BF16), float32 elsewhere, where bf16 is emulated and slower than fp32.

Measured on such a CPU: vLLM generates B9's step of 64 completions ~3x faster in bf16 than
in fp32 (2.5-2.8 s against 7.9-8.1 s); the trainer's passes on a bf16 copy of its weights
beside the fp32 masters (`TrainingSpec.weights_in_compute_dtype`) take 0.55x fp32's step and
0.81x bf16 autocast's (B16, bench/results/trainer_precision.md; autocast alone did not pay
inside the node: docs/decisions.md). With both, the whole job reaches B9's held-out target
in 0.32x TRL's time (0.43x with an fp32 trainer, 0.52x with fp32 generation too), to a final
accuracy above TRL's (bench/results/real_model.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# /proc/cpuinfo's names for the instructions that compute bf16 natively.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU computes bf16 natively (False where cpuinfo cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return not NATIVE_BF16_FLAGS.isdisjoint(value.split())
    return False


def cpu_generation_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The dtype rlnode's real-model runs give a vLLM generator on this CPU."""
    return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"


def cpu_training_precision(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The trainer's precision (TrainingSpec's fields) in rlnode's real-model runs on this
    CPU: bf16 passes on a bf16 copy of the weights where bf16 is native, fp32 elsewhere."""
    native = cpu_has_native_bf16(cpuinfo)
    return {
        "compute_dtype": "bfloat16" if native else "float32",
        "weights_in_compute_dtype": native,
    }


def resolved_dtype(dtype: str, device: str) -> str:
    """`dtype` with auto resolved as every engine and the learner do: bfloat16 on GPUs,
    float32 on the CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
