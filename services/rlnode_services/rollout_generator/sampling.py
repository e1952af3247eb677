"""Sampling for the Tinker API: completions of a prompt from one weight version of a run
(or the base model), as the tinker-api asks (`POST /v1/tinker/sample`, its service token).

Each (run, version) is served by an engine of its own, loaded with that version's weights
and kept, least recently used first out, up to GENERATOR_TINKER_SAMPLERS: a sampling
session keeps answering from its snapshot while the run trains on."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from rlnode.engine.base import Engine, EngineError, GenerationRequest
from rlnode.messages import ModelSpec
from rlnode.messages.tinker import SampledSequence, SampleRequest, SampleResult
from rlnode.service.stores import path_in_job_store
from rlnode_services.rollout_generator.engines import EnginePool
from rlnode_services.rollout_generator.settings import GeneratorSettings

log = logging.getLogger("rollout-generator.sampling")
Key = tuple[str, str | None, int | None]


class SamplingRefused(Exception):
    """The request names weights this generator cannot serve: the client's to fix."""


class Samplers:
    def __init__(self, settings: GeneratorSettings, pool: EnginePool) -> None:
        self.settings, self.pool = settings, pool
        self._engines: OrderedDict[Key, Engine] = OrderedDict()
        self._lock = asyncio.Lock()

    async def sample(self, request: SampleRequest) -> SampleResult:
        engine = await self._engine_for(request)
        completions = await asyncio.gather(
            *(
                engine.generate(
                    GenerationRequest(
                        prompt_ids=request.prompt_ids,
                        max_tokens=request.max_tokens,
                        temperature=request.temperature,
                        top_p=request.top_p,
                        top_k=request.top_k,
                        # n samples of one seed differ from each other, and repeat as a set.
                        seed=request.seed + i if request.seed is not None else None,
                        stop=request.stop,
                        stop_token_ids=request.stop_token_ids,
                    )
                )
                for i in range(request.num_samples)
            )
        )
        prompt_logprobs: list[float | None] | None = None
        if request.prompt_logprobs:
            (scores,) = await engine.score([request.prompt_ids])
            prompt_logprobs = [None, *scores]
        return SampleResult(
            sequences=[
                SampledSequence(
                    tokens=c.completion_ids, logprobs=c.logprobs, stop_reason=c.finish_reason
                )
                for c in completions
            ],
            prompt_logprobs=prompt_logprobs,
        )

    async def _engine_for(self, request: SampleRequest) -> Engine:
        key: Key = (request.base_model, request.job_id, request.weight_version)
        async with self._lock:
            engine = self._engines.get(key)
            if engine is not None:
                self._engines.move_to_end(key)
                return engine
            while len(self._engines) >= self.settings.tinker_samplers:
                _old, evicted = self._engines.popitem(last=False)
                await evicted.close()
            engine = await asyncio.to_thread(
                self.pool.create, ModelSpec(source=request.base_model), request.adapter
            )
            try:
                await self._load(engine, request)
            except BaseException:
                await engine.close()
                raise
            self._engines[key] = engine
            return engine

    async def _load(self, engine: Engine, request: SampleRequest) -> None:
        if request.weights_uri is None:
            return
        if request.job_id is None or request.weight_version is None:
            raise SamplingRefused("weights_uri needs the run (job_id) and its weight_version")
        path = path_in_job_store(
            request.weights_uri, self.settings.node.stores, request.org_id, request.job_id
        )
        if path is None or not path.is_file():
            raise SamplingRefused(
                f"{request.weights_uri} is not a weights file of run {request.job_id} "
                "(a sampling session of weights since replaced: save them by name to keep them)"
            )
        try:
            await engine.load_weights(path, request.weight_version, adapter=request.adapter)
        except EngineError as e:
            raise SamplingRefused(f"the weights could not be loaded: {e}") from None

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
        self._engines.clear()
