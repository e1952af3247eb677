"""The engines a generator holds: one per job (its base model, then the weight versions the
learner publishes: read where the learner wrote them, or downloaded from it by a generator
on another host), and a frozen reference copy when the reference is stacked here."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlnode.engine import Engine, EngineError, create_engine
from rlnode.messages import ModelSpec, WeightVersion
from rlnode.messages.config import LoraSpec
from rlnode.service.stores import path_in_job_store
from rlnode_services.rollout_generator.fetch import Fetched, FetchFailed, WeightsFetcher
from rlnode_services.rollout_generator.settings import GeneratorSettings

log = logging.getLogger("rollout_generator.engines")


class WeightsRefused(Exception):
    pass


@dataclass(frozen=True)
class Loaded:
    """A weight version loaded: in `load_s`, with the parity probe's max |diff|, from the
    learner's file or from a download (`fetched`)."""

    load_s: float
    probe_max_abs_diff: float
    fetched: Fetched | None = None
    paused_s: float = 0.0  # generation held back for it (see WeightsLoadedData)

    @property
    def transport(self) -> Literal["shared-memory", "http"]:
        return "http" if self.fetched is not None else "shared-memory"


@dataclass
class JobEngines:
    model: ModelSpec
    policy: Engine
    reference: Engine | None
    pending: WeightVersion | None = None
    loaded_version: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EnginePool:
    def __init__(self, settings: GeneratorSettings) -> None:
        self.settings = settings
        self.jobs: dict[str, JobEngines] = {}
        self._creating = asyncio.Lock()
        self.latest: dict[str, WeightVersion] = {}  # newest version seen per job, loaded or not
        # Downloads weight versions this host cannot see (None: no learner URL set).
        self.fetcher = WeightsFetcher(settings) if settings.weights_url is not None else None

    def create(self, model: ModelSpec, lora: LoraSpec | None = None) -> Engine:
        """An engine of this generator's kind for `model` (adapters up to `lora`'s rank)."""
        return self._create(model, False, lora)

    def _create(
        self, model: ModelSpec, reference: bool = False, lora: LoraSpec | None = None
    ) -> Engine:
        settings = self.settings
        options: dict[str, str | int | float | bool] = {
            "device": settings.device,
            "dtype": settings.dtype,
        }
        if settings.engine == "torch":
            options |= {
                "max_batch_size": settings.max_batch_size,
                "max_wait_ms": settings.max_wait_ms,
            }
        else:
            options |= {
                "tensor_parallel_size": settings.tensor_parallel,
                "max_batch_size": settings.max_batch_size,
                "gpu_memory_utilization": settings.reference_gpu_memory_fraction
                if reference
                else settings.gpu_memory_fraction,
                "cpu_kv_cache_mib": settings.cpu_kv_cache_mib,
                "enforce_eager": settings.enforce_eager,
                "swap": settings.vllm_swap,
            }
            # The job's own bound on a sequence: vLLM otherwise sizes for the model's longest
            # (SmolLM2's 8192 needs 0.35 GiB of KV cache, and the CPU's default is 0.25).
            options["max_model_len"] = settings.max_model_len or model.max_seq_len
            if lora is not None and not reference:  # the reference is the base, adapterless
                options["max_lora_rank"] = lora.rank
                options["lora_serving"] = settings.vllm_lora_serving
        return create_engine(settings.engine, model.source, **options)

    async def for_job(
        self, job_id: str, model: ModelSpec, lora: LoraSpec | None = None
    ) -> JobEngines:
        engines = self.jobs.get(job_id)
        if engines is not None:
            return engines
        async with self._creating:
            if job_id not in self.jobs:
                started = time.perf_counter()
                policy = await asyncio.to_thread(self._create, model, False, lora)
                reference = (
                    await asyncio.to_thread(self._create, model, True)
                    if self.settings.reference_on_inference
                    else None
                )
                self.jobs[job_id] = JobEngines(model, policy, reference)
                log.info(
                    "loaded %s for job %s in %.2fs",
                    model.source,
                    job_id,
                    time.perf_counter() - started,
                )
        return self.jobs[job_id]

    async def load(self, engines: JobEngines, version: WeightVersion) -> Loaded | None:
        """Check and load a weight version (downloaded first where this host cannot see its
        file and a learner URL is set); None if it, or a newer one, is loaded already."""
        async with engines.lock:
            if version.version <= engines.loaded_version:
                return None
            path, fetched = await self._weights_file(version)
            try:
                seconds = await engines.policy.load_weights(
                    path, version.version, version.blake3, adapter=version.adapter
                )
            except EngineError as e:
                if fetched is not None:
                    path.unlink(missing_ok=True)  # refused: nothing of it is kept
                raise WeightsRefused(str(e)) from None
            engines.loaded_version = version.version
            if self.fetcher is not None:
                await asyncio.to_thread(self.fetcher.discard_older, version)
            (recomputed,) = await engines.policy.score([version.probe.token_ids])
            diff = max(
                (abs(a - b) for a, b in zip(recomputed, version.probe.logprobs, strict=True)),
                default=0.0,
            )
            # vLLM says how long it paused; the torch engine holds its batches for the load.
            paused = getattr(engines.policy, "last_pause_s", seconds)
            return Loaded(seconds, diff, fetched, paused)

    async def _weights_file(self, version: WeightVersion) -> tuple[Path, Fetched | None]:
        """The file to load: the learner's where this host sees it (shared memory), else
        a download from the learner (GENERATOR_WEIGHTS_URL)."""
        path = path_in_job_store(
            version.uri, self.settings.node.stores, version.org_id, version.job_id
        )
        local = path is not None and path.is_file()
        if self.fetcher is not None and (self.settings.weights_fetch == "always" or not local):
            try:
                fetched = await self.fetcher.fetch(version)
            except FetchFailed as e:
                raise WeightsRefused(f"fetching it over HTTP failed: {e}") from None
            return fetched.path, fetched
        if path is None:
            raise WeightsRefused(
                f"{version.uri} is not in the node's stores under "
                f"{version.org_id}/{version.job_id}/: not this job's weights"
            )
        if not local:
            raise WeightsRefused(
                f"no weights file at {path} (a generator on another host than the learner "
                "downloads it: set GENERATOR_WEIGHTS_URL)"
            )
        return path, None

    async def release(self, job_id: str) -> None:
        """Close an ended job's engines (work still queued for it is skipped)."""
        self.latest.pop(job_id, None)
        engines = self.jobs.pop(job_id, None)
        if engines is None:
            return
        async with engines.lock:  # not while a weight version loads into them
            await engines.policy.close()
            if engines.reference is not None:
                await engines.reference.close()
            if self.fetcher is not None:
                await asyncio.to_thread(self.fetcher.discard_job, job_id)
        log.info("released the engines of ended job %s", job_id)

    def failures(self) -> dict[str, str]:
        return {
            f"{what} of job {job_id}": why
            for job_id, engines in self.jobs.items()
            for engine in (engines.policy, engines.reference)
            if engine is not None
            for what, why in engine.failures().items()
        }

    async def close(self) -> None:
        for engines in self.jobs.values():
            await engines.policy.close()
            if engines.reference is not None:
                await engines.reference.close()
        self.jobs.clear()
        if self.fetcher is not None:
            await asyncio.to_thread(self.fetcher.close)
