"""Following the learner's weight versions: check the checksum, load between batches, probe
parity, and say so on the job-events topic (`weights.loaded`, naming how the file came:
shared memory or HTTP, or `weights.refused`)."""

from __future__ import annotations

import asyncio
import logging

from rlnode.bus import Bus, Delivery
from rlnode.messages import JobEvent, JobEventType, WeightVersion
from rlnode.messages.jobs import WeightsLoadedData, WeightsRefusedData
from rlnode_services.rollout_generator.engines import EnginePool, Loaded, WeightsRefused
from rlnode_services.rollout_generator.settings import GeneratorSettings

log = logging.getLogger("rollout_generator.weights")


class WeightSync:
    def __init__(self, settings: GeneratorSettings, pool: EnginePool, bus: Bus) -> None:
        self.settings = settings
        self.pool = pool
        self.bus = bus
        self._changed = asyncio.Condition()
        # (job, version) refused once: its file and checksum do not change, so neither would
        # the answer; without this every rollout's catch-up retried it and reported it again.
        self._refused: set[tuple[str, int]] = set()

    async def wait_for(self, job_id: str, version: int, timeout_s: float) -> None:
        """Until the job's engine runs `version` or newer: work issued at version v must not be
        sampled from an older policy, or staleness would exceed the learner's max_async."""
        engines = self.pool.jobs.get(job_id)
        if engines is None or engines.loaded_version >= version:
            return
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: engines.loaded_version >= version)
        except TimeoutError:
            log.warning(
                "job %s: weights v%d did not arrive within %.0fs; sampling with v%d",
                job_id,
                version,
                timeout_s,
                engines.loaded_version,
            )

    async def on_weight_version(self, version: WeightVersion, _delivery: Delivery) -> None:
        latest = self.pool.latest.get(version.job_id)
        if latest is None or version.version > latest.version:
            self.pool.latest[version.job_id] = version
        if (
            version.job_id in self.pool.jobs
        ):  # else: loaded when this generator first serves the job
            await self._load(version)

    async def catch_up(self, job_id: str) -> None:
        """Before a rollout: load the newest version this generator has seen for the job."""
        latest = self.pool.latest.get(job_id)
        engines = self.pool.jobs.get(job_id)
        if latest is not None and engines is not None and latest.version > engines.loaded_version:
            await self._load(latest)

    async def _load(self, version: WeightVersion) -> None:
        engines = self.pool.jobs[version.job_id]
        key = (version.job_id, version.version)
        if version.version <= engines.loaded_version or key in self._refused:
            return
        generator = self.settings.generator_id
        try:
            loaded = await self.pool.load(engines, version)
        except WeightsRefused as e:
            if key in self._refused:
                return  # a concurrent attempt refused and reported it
            self._refused.add(key)
            log.warning("refused weights v%d of %s: %s", version.version, version.job_id, e)
            await self.bus.publish(
                JobEvent.of(
                    version.job_id,
                    version.org_id,
                    self.bus.service,
                    JobEventType.WEIGHTS_REFUSED,
                    f"generator {generator} refused weights v{version.version}: {e}",
                    WeightsRefusedData(version=version.version, generator=generator, reason=str(e)),
                )
            )
            return
        async with self._changed:
            self._changed.notify_all()
        if loaded is None:
            return  # someone else loaded it meanwhile
        ok = loaded.probe_max_abs_diff <= self.settings.parity_tolerance
        how = _how(loaded)
        log.info("job %s: loaded weights v%d %s", version.job_id, version.version, how)
        await self.bus.publish(
            JobEvent.of(
                version.job_id,
                version.org_id,
                self.bus.service,
                JobEventType.WEIGHTS_LOADED,
                f"generator {generator} loaded v{version.version} {how} in "
                f"{loaded.load_s:.3f}s; parity probe max |Δlogprob| "
                f"{loaded.probe_max_abs_diff:.2e} ({'ok' if ok else 'OVER tolerance'})",
                WeightsLoadedData(
                    version=version.version,
                    generator=generator,
                    load_s=loaded.load_s,
                    probe_max_abs_diff=loaded.probe_max_abs_diff,
                    probe_ok=ok,
                    transport=loaded.transport,
                    fetch_s=loaded.fetched.seconds if loaded.fetched else 0.0,
                    fetch_resumes=loaded.fetched.resumes if loaded.fetched else 0,
                    fetch_reused=loaded.fetched.reused if loaded.fetched else False,
                    paused_s=loaded.paused_s,
                ),
            )
        )


def _how(loaded: Loaded) -> str:
    """Which way the file came, for people: the event's message and the log."""
    fetched = loaded.fetched
    if fetched is None:
        return "from shared memory"
    if fetched.reused:
        return f"over HTTP (this host's copy, another generator's download; {fetched.seconds:.3f}s)"
    resumed = f", resumed {fetched.resumes}x" if fetched.resumes else ""
    return f"over HTTP (downloaded in {fetched.seconds:.3f}s{resumed})"
