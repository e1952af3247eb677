"""The generator's engines per job: created on a job's first work and closed when the job
ends (a generator that kept every ended job's engines ran out of memory after a few jobs)."""

from __future__ import annotations

import pytest

from rlnode.messages import ModelSpec
from rlnode.models.build import init_tiny_model
from rlnode_services.rollout_generator.engines import EnginePool
from rlnode_services.rollout_generator.settings import GeneratorSettings

pytestmark = pytest.mark.asyncio


async def test_an_ended_jobs_engines_are_closed_and_forgotten(tmp_path) -> None:
    model = init_tiny_model(tmp_path / "tiny", seed=0)
    pool = EnginePool(GeneratorSettings(engine="torch", device="cpu", dtype="float32"))
    spec = ModelSpec(source=str(model))
    first = await pool.for_job("job-a", spec)
    other = await pool.for_job("job-b", spec)
    assert await pool.for_job("job-a", spec) is first  # one set per job
    await pool.release("job-a")
    assert first.policy.closed and "job-a" not in pool.jobs
    assert not other.policy.closed  # the other job's engines go on
    await pool.release("job-a")  # an end read twice, or a job this generator never ran
    await pool.release("never-ran")
    await pool.close()
    assert other.policy.closed
