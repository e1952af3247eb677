"""A model's calls to the learner, in its order, and their results back to the futures.

The SDK numbers a model's training requests (`seq_id` 1, 2, ...; creating the model is 0)
and may send some at once (the chunks of one forward_backward); the learner must apply them
in that order. Calls wait here until those before them are published, then go to
rlnode.tinker-calls keyed by the run, whose per-key order the learner keeps. A call's
internal number is its `seq_id` + 1: 0 creates the run, 1 is a load that creates it from a
checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session

from rlnode.bus import Bus, Delivery
from rlnode.messages import TinkerCall, TinkerResult
from rlnode.messages.tinker import TinkerOp
from rlnode.service.db import session_scope
from rlnode_services.tinker_api import wire
from rlnode_services.tinker_api.futures import Answer, Future, Futures
from rlnode_services.tinker_api.store import TinkerCheckpoint, TinkerModel, TinkerSampler

log = logging.getLogger("tinker-api.calls")
CREATE_SUFFIX = ":create"


def internal_seq(sdk_seq: int) -> int:
    return sdk_seq + 1


def tinker_path(model_id: str, kind: str, name: str) -> str:
    segment = "weights" if kind == "training" else "sampler_weights"
    return f"tinker://{model_id}/{segment}/{name}"


class Calls:
    def __init__(self, bus: Bus, engine: Engine, futures: Futures) -> None:
        self.bus, self.engine, self.futures = bus, engine, futures
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._held: dict[str, dict[int, TinkerCall | None]] = defaultdict(dict)
        # (model, seq) -> (the call's kind, its request id). The SDK sends a call again, with
        # its seq_id, when it did not hear the answer in time (a read timeout, a 5xx, a 409):
        # a call of the same kind on a seq_id in use is that resend and gets the first future.
        self._placed: dict[tuple[str, int], tuple[str, str]] = {}

    def resent(self, model_id: str, seq: int, kind: str) -> str | None:
        """The first future of a call sent again (internal number `seq`), if this is one."""
        placed = self._placed.get((model_id, seq))
        if placed is not None and placed[0] == kind and self.futures.get(placed[1]) is not None:
            return placed[1]
        return None

    def _place(self, model_id: str, seq: int, kind: str, request_id: str) -> None:
        if len(self._placed) > 10_000:  # the places of forgotten futures go with them
            self._placed = {
                k: v for k, v in self._placed.items() if self.futures.get(v[1]) is not None
            }
        self._placed[(model_id, seq)] = (kind, request_id)

    # -- out ----------------------------------------------------------------------------------

    async def submit(
        self,
        model: TinkerModel,
        seq: int,
        op: TinkerOp,
        kind: str,
        **context: Any,
    ) -> str:
        """Queue a call (internal number `seq`) of `model`; returns its future's id."""
        if (first := self.resent(model.model_id, seq, kind)) is not None:
            return first
        if (model.model_id, seq) in self._placed:  # another call on a seq_id in use
            request_id, _future = self.futures.open(model.org_id, kind, model_id=model.model_id)
            self.futures.resolve(request_id, _used_already(model.model_id, seq))
            return request_id
        request_id, future = self.futures.open(
            model.org_id, kind, model_id=model.model_id, **context
        )
        self._place(model.model_id, seq, kind, request_id)
        call = TinkerCall(
            job_id=model.job_id, org_id=model.org_id, request_id=request_id, seq_id=seq, call=op
        )
        await self._enqueue(model.model_id, call, future)
        return request_id

    async def start_run(
        self, model: TinkerModel, create: TinkerOp, load: TinkerOp | None, kind: str, **context: Any
    ) -> str:
        """A run's first calls: 0 creates it, 1 (when given) loads a checkpoint into it; the
        future answers the last of them (a failure of the create fails it too). The client's
        own calls follow from 2 (its seq_id 1)."""
        request_id, _future = self.futures.open(
            model.org_id, kind, model_id=model.model_id, **context
        )
        self._place(model.model_id, 0, kind, request_id)
        calls = [
            TinkerCall(
                job_id=model.job_id,
                org_id=model.org_id,
                request_id=request_id if load is None else request_id + CREATE_SUFFIX,
                seq_id=0,
                call=create,
            )
        ]
        if load is not None:
            calls.append(
                TinkerCall(
                    job_id=model.job_id,
                    org_id=model.org_id,
                    request_id=request_id,
                    seq_id=1,
                    call=load,
                )
            )
        async with self._locks[model.model_id]:
            await self.bus.publish_all(calls)
            with session_scope(self.engine) as s:
                model.next_seq = 2
                s.merge(model)
        return request_id

    async def skip(self, model_id: str, seq: int) -> None:
        """A call refused before it was queued (a 4xx at submission) still takes its place in
        the model's order: the client numbered it, and the calls after it would otherwise wait
        for it for ever."""
        await self._enqueue(model_id, None, None, seq)

    async def _enqueue(
        self,
        model_id: str,
        call: TinkerCall | None,
        future: Future | None,
        seq: int | None = None,
    ) -> None:
        seq = call.seq_id if call is not None else seq
        assert seq is not None, "a call, or the place of a refused one"
        async with self._locks[model_id]:
            with Session(self.engine) as s:
                model = s.get(TinkerModel, model_id)
                next_seq = model.next_seq if model is not None else 0
            if seq < next_seq:
                if call is not None and future is not None:
                    self.futures.resolve(call.request_id, _used_already(model_id, seq))
                return
            held = self._held[model_id]
            held[seq] = call
            ready: list[TinkerCall] = []
            while next_seq in held:
                taken = held.pop(next_seq)
                if taken is not None:  # None: a refused call's place, passed over
                    ready.append(taken)
                next_seq += 1
            if ready:
                await self.bus.publish_all(ready)
            with session_scope(self.engine) as s:
                stored = s.get(TinkerModel, model_id)
                if stored is not None:
                    stored.next_seq = next_seq
                    s.add(stored)

    # -- back -----------------------------------------------------------------------------------

    async def on_result(self, result: TinkerResult, _delivery: Delivery) -> None:
        if result.request_id.endswith(CREATE_SUFFIX):
            if result.error is not None:  # the load that made the run fails with it
                owner = result.request_id.removesuffix(CREATE_SUFFIX)
                self.futures.resolve(owner, Answer.error(result.error, _category(result)))
            return
        future = self.futures.get(result.request_id)
        if future is None or future.answer is not None:
            return  # another instance's, answered already, or forgotten
        if future.org_id != result.org_id:
            log.error("a result for %s names org %s; ignored", result.request_id, result.org_id)
            return
        if result.error is not None:
            answer = Answer.error(result.error, _category(result))
        else:
            try:
                answer = await asyncio.to_thread(self._answer, future, result)
            except Exception as e:  # a bug of ours: the client hears of it, the server goes on
                log.exception("result %s could not be answered", result.request_id)
                answer = Answer.error(f"the tinker-api failed: {type(e).__name__}: {e}", "server")
        self.futures.resolve(result.request_id, answer)

    def _answer(self, future: Future, result: TinkerResult) -> Answer:
        model_id = future.context["model_id"]
        kind = future.kind
        if kind == "create_model":
            return Answer.json({"model_id": model_id, "type": "create_model"})
        if kind == "load_weights":
            return Answer.json(
                {"path": future.context["path"], "model_id": model_id, "type": "load_weights"}
            )
        if kind == "forward_backward":
            assert result.logprobs is not None and result.loss_sum is not None
            metrics = {"loss:sum": result.loss_sum, "num_tokens:sum": float(result.tokens or 0)}
            body = wire.forward_backward_output(result.logprobs, metrics)
            return Answer(body, "application/x-protobuf")
        if kind == "optim_step":
            self._update_model(model_id, steps=result.step or 0)
            metrics = {"grad_norm": result.grad_norm or 0.0, "step": float(result.step or 0)}
            # What the learner spent (a cookbook recipe logs these beside its own times).
            metrics |= {f"server/{name}": seconds for name, seconds in result.timings.items()}
            return Answer.json({"metrics": metrics})
        if kind == "save_weights":
            path = self._record_checkpoint(future, result, "training")
            return Answer.json({"path": path, "type": "save_weights"})
        if kind == "save_weights_for_sampler":
            if future.context.get("name") is not None:
                path = self._record_checkpoint(future, result, "sampler")
                return Answer.json({"path": path, "type": "save_weights_for_sampler"})
            sampler_id = self._record_sampler(future, result)
            return Answer.json(
                {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
            )
        if kind == "close":  # a finished session's runs: nobody waits for it
            return Answer.json({})
        raise ValueError(f"no answer for a {kind} future")

    def _record_checkpoint(self, future: Future, result: TinkerResult, kind: str) -> str:
        model_id, name = future.context["model_id"], future.context["name"]
        path = tinker_path(model_id, kind, name)
        with session_scope(self.engine) as s:
            record = s.get(TinkerCheckpoint, path) or TinkerCheckpoint(
                tinker_path=path,
                org_id=future.org_id,
                model_id=model_id,
                kind=kind,
                name=name,
                uri=result.weights_uri or "",
            )
            record.uri = result.weights_uri or record.uri
            record.weight_version = result.weight_version
            metadata = future.context.get("user_metadata")
            record.user_metadata = json.dumps(metadata) if metadata else None
            s.add(record)
        return path

    def _record_sampler(self, future: Future, result: TinkerResult) -> str:
        model_id = future.context["model_id"]
        with session_scope(self.engine) as s:
            model = s.get(TinkerModel, model_id)
            assert model is not None, "a model's future outlives nothing of it"
            sampler_id = f"{model.session_id}:sample:{future.context['sampling_session_seq_id']}"
            s.merge(
                TinkerSampler(
                    sampler_id=sampler_id,
                    org_id=model.org_id,
                    session_id=model.session_id,
                    base_model=model.base_model,
                    source=model.source,
                    job_id=model.job_id,
                    weight_version=result.weight_version,
                    uri=result.weights_uri,
                )
            )
        return sampler_id

    def _update_model(self, model_id: str, **changes: Any) -> None:
        with session_scope(self.engine) as s:
            model = s.get(TinkerModel, model_id)
            if model is not None:
                for key, value in changes.items():
                    setattr(model, key, value)
                s.add(model)


def _category(result: TinkerResult) -> str:
    return result.error_category or "server"


def _used_already(model_id: str, seq: int) -> Answer:
    return Answer.error(
        f"seq_id {seq - 1} of model {model_id} was used already by another call: requests "
        "of a training client run in its order, once each",
        "user",
    )
