"""The Tinker API runs this learner trains: calls (rlnode.tinker-calls) go to their run's
queue and one driver per run runs them in order (a long pass of one org's run never holds
up another's); results go to rlnode.tinker-results. A call's offset is committed only once
a checkpoint of its run covers it, so a learner that restarts is handed the rest again and
its run resumes (rlnode.training.tinker)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from rlnode.bus import Bus, Delivery, Subscription
from rlnode.bus.signing import RecordRefused
from rlnode.messages import TinkerCall, TinkerResult, topics
from rlnode.messages.tinker import CloseRun, CreateRun
from rlnode.service.stores import job_dir
from rlnode.service.supervised import Background
from rlnode.training.policy import JobFailed
from rlnode.training.tinker import TinkerRun
from rlnode.training.transport import JobTransport
from rlnode_services.learner.limits import OverLimit, check_source
from rlnode_services.learner.settings import LearnerSettings

log = logging.getLogger("learner.tinker")
SPEC_FILE = "tinker_run.json"


class TinkerRuns:
    def __init__(self, settings: LearnerSettings, bus: Bus, transport: JobTransport) -> None:
        self.settings = settings
        self.bus = bus
        self.transport = transport
        self.runs: dict[str, TinkerRun] = {}
        self.queues: dict[str, asyncio.Queue[TinkerCall]] = {}
        # Runs whose trainer failed: their calls are answered with why until the client
        # starts again from a checkpoint (a new run).
        self.broken: dict[str, str] = {}
        self.drivers = Background()
        self.calls: Subscription[TinkerCall] | None = None

    async def start(self) -> None:
        self.calls = self.bus.subscribe(
            topics.TINKER_CALLS,
            self.on_call,
            group_id=self.settings.tinker_group_id,
            commit="when_settled",
            tag=lambda c: (c.job_id, c.seq_id),
            settled=self._settled,
        )
        await self.calls.start()

    async def stop(self) -> None:
        await self.drivers.stop()
        for run in list(self.runs.values()):
            await run.close()
        self.runs.clear()

    async def on_call(self, call: TinkerCall, _delivery: Delivery) -> None:
        run = self.runs.get(call.job_id)
        if run is not None and run.org_id != call.org_id:
            raise RecordRefused(
                f"a call to run {call.job_id} names org {call.org_id!r}; the run is "
                f"{run.org_id!r}'s"
            )
        queue = self.queues.get(call.job_id)
        if queue is None:
            queue = self.queues[call.job_id] = asyncio.Queue()
            self.drivers.run(f"tinker run {call.job_id}", lambda: self._drive(call.job_id))
        queue.put_nowait(call)

    def _settled(self, tag: tuple[str, int]) -> bool:
        run_id, seq_id = tag
        run = self.runs.get(run_id)
        if run is not None:
            return run.settled(seq_id)
        # Closed, broken or never made: nothing to resume, nothing to read again.
        return run_id not in self.queues

    async def _drive(self, run_id: str) -> None:
        queue = self.queues[run_id]
        while True:
            call = await queue.get()
            result = await self._answer(call)
            if result is not None:
                await self.bus.publish(result)
            if isinstance(call.call, CloseRun):
                await self._close(run_id)
                if queue.empty():
                    del self.queues[run_id]
                    return

    async def _answer(self, call: TinkerCall) -> TinkerResult | None:
        if call.job_id in self.broken:
            return _failed(call, self.broken[call.job_id], "user")
        try:
            run = await self._run_for(call)
        except (OverLimit, LookupError, JobFailed) as e:
            return _failed(call, str(e), "user")
        try:
            return await run.execute(call)
        except Exception as e:
            # The trainer is in an unknown state (a rank died, memory ran out): the run
            # stops here; what it checkpointed stays for a new run to load.
            log.exception("tinker run %s failed", call.job_id)
            reason = (
                f"the run's trainer failed at call {call.seq_id}: {type(e).__name__}: {e}; "
                "start a new training client from its last saved state"
            )
            self.broken[call.job_id] = reason
            await self._close(call.job_id)
            return _failed(call, reason, "server")

    async def _run_for(self, call: TinkerCall) -> TinkerRun:
        run = self.runs.get(call.job_id)
        if run is not None:
            return run
        root = job_dir(self.settings.node.checkpoint_dir, call.org_id, call.job_id)
        if isinstance(call.call, CreateRun):
            spec = call.call
            check_source(self.settings, "base_model", spec.base_model, call.org_id)
            if len(self.runs) >= self.settings.max_tinker_runs:
                raise OverLimit(
                    f"this learner trains {len(self.runs)} Tinker runs already, its limit "
                    "(LEARNER_MAX_TINKER_RUNS): end a session, or try again later"
                )
            await asyncio.to_thread(_write_spec, root, spec)
        else:
            spec = await asyncio.to_thread(_read_spec, root, call.job_id)
        run = TinkerRun(
            call.job_id,
            call.org_id,
            spec,
            self.settings.node.checkpoint_dir,
            self.settings.device_list,
            self.transport,
            tokens_per_micro_batch=self.settings.tinker_tokens_per_micro_batch,
            recompute_from_tokens=self.settings.tinker_recompute_from_tokens,
            checkpoint_every=self.settings.tinker_checkpoint_every,
            weights_root=self.settings.node.weights_store,
            weights_dtype=self.settings.engine_dtype,
            max_checkpoint_bytes=self.settings.max_checkpoint_bytes,
            disk_full_wait_s=self.settings.disk_full_wait_s,
            source=self.bus.service,
        )
        await run.start()
        self.runs[call.job_id] = run
        return run

    async def _close(self, run_id: str) -> None:
        run = self.runs.pop(run_id, None)
        if run is not None:
            await run.close()


def _failed(call: TinkerCall, error: str, category: str) -> TinkerResult:
    return TinkerResult.of(call, error=error, error_category=category)


def _write_spec(root: Path, spec: CreateRun) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / SPEC_FILE).write_text(json.dumps(spec.model_dump(mode="json"), indent=2) + "\n")


def _read_spec(root: Path, run_id: str) -> CreateRun:
    try:
        return CreateRun.model_validate_json((root / SPEC_FILE).read_text())
    except FileNotFoundError:
        raise LookupError(f"there is no Tinker run {run_id!r} of this org") from None
