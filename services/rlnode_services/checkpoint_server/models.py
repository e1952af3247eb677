"""Resolving `<job_id>@<step>`, `<job_id>@latest` and `<job_id>@best` (the checkpoint of the
job's best evaluation round) to a checkpoint of the caller's org, and
keeping loaded checkpoints in an LRU cache bounded by memory. A checkpoint loads on its first
request, into the same batched engine the rollout-generators use."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from rlnode.messages.config import LoraSpec
from rlnode.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    merged_weights,
    read_spec,
)
from rlnode_services.checkpoint_server.index import local_path
from rlnode_services.checkpoint_server.settings import CheckpointServerSettings
from rlnode_services.checkpoint_server.store import CheckpointRecord, EvalRecord

if TYPE_CHECKING:  # torch loads with the first checkpoint served, not with the service
    from rlnode.engine.torch_engine import TorchEngine

log = logging.getLogger("checkpoint_server.models")


class ModelProblem(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def parse_model(name: str | None) -> tuple[str, str]:
    if not name or "@" not in name:
        raise ModelProblem(
            400,
            f"model must be '<job_id>@<step>', '<job_id>@latest' or '<job_id>@best', not "
            f"{name!r}; "
            "GET /v1/models lists them",
        )
    job_id, _, which = name.rpartition("@")
    return job_id, which


class Checkpoints:
    def __init__(self, engine: Engine, root: Path) -> None:
        self.engine = engine
        self.root = root

    def of_job(self, org_id: str, job_id: str | None) -> list[CheckpointRecord]:
        with Session(self.engine) as s:
            query = select(CheckpointRecord).where(CheckpointRecord.org_id == org_id)
            if job_id is not None:
                query = query.where(CheckpointRecord.job_id == job_id)
            return list(
                s.exec(query.order_by(col(CheckpointRecord.job_id), col(CheckpointRecord.step)))
            )

    def resolve(self, org_id: str, model: str | None) -> tuple[CheckpointRecord, Path]:
        job_id, which = parse_model(model)
        available = self.of_job(org_id, job_id)
        if not available:
            raise ModelProblem(
                404,
                f"no checkpoints of job {job_id!r} in your org; GET /v1/models lists the models "
                "you can call",
                "not_found_error",
            )
        if which == "latest":
            record = available[-1]
        elif which == "best":
            record = self.best(org_id, job_id, available)
        else:
            try:
                step = int(which)
            except ValueError:
                raise ModelProblem(
                    400, f"{which!r} is neither a step number nor 'latest' or 'best'"
                ) from None
            found = next((r for r in available if r.step == step), None)
            if found is None:
                steps = ", ".join(str(r.step) for r in available)
                raise ModelProblem(
                    404,
                    f"job {job_id!r} has no checkpoint at step {step}; it has steps {steps} "
                    f"(or use {job_id}@latest)",
                    "not_found_error",
                )
            record = found
        path = local_path(record.uri, self.root, record.org_id, record.job_id)
        if path is None or not (
            (path / "config.json").exists() or (path / ADAPTER_CONFIG).exists()
        ):
            raise ModelProblem(
                410,
                f"checkpoint {record.model} is indexed but its files are gone from the "
                f"checkpoint store ({record.uri}); choose another step (GET /v1/checkpoints?job={job_id})",
                "not_found_error",
            )
        return record, path

    def evaluations(self, org_id: str, job_id: str) -> list[EvalRecord]:
        with Session(self.engine) as s:
            return list(
                s.exec(
                    select(EvalRecord)
                    .where(EvalRecord.org_id == org_id, EvalRecord.job_id == job_id)
                    .order_by(col(EvalRecord.step))
                )
            )

    def best(self, org_id: str, job_id: str, available: list[CheckpointRecord]) -> CheckpointRecord:
        """The checkpoint of the round with the highest mean reward (of equals, the later
        step: trained longer for the same score)."""
        steps = {r.step: r for r in available}
        rounds = [
            e
            for e in self.evaluations(org_id, job_id)
            if e.reward_mean is not None and e.step in steps
        ]
        if not rounds:
            raise ModelProblem(
                404,
                f"job {job_id!r} has no evaluated checkpoint yet: its [eval] section sets "
                f"when rounds run (GET /v1/jobs/{job_id}/evals lists them); use "
                f"{job_id}@latest or a step",
                "not_found_error",
            )
        best = max(rounds, key=lambda e: (e.reward_mean, e.step))
        return steps[best.step]


def adapter_of(path: Path, name: str) -> tuple[LoraSpec, Path] | None:
    """A LoRA checkpoint's adapter spec and base model directory (None: whole weights). The
    base is the job's model.source, which the learner checked when it took the job."""
    if not (path / ADAPTER_CONFIG).is_file():
        return None
    try:
        spec, base = read_spec(path)
    except AdapterError as e:
        raise ModelProblem(500, f"checkpoint {name}: {e}", "server_error") from None
    if not (Path(base) / "config.json").is_file():
        raise ModelProblem(
            410,
            f"checkpoint {name} holds LoRA adapters for the base model at {base}, which is no "
            "longer there; its adapter files can still be downloaded",
            "not_found_error",
        )
    return spec, Path(base)


def merge_checkpoint(path: Path, out: Path) -> Path:
    """The whole weights of a LoRA checkpoint (base + alpha/rank x B A), as one
    model.safetensors in `out` (written once, under a temporary name)."""
    from safetensors.torch import load_file, save_file

    target = out / "model.safetensors"
    if target.is_file():
        return target
    adapter = adapter_of(path, path.name)
    assert adapter is not None, "merge_checkpoint is for LoRA checkpoints"
    spec, base = adapter
    state: dict = {}
    for file in sorted(base.glob("*.safetensors")):
        state.update(load_file(str(file)))
    state.update(merged_weights(state, load_file(str(path / ADAPTER_WEIGHTS)), spec))
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "model.safetensors.partial"
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(partial), metadata={"format": "pt"}
    )
    partial.replace(target)
    return target


def _size_of(engine: TorchEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


class ModelCache:
    """Loaded engines by checkpoint, least recently used first; loading one that does not
    fit unloads others until it does (one alone may exceed the bound: it still serves)."""

    def __init__(self, settings: CheckpointServerSettings) -> None:
        self.settings = settings
        self.engines: OrderedDict[str, TorchEngine] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self.loads = 0

    @property
    def bytes_used(self) -> int:
        return sum(self.sizes.values())

    def failures(self) -> dict[str, str]:
        return {
            f"{what} of {key}": why
            for key, engine in self.engines.items()
            for what, why in engine.failures().items()
        }

    async def get(self, key: str, path: Path) -> TorchEngine:
        engine = self.engines.get(key)
        if engine is not None:
            self.engines.move_to_end(key)
            return engine
        task = self._loading.get(key)
        if task is None:  # concurrent first requests share one load
            task = asyncio.create_task(self._load(key, path))
            self._loading[key] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._loading.pop(key, None)

    async def _load(self, key: str, path: Path) -> TorchEngine:
        from rlnode.engine.torch_engine import TorchEngine

        adapter = adapter_of(path, key)
        try:
            # A LoRA checkpoint is served as its base with the adapters merged in.
            engine = await asyncio.to_thread(
                TorchEngine,
                adapter[1] if adapter else path,
                device=self.settings.device,
                dtype=self.settings.dtype,
                max_batch_size=self.settings.max_batch_size,
            )
            if adapter is not None:
                await engine.load_weights(path / ADAPTER_WEIGHTS, 0, adapter=adapter[0])
        except Exception as e:
            raise ModelProblem(
                500, f"checkpoint {key} could not be loaded: {e}", "server_error"
            ) from None
        size = _size_of(engine)
        while self.engines and self.bytes_used + size > self.settings.cache_bytes:
            old_key, old = self.engines.popitem(last=False)
            self.sizes.pop(old_key, None)
            log.info("unloading %s to make room for %s", old_key, key)
            await old.close()
        self.engines[key] = engine
        self.sizes[key] = size
        self.loads += 1
        log.info("loaded %s (%.1f MB)", key, size / 1e6)
        return engine

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.close()
        self.engines.clear()
        self.sizes.clear()
