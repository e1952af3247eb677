"""Examples installed with rlnode: Task Apps (`taskapps/`) and job configs (`jobs/`). The node
registers them as managed Task Apps and the demo, the benchmarks and the tests start their
jobs from these configs, so they ship as package data rather than living beside the code."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlnode.messages import JobConfig

HERE = Path(__file__).resolve().parent


def task_app_path(name: str) -> Path:
    """The file of example Task App `name` (e.g. "copy_task")."""
    path = HERE / "taskapps" / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in (HERE / "taskapps").glob("*.py") if p.stem != "__init__")
        raise FileNotFoundError(f"no example Task App {name!r}; there are {', '.join(known)}")
    return path


def job_config_path(name: str) -> Path:
    """The file of example job config `name` (e.g. "copy_task")."""
    path = HERE / "jobs" / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in (HERE / "jobs").glob("*.toml"))
        raise FileNotFoundError(f"no example job config {name!r}; there are {', '.join(known)}")
    return path


def example_job(name: str, model: Path | str, **training: Any) -> JobConfig:
    """Example job config `name` on the model at `model`, with the given `training` fields
    replaced (e.g. `steps=100, max_async=0, optimizer={"lr": 1e-3}`)."""
    from rlnode.sdk.jobs import load_config

    config = load_config(job_config_path(name))
    return config.model_copy(
        update={
            "model": config.model.model_copy(update={"source": str(model)}),
            "training": config.training.model_validate(
                _merged(config.training.model_dump(), training)
            ),
        }
    )


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes`, section by section: `optimizer={"lr": 1e-3}` keeps the file's
    other optimizer settings."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out
