"""A work item's rollouts: mint an id and an unguessable inference URL for each sample, have
the gateway run the Task App against them (one call for the lot), serve the Task App's
inference calls from the engine while recording exactly what was sampled, and join each
record with its rewards into a `Trajectory`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from rlnode.engine import BadPrompt, Engine, EngineError, render_chat
from rlnode.engine.turns import TurnRefused, sample_turn
from rlnode.messages import RolloutFailure, RolloutWork, TokenTurn, Trajectory
from rlnode.service.pooled_http import HttpCallError, PooledHttp, Reply, TimedOut
from rlnode.taskapp.bridge import rollout_request, trajectory
from rlnode.taskapp.contract import NormalisedRollout
from rlnode_services.rollout_generator.engines import EnginePool, JobEngines
from rlnode_services.rollout_generator.settings import GeneratorSettings

log = logging.getLogger("rollout_generator.rollouts")


class InferenceRefused(Exception):
    """A Task App's inference call that cannot be served (says why; answered with 4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class ActiveRollout:
    rollout_id: str
    work: RolloutWork
    sample_index: int
    engines: JobEngines | None = None
    turns: list[TokenTurn] = field(default_factory=list)
    outcome: NormalisedRollout | None = None  # the Task App's result, once the gateway answered
    failure: RolloutFailure | None = None  # or why there is none

    @property
    def policy(self) -> Engine:
        """The job's policy engine (a registered rollout has its engines)."""
        assert self.engines is not None, "the rollout is registered once its engines load"
        return self.engines.policy

    async def complete(
        self, prompt_ids: list[int], max_tokens: int | None, stop: list[str]
    ) -> tuple[TokenTurn, str]:
        """Sample from the policy as the job's sampling config says; record the turn."""
        try:
            turn, text = await sample_turn(
                self.policy,
                prompt_ids,
                self.work.sampling,
                self.work.model.max_seq_len,
                max_tokens,
                stop,
            )
        except (TurnRefused, BadPrompt) as e:
            raise InferenceRefused(400, str(e)) from None
        self.turns.append(turn)
        return turn, text


class RolloutRegistry:
    def __init__(self) -> None:
        self._active: dict[str, ActiveRollout] = {}

    def add(self, rollout: ActiveRollout) -> None:
        self._active[rollout.rollout_id] = rollout

    def remove(self, rollout_id: str) -> None:
        self._active.pop(rollout_id, None)

    def get(self, rollout_id: str) -> ActiveRollout:
        rollout = self._active.get(rollout_id)
        if rollout is None:
            raise InferenceRefused(
                404, "no such rollout in progress (unknown, finished or timed out)"
            )
        return rollout

    def __len__(self) -> int:
        return len(self._active)


class RolloutSlots:
    """At most `capacity` rollouts in flight. A work item's samples take their slots at once,
    so that two items never each hold part of what both need."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def take(self, count: int) -> AsyncIterator[None]:
        assert 0 < count <= self.capacity, "a chunk of a work item fits the slots"
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= count)
            self.free -= count
        try:
            yield
        finally:
            async with self._changed:
                self.free += count
                self._changed.notify_all()


class RenderedPrompts:
    """Prompt ids by the messages (and tools) they render, for the most recent `size`: the
    samples of a group ask the same question, so its chat template runs once, not once per
    sample (it was an eighth of the generator's CPU on the control-plane benchmark). Keyed
    by the engine object, which the pool keeps for the generator's life."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._ids: OrderedDict[tuple[int, bytes], list[int]] = OrderedDict()

    def render(
        self,
        policy: Engine,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        try:
            key = (id(policy), orjson.dumps([messages, tools], option=orjson.OPT_SORT_KEYS))
        except TypeError:  # not plain JSON: render it, uncached
            return render_prompt(policy, messages, tools)
        ids = self._ids.get(key)
        if ids is None:
            ids = render_prompt(policy, messages, tools)
            self._ids[key] = ids
            if len(self._ids) > self.size:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return list(ids)


def render_prompt(
    policy: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    try:
        return render_chat(policy.tokenizer, messages, tools)
    except Exception as e:
        raise InferenceRefused(
            400, f"cannot apply the chat template to these messages: {e}"
        ) from None


class RolloutRunner:
    def __init__(
        self, settings: GeneratorSettings, pool: EnginePool, registry: RolloutRegistry, weights
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.registry = registry
        self.weights = weights
        self.slots = RolloutSlots(settings.concurrency)
        token = settings.service_token.get_secret_value() if settings.service_token else None
        self._gateways = [
            PooledHttp(
                url,
                max_connections=settings.concurrency,
                headers={"Authorization": f"Bearer {token}"} if token else {},
            )
            for url in settings.gateway_urls
        ]
        self._next_gateway = itertools.cycle(self._gateways)  # work items take them in turn

    async def aclose(self) -> None:
        for gateway in self._gateways:
            await gateway.aclose()

    async def run(self, work: RolloutWork) -> list[Trajectory]:
        """A trajectory per sample, always: ok, or failed with the reason. Only cancellation
        (shutdown) escapes, so that the work item stays uncommitted for another generator."""
        started = time.monotonic()
        rollouts = [
            ActiveRollout(secrets.token_urlsafe(24), work, sample) for sample in work.sample_indices
        ]
        try:
            try:
                engines = await self.pool.for_job(work.job_id, work.model, work.lora)
            except (EngineError, OSError, ValueError) as e:
                # Deterministic: retrying the work item elsewhere would fail the same way.
                failure = RolloutFailure(
                    kind="inference_error", message=f"cannot load the job's model: {e}"
                )
                return [self._failed(r, failure, started) for r in rollouts]
            for rollout in rollouts:
                rollout.engines = engines
            await self.weights.catch_up(work.job_id)
            await self.weights.wait_for(
                work.job_id, work.policy_version, self.settings.weights_wait_s
            )
            capacity = self.slots.capacity
            for first in range(0, len(rollouts), capacity):
                chunk = rollouts[first : first + capacity]
                async with self.slots.take(len(chunk)):
                    for rollout in chunk:
                        self.registry.add(rollout)
                    try:
                        await self._run_on_gateway(chunk)
                    finally:  # their inference URLs end with them
                        for rollout in chunk:
                            self.registry.remove(rollout.rollout_id)
            await self._add_reference_scores(rollouts)
            return [self._trajectory(r, started) for r in rollouts]
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("work %s of job %s failed inside the generator", work.id, work.job_id)
            failure = RolloutFailure(kind="internal", message=f"{type(e).__name__}: {e}")
            return [self._failed(r, failure, started) for r in rollouts]
        finally:
            for rollout in rollouts:
                self.registry.remove(rollout.rollout_id)

    async def _run_on_gateway(self, rollouts: list[ActiveRollout]) -> None:
        """One call for these rollouts; each gets its outcome or its failure."""
        work = rollouts[0].work
        base = f"{self.settings.base_url()}/rollouts"
        body = {
            "org_id": work.org_id,
            "task_app": work.task_app.name,
            "job_id": work.job_id,
            "timeout_s": work.task_app.rollout_timeout_s,
            "requests": [
                rollout_request(work, r.rollout_id, f"{base}/{r.rollout_id}").model_dump(
                    mode="json"
                )
                for r in rollouts
            ],
        }
        timeout = work.task_app.rollout_timeout_s + self.settings.rollout_timeout_margin_s
        failure = None
        gateway = next(self._next_gateway)
        try:
            response = await gateway.post("/v1/rollout-groups", json=body, timeout_s=timeout)
        except TimedOut:
            failure = RolloutFailure(
                kind="timeout", message=f"the gateway did not answer within {timeout:g}s"
            )
        except HttpCallError as e:
            failure = RolloutFailure(
                kind="internal",
                message=f"cannot reach the gateway at {gateway.base_url}: {e}",
            )
        else:
            if response.status != 200:
                kind = "task_app_unreachable" if response.status == 404 else "internal"
                failure = RolloutFailure(
                    kind=kind,
                    message=f"the gateway at {gateway.base_url} answered {response.status}: "
                    f"{_detail(response)}",
                )
        if failure is not None:
            for rollout in rollouts:
                rollout.failure = failure
            return
        outcomes = response.json()["outcomes"]
        if len(outcomes) != len(rollouts):
            failure = RolloutFailure(
                kind="internal",
                message=f"the gateway answered {len(outcomes)} outcomes for {len(rollouts)} rollouts",
            )
            for rollout in rollouts:
                rollout.failure = failure
            return
        for rollout, outcome in zip(rollouts, outcomes, strict=True):
            if outcome.get("status") != "ok":
                error = outcome.get("error") or {}
                rollout.failure = RolloutFailure(
                    kind=error.get("kind", "internal"),
                    message=str(error.get("message", "failed"))[:10_000],
                )
            else:
                rollout.outcome = NormalisedRollout.model_validate(outcome["result"])

    async def _add_reference_scores(self, rollouts: list[ActiveRollout]) -> None:
        """The stacked reference model's logprobs of every training turn, in one call."""
        engines = rollouts[0].engines
        reference = engines.reference if engines is not None else None
        # An evaluation rollout is never trained on: no KL term, no reference scores.
        if reference is None or rollouts[0].work.mode != "train":
            return
        scored = [r for r in rollouts if r.outcome is not None and r.failure is None and r.turns]
        turns = [t for r in scored for t in r.turns]
        if not turns:
            return
        scores = iter(await reference.score([t.prompt_ids + t.completion_ids for t in turns]))
        for rollout in scored:
            rollout.turns = [
                t.model_copy(update={"ref_logprobs": next(scores)[len(t.prompt_ids) - 1 :]})
                for t in rollout.turns
            ]

    def _trajectory(self, rollout: ActiveRollout, started: float) -> Trajectory:
        if rollout.failure is not None or rollout.outcome is None:
            failure = rollout.failure or RolloutFailure(kind="internal", message="no outcome")
            return self._failed(rollout, failure, started)
        return trajectory(
            rollout.work,
            rollout.sample_index,
            rollout.rollout_id,
            self.settings.generator_id,
            started,
            rollout.turns,
            rollout.outcome,
        )

    def _failed(
        self, rollout: ActiveRollout, failure: RolloutFailure, started: float
    ) -> Trajectory:
        return trajectory(
            rollout.work,
            rollout.sample_index,
            rollout.rollout_id,
            self.settings.generator_id,
            started,
            rollout.turns,
            failure=failure,
        )


def _detail(response: Reply) -> str:
    try:
        return str(response.json().get("detail", response.text))[:2000]
    except ValueError:
        return response.text[:2000]
