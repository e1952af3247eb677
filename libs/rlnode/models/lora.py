"""LoRA adapters as files: PEFT's layout (`adapter_config.json` beside
`adapter_model.safetensors`, tensors named `base_model.model.<module>.lora_A.weight`), the
config a reader needs, and merging an adapter into its base weights (the torch engine's way
to load one, and the checkpoint-server's merged download)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rlnode.messages.config import LoraSpec

if TYPE_CHECKING:  # tensors in, tensors out: whoever calls has torch loaded already
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(ValueError):
    pass


def peft_config(spec: LoraSpec, base: str | Path) -> dict[str, object]:
    """The adapter_config.json of `spec` on the base model at `base` (what PEFT and vLLM read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": sorted(spec.modules_to_save) or None,
    }


def write_adapter_dir(directory: Path, weights: Path, spec: LoraSpec, base: str | Path) -> Path:
    """A PEFT adapter directory for the adapter file `weights` (linked, not copied)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base), indent=2) + "\n")
    link = directory / ADAPTER_WEIGHTS
    link.unlink(missing_ok=True)
    link.symlink_to(Path(weights).resolve())
    return directory


def read_spec(directory: Path) -> tuple[LoraSpec, str]:
    """The LoRA spec and base model of a PEFT adapter directory."""
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
        targets = config["target_modules"]
        return (
            LoraSpec(
                rank=config["r"],
                alpha=config["lora_alpha"],
                dropout=config.get("lora_dropout", 0.0),
                target_modules=list(targets) if not isinstance(targets, str) else [targets],
                modules_to_save=list(config.get("modules_to_save") or []),
            ),
            str(config["base_model_name_or_path"]),
        )
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"{directory} is not a LoRA adapter directory: {e}") from None


def is_low_rank(name: str) -> bool:
    """A LoRA A or B tensor (the others of an adapter file are modules saved in full)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def adapted_modules(adapter_names: Iterable[str]) -> list[str]:
    """The base model's modules an adapter's tensors adapt (`model.layers.0.self_attn.q_proj`)."""
    modules = set()
    for name in adapter_names:
        if not name.startswith(PREFIX):
            raise AdapterError(
                f"{name!r} is not a LoRA adapter tensor (expected {PREFIX}<module>.lora_A.weight "
                f"or .lora_B.weight, or {PREFIX}<name> of a module saved in full)"
            )
        if is_low_rank(name):
            modules.add(name[len(PREFIX) :].rsplit(".lora_", 1)[0])
    return sorted(modules)


def saved_in_full(adapter_names: Iterable[str]) -> dict[str, str]:
    """{adapter file name: base model name} of the tensors saved in full (modules_to_save)."""
    return {
        n: n[len(PREFIX) :] for n in adapter_names if n.startswith(PREFIX) and not is_low_rank(n)
    }


def check_adapter_fits(
    adapter: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]], spec: LoraSpec
) -> list[str]:
    """Refuse (AdapterError) an adapter whose tensors do not fit the base model's layers or
    its rank, from shapes alone (names to shapes); returns the modules it adapts."""
    modules = adapted_modules(adapter)
    for name, base_name in saved_in_full(adapter).items():
        if base.get(base_name) != adapter[name]:
            raise AdapterError(
                f"{name} (saved in full) does not fit the model's {base_name}: "
                f"{adapter[name]} against {base.get(base_name)}"
            )
    for module in modules:
        a = adapter.get(f"{PREFIX}{module}.lora_A.weight")
        b = adapter.get(f"{PREFIX}{module}.lora_B.weight")
        weight = base.get(f"{module}.weight")
        if a is None or b is None:
            raise AdapterError(f"the adapter of {module} lacks its lora_A or lora_B tensor")
        if weight is None:
            raise AdapterError(f"the adapter adapts {module}, which the base model does not have")
        if len(a) != 2 or len(b) != 2 or (a[0], b[1]) != (spec.rank, spec.rank):
            raise AdapterError(f"the adapter of {module} is not of rank {spec.rank}: A {a}, B {b}")
        if (b[0], a[1]) != tuple(weight):
            raise AdapterError(
                f"the adapter of {module} does not fit its weight {tuple(weight)}: A {a}, B {b}"
            )
    return modules


def merged_weights(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], spec: LoraSpec
) -> dict[str, torch.Tensor]:
    """W + alpha/rank x B A for every adapted module's weight (computed in fp32, returned in
    the base's dtype) and the tensors saved in full: the changed tensors only, by their base
    names."""
    modules = check_adapter_fits(
        {k: tuple(v.shape) for k, v in adapter.items()},
        {k: tuple(v.shape) for k, v in base.items()},
        spec,
    )
    out = {}
    for module in modules:
        a = adapter[f"{PREFIX}{module}.lora_A.weight"]
        b = adapter[f"{PREFIX}{module}.lora_B.weight"]
        weight = base[f"{module}.weight"]
        delta = b.float() @ a.float() * spec.scale
        out[f"{module}.weight"] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    for name, base_name in saved_in_full(adapter).items():
        out[base_name] = adapter[name].to(base[base_name].dtype)
    return out
