"""The trackers by name, each behind its library, which is an optional install."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from rlnode.messages import JobEvent


class TrackerUnavailable(RuntimeError):
    """The tracker's library is not installed (the message says how to install it)."""


def need(module: str, tracker: str, package: str) -> ModuleType:
    """`module`, or TrackerUnavailable saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerUnavailable(
            f"{tracker} needs {package} ({e}): pip install 'rlnode[trackers]' "
            f"(or pip install {package})"
        ) from None


class Tracker(Protocol):
    def log(self, event: JobEvent) -> None: ...

    def close(self) -> None: ...


def _tensorboard(job_id: str, out: str) -> Tracker:
    from rlnode.trackers.tensorboard import TensorBoardTracker

    return TensorBoardTracker(job_id, Path(out))


def _mlflow(job_id: str, out: str) -> Tracker:
    from rlnode.trackers.mlflow import MlflowTracker

    return MlflowTracker(job_id, out)


def _wandb(job_id: str, out: str, **options: str | None) -> Tracker:
    from rlnode.trackers.wandb import WandbTracker

    return WandbTracker(job_id, Path(out), **options)


# Each one's `out`: TensorBoard and W&B a directory runs go under; MLflow a tracking URI or
# a directory.
TRACKERS: dict[str, Callable[..., Tracker]] = {
    "tensorboard": _tensorboard,
    "mlflow": _mlflow,
    "wandb": _wandb,
}
# The library each one needs (what a node checks before it accepts a job naming it).
LIBRARIES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def open_tracker(name: str, job_id: str, out: str, **options: Any) -> Tracker:
    """The tracker `name` writing job `job_id`'s run at `out` (`options`: W&B's project,
    run_name and mode)."""
    if name not in TRACKERS:
        raise ValueError(f"no tracker {name!r}; choose one of {', '.join(sorted(TRACKERS))}")
    return TRACKERS[name](job_id, out, **options)


def installed(name: str) -> bool:
    return importlib.util.find_spec(LIBRARIES[name]) is not None
