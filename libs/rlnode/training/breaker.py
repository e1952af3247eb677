"""The Task App circuit breaker: a job whose rollouts mostly fail stops training on the few
that survive.

A step is *bad* when more than `max_failed_share` of its rollouts failed (any failure kind:
the event names them). `consecutive_steps` bad steps in a row pause the job: the loop
publishes `job.paused`, trains no further step and issues no new work, and probes the Task
App (a `Probe`: the learner's asks the gateway to verify it) with backoff until it answers,
then publishes `job.resumed` and goes on. Past `give_up_after_s` the job fails, naming the
failures and the last probe's answer. A cancel while paused cancels.

The step that trips the breaker was trained already, as every step is (its good rollouts are
as good as any): the breaker stops the waste that follows, it does not undo a step.

A Task App can answer its probe and still fail its rollouts (healthy, but its episodes
crash). So after a resume the breaker is on trial: the first step whose work was issued after
the resume decides; bad, and it pauses again at once, the time limit still counting from the
first pause; good, and it closes. Steps whose work was issued before the resume ran during
the outage and are not judged.

The breaker lives in memory: a learner that restarts resumes the job with it closed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from rlnode.messages import BreakerSpec, Trajectory
from rlnode.messages.jobs import PausedData, ResumedData

# Asks whether the Task App answers again: (ok, what it said, without secrets).
Probe = Callable[[], Awaitable[tuple[bool, str]]]
FIRST_RETRY_S = 1.0  # between probes, doubling up to
LAST_RETRY_S = 30.0
MAX_PROBE_TEXT = 500
T = TypeVar("T")


class TaskAppDown(Exception):
    """The Task App did not recover within the breaker's time limit."""


@dataclass
class _BadRun:
    """The bad steps in a row so far."""

    steps: int = 0
    rollouts: int = 0
    failures: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in self.failures.most_common())
        failed = sum(self.failures.values())
        return f"{failed} of {self.rollouts} rollouts failed over {self.steps} step(s) ({kinds})"


class TaskAppBreaker:
    def __init__(self, spec: BreakerSpec, task_app: str, probe: Probe) -> None:
        self.spec = spec
        self.task_app = task_app
        self.probe = probe
        self.bad = _BadRun()
        self.opened_at: float | None = None  # the first pause of this outage
        self.on_trial = False
        self.unjudged_through = -1  # steps whose work went out before the last resume
        self.last_probe: tuple[bool, str] = (False, "not probed yet")
        self.steps_done = 0  # when it last paused (nothing trains while paused)

    def judge(self, step: int, trajectories: Sequence[Trajectory]) -> PausedData | None:
        """Count step `step` (just trained); the pause it calls for, if any."""
        if step <= self.unjudged_through or not trajectories:
            return None
        failures = Counter(t.failure.kind for t in trajectories if t.failure is not None)
        if sum(failures.values()) / len(trajectories) <= self.spec.max_failed_share:
            self._close()
            return None
        self.bad.steps += 1
        self.bad.rollouts += len(trajectories)
        self.bad.failures.update(failures)
        if self.bad.steps < self.spec.consecutive_steps and not self.on_trial:
            return None
        if self.opened_at is None:
            self.opened_at = time.monotonic()
        self.steps_done = step + 1
        return PausedData(
            step=self.steps_done,
            bad_steps=self.bad.steps,
            rollouts=self.bad.rollouts,
            failed=sum(self.bad.failures.values()),
            failures=dict(self.bad.failures.most_common()),
            max_failed_share=self.spec.max_failed_share,
            after_resume=self.on_trial,
            give_up_after_s=self.spec.give_up_after_s,
        )

    async def hold(self, cancelled: asyncio.Event, issued: int) -> ResumedData | None:
        """Probe until the Task App answers: how the job resumes, or None when it was
        cancelled meanwhile. `issued`: the last step whose work went out (not judged after
        the resume). Raises TaskAppDown past the time limit."""
        assert self.opened_at is not None, "hold() follows a pause"
        deadline = self.opened_at + self.spec.give_up_after_s
        paused_at, probes, retry = time.monotonic(), 0, FIRST_RETRY_S
        while (remaining := deadline - time.monotonic()) > 0:
            answer = await _unless_cancelled(self._ask(), cancelled, remaining)
            if cancelled.is_set():
                return None
            probes += 1
            self.last_probe = answer or (False, f"no answer within {remaining:.0f}s")
            if self.last_probe[0]:
                self._resume(issued)
                return ResumedData(
                    step=self.steps_done,
                    paused_s=time.monotonic() - paused_at,
                    probes=probes,
                    probe=self.last_probe[1],
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cancelled.wait(), min(retry, deadline - time.monotonic()))
            if cancelled.is_set():
                return None
            retry = min(2 * retry, LAST_RETRY_S)
        raise TaskAppDown(self._give_up_reason())

    def paused_message(self, paused: PausedData) -> str:
        why = self.bad.summary()
        if paused.after_resume:
            why = f"its rollouts still fail after it answered the probe: {why}"
        return (
            f"paused after step {paused.step}: {why}; probing the Task App {self.task_app!r} "
            f"(the job fails {paused.give_up_after_s:g}s after the first pause)"
        )

    def resumed_message(self, resumed: ResumedData) -> str:
        return (
            f"resumed after {resumed.paused_s:.0f}s paused: the Task App {self.task_app!r} "
            f"answers ({resumed.probe})"
        )

    async def _ask(self) -> tuple[bool, str]:
        """The probe's answer, cut short enough to go into an event and a job's reason."""
        try:
            ok, detail = await self.probe()
        except Exception as e:  # a broken probe is a failed probe, not a failed job
            ok, detail = False, f"the probe failed: {type(e).__name__}: {e}"
        return bool(ok), detail[:MAX_PROBE_TEXT]

    def _resume(self, issued: int) -> None:
        self.on_trial = True
        self.unjudged_through = issued
        self.bad = _BadRun()

    def _close(self) -> None:
        self.bad = _BadRun()
        self.opened_at = None
        self.on_trial = False

    def _give_up_reason(self) -> str:
        limit = f"{self.spec.give_up_after_s:g}s (training.breaker.give_up_after_s)"
        answered, said = self.last_probe
        if answered:
            return (
                f"the Task App {self.task_app!r} answers its probe ({said}) but its rollouts "
                f"still fail: {self.bad.summary()}; gave up after {limit}"
            )
        return (
            f"the Task App {self.task_app!r} did not recover within {limit}: "
            f"{self.bad.summary()}; last probe: {said}"
        )


async def _unless_cancelled(
    awaitable: Awaitable[T], cancelled: asyncio.Event, timeout_s: float
) -> T | None:
    """`awaitable`'s result; None when `cancelled` is set first or `timeout_s` passes."""
    task = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(cancelled.wait())
    try:
        await asyncio.wait({task, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None
