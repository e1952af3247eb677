"""The Task App circuit breaker: which steps trip it (and which do not), and the job loop
around it on the in-memory transport, with a Task App that fails some steps' rollouts: it
pauses with the failure kinds, issues nothing while paused, resumes on a good probe and
completes, fails past the time limit naming why, and cancels while paused."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from rlnode.messages import BreakerSpec, JobEventType, RolloutFailure, RolloutWork, Trajectory
from rlnode.models.build import init_tiny_model
from rlnode.taskapp.bridge import trajectory as trajectory_of
from rlnode.training.breaker import TaskAppBreaker, TaskAppDown
from rlnode.training.loop import JobCancelled, JobFailed
from tests.conftest import eventually
from tests.unit.test_job_loop import Loop, config

pytestmark = pytest.mark.asyncio
UNREACHABLE = "task_app_unreachable"


def trajectory(step: int, ok: bool, kind: str = UNREACHABLE) -> Trajectory:
    common = {
        "job_id": "job",
        "org_id": "org",
        "work_id": uuid.uuid4(),
        "rollout_id": "r",
        "generator": "g",
        "step": step,
        "group_id": f"{step}/0",
        "seed": 0,
        "sample_index": 0,
    }
    if ok:
        turn = {
            "prompt_ids": [1],
            "completion_ids": [2],
            "logprobs": [-0.1],
            "policy_version": 0,
            "finish_reason": "stop",
        }
        return Trajectory.model_validate(common | {"status": "ok", "reward": 1.0, "turns": [turn]})
    failure = RolloutFailure(kind=kind, message="connection refused")  # type: ignore[arg-type]
    return Trajectory.model_validate(common | {"status": "failed", "failure": failure})


def batch(step: int, failed: int, of: int = 4, kind: str = UNREACHABLE) -> list[Trajectory]:
    return [trajectory(step, ok=i >= failed, kind=kind) for i in range(of)]


def breaker(probe=None, **spec) -> TaskAppBreaker:
    async def ok() -> tuple[bool, str]:
        return True, "answers"

    return TaskAppBreaker(BreakerSpec(**spec), "copy", probe or ok)


# -- which steps trip it --------------------------------------------------------------------


async def test_it_trips_after_n_bad_steps_in_a_row_not_before() -> None:
    b = breaker(consecutive_steps=3, max_failed_share=0.5)
    assert b.judge(0, batch(0, failed=3)) is None
    assert b.judge(1, batch(1, failed=4)) is None  # 2 of 3
    paused = b.judge(2, batch(2, failed=3, kind="timeout"))
    assert paused is not None
    assert paused.step == 3 and paused.bad_steps == 3 and paused.rollouts == 12
    assert paused.failed == 10 and paused.failures == {UNREACHABLE: 7, "timeout": 3}
    assert not paused.after_resume
    assert "10 of 12 rollouts failed over 3 step(s) (task_app_unreachable: 7, timeout: 3)" in (
        b.paused_message(paused)
    )


async def test_a_good_step_starts_the_count_again() -> None:
    b = breaker(consecutive_steps=2, max_failed_share=0.5)
    assert b.judge(0, batch(0, failed=4)) is None
    assert b.judge(1, batch(1, failed=2)) is None  # half failed: not *more* than half
    assert b.judge(2, batch(2, failed=4)) is None
    assert b.judge(3, batch(3, failed=0)) is None
    assert b.judge(4, batch(4, failed=3)) is None
    assert b.judge(5, batch(5, failed=3)) is not None


async def test_a_share_of_one_never_trips() -> None:
    b = breaker(consecutive_steps=1, max_failed_share=1.0)
    assert all(b.judge(step, batch(step, failed=4)) is None for step in range(5))


async def test_after_a_resume_the_first_new_step_decides_and_older_ones_do_not_count() -> None:
    b = breaker(consecutive_steps=2)
    b.judge(0, batch(0, failed=4))
    assert b.judge(1, batch(1, failed=4)) is not None
    resumed = await b.hold(asyncio.Event(), issued=3)  # steps 2, 3 went out before
    assert resumed is not None and resumed.step == 2 and resumed.probes == 1
    assert b.judge(2, batch(2, failed=4)) is None  # ran during the outage
    assert b.judge(3, batch(3, failed=0)) is None
    again = b.judge(4, batch(4, failed=4))  # one bad step on trial is enough
    assert again is not None and again.after_resume and again.bad_steps == 1
    assert "still fail after it answered the probe" in b.paused_message(again)
    await b.hold(asyncio.Event(), issued=5)
    assert b.judge(6, batch(6, failed=0)) is None  # a good step closes it
    assert b.opened_at is None and not b.on_trial
    assert b.judge(7, batch(7, failed=4)) is None  # so one bad step is one of two again


# -- waiting for the Task App -----------------------------------------------------------------


async def test_it_gives_up_past_the_limit_naming_the_failures_and_the_last_probe() -> None:
    answers = iter([(False, "healthy: cannot connect to the Task App")])

    async def probe() -> tuple[bool, str]:
        return next(answers)

    b = breaker(probe, consecutive_steps=1, give_up_after_s=0.2)
    assert b.judge(0, batch(0, failed=4)) is not None
    with pytest.raises(TaskAppDown) as down:
        await b.hold(asyncio.Event(), issued=0)
    reason = str(down.value)
    assert "'copy' did not recover within 0.2s (training.breaker.give_up_after_s)" in reason
    assert "4 of 4 rollouts failed over 1 step(s) (task_app_unreachable: 4)" in reason
    assert "last probe: healthy: cannot connect to the Task App" in reason


async def test_a_probe_that_raises_is_a_failed_probe() -> None:
    async def probe() -> tuple[bool, str]:
        raise ConnectionError("gateway down")

    b = breaker(probe, consecutive_steps=1, give_up_after_s=0.1)
    b.judge(0, batch(0, failed=4))
    with pytest.raises(TaskAppDown, match="the probe failed: ConnectionError: gateway down"):
        await b.hold(asyncio.Event(), issued=0)


async def test_a_cancel_ends_the_wait() -> None:
    async def never() -> tuple[bool, str]:
        return False, "healthy: the Task App failed (500)"

    b = breaker(never, consecutive_steps=1)
    b.judge(0, batch(0, failed=4))
    cancelled = asyncio.Event()
    waiting = asyncio.create_task(b.hold(cancelled, issued=0))
    await asyncio.sleep(0.1)
    cancelled.set()
    assert await asyncio.wait_for(waiting, 5) is None


# -- the job loop around it -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


class FlakyTaskApp(Loop):
    """The in-process loop, with every rollout of the `failing` steps failed at once (the
    Task App is unreachable: no episode, no inference), and a record of what went out while
    the job was paused."""

    def __init__(self, model: Path, root: Path, failing, probe, **training) -> None:
        super().__init__(model, root, config(model, **training), probe=probe)
        self.failing = failing
        self.sent_while_paused: list[str] = []
        at = self.transport.on_work.index(self.generator.on_work)
        self.transport.on_work[at] = self._route
        self.transport.on_work.insert(0, self._note("work"))
        self.transport.on_weights.insert(0, self._note("weights"))

    async def _route(self, work: Sequence[RolloutWork]) -> None:
        failure = RolloutFailure(kind=UNREACHABLE, message="connection refused")
        for item in work:
            if item.step in self.failing:
                for sample in item.sample_indices:
                    self.deliver(
                        trajectory_of(
                            item, sample, f"r{sample}", "flaky", time.monotonic(), [], None, failure
                        )
                    )
        await self.generator.on_work([w for w in work if w.step not in self.failing])

    def paused(self) -> bool:
        kinds = [e.type for e in self.transport.events]
        marks = [k for k in kinds if k in (JobEventType.PAUSED, JobEventType.RESUMED)]
        return bool(marks) and marks[-1] is JobEventType.PAUSED

    def _note(self, what: str):
        async def note(_record) -> None:
            if self.paused():
                self.sent_while_paused.append(what)

        return note

    def kinds(self) -> list[JobEventType]:
        return [e.type for e in self.transport.events]


class ScriptedProbe:
    """Answers from a script, then its last answer for ever."""

    def __init__(self, *answers: tuple[bool, str]) -> None:
        self.answers = itertools.chain(answers, itertools.repeat(answers[-1]))
        self.calls = 0

    async def __call__(self) -> tuple[bool, str]:
        self.calls += 1
        return next(self.answers)


async def test_the_job_pauses_waits_for_the_task_app_and_completes(tiny_model, tmp_path) -> None:
    probe = ScriptedProbe((False, "healthy: cannot connect"), (True, "passes verification"))
    loop = FlakyTaskApp(
        tiny_model,
        tmp_path,
        {1, 2},
        probe,
        steps=6,
        max_async=1,
        breaker={"consecutive_steps": 2, "give_up_after_s": 60},
    )
    await loop.run()
    (paused,) = loop.events(JobEventType.PAUSED)
    assert paused["step"] == 3 and paused["bad_steps"] == 2
    assert paused["failures"] == {UNREACHABLE: 16} and paused["rollouts"] == 16
    (resumed,) = loop.events(JobEventType.RESUMED)
    assert resumed["step"] == 3 and resumed["probes"] == 2
    assert resumed["probe"] == "passes verification"
    kinds = loop.kinds()
    # The step that tripped it is trained; nothing goes out until the Task App answers.
    at = kinds.index(JobEventType.PAUSED)
    assert [
        e.data["step"] for e in loop.transport.events[:at] if e.type is JobEventType.TRAIN_STEP
    ][-1] == 3
    assert loop.sent_while_paused == []
    assert [s["step"] for s in loop.events(JobEventType.TRAIN_STEP)] == [1, 2, 3, 4, 5, 6]
    message = next(e.message for e in loop.transport.events if e.type is JobEventType.PAUSED)
    assert "16 of 16 rollouts failed over 2 step(s) (task_app_unreachable: 16)" in message


async def test_the_job_fails_past_the_time_limit_with_the_reason(tiny_model, tmp_path) -> None:
    probe = ScriptedProbe((False, "healthy: cannot connect to the Task App"))
    loop = FlakyTaskApp(
        tiny_model,
        tmp_path,
        set(range(1, 50)),
        probe,
        steps=50,
        max_async=0,
        breaker={"consecutive_steps": 2, "give_up_after_s": 0.5},
    )
    with pytest.raises(JobFailed) as failed:
        await loop.run()
    reason = str(failed.value)
    assert "did not recover within 0.5s" in reason and "task_app_unreachable: 16" in reason
    assert "last probe: healthy: cannot connect to the Task App" in reason
    assert JobEventType.RESUMED not in loop.kinds() and loop.runner.step == 3
    assert loop.sent_while_paused == []


async def test_a_task_app_that_answers_but_still_fails_is_given_up_on(tiny_model, tmp_path) -> None:
    probe = ScriptedProbe((True, "passes verification"))  # healthy, but its episodes crash
    # Failing for longer than it can run in give_up_after_s: steps without a rollout that
    # worked take no training, and a fast machine ran 60 of them within the 0.5 s.
    loop = FlakyTaskApp(
        tiny_model,
        tmp_path,
        set(range(1, 100_000)),
        probe,
        steps=100_000,
        max_async=1,
        breaker={"consecutive_steps": 2, "give_up_after_s": 0.5},
    )
    with pytest.raises(JobFailed, match=r"answers its probe .* but its rollouts still fail"):
        await loop.run()
    paused = loop.events(JobEventType.PAUSED)
    assert len(paused) >= 2 and paused[1]["after_resume"] and paused[1]["bad_steps"] == 1


async def test_a_cancel_while_paused_cancels_with_a_checkpoint(tiny_model, tmp_path) -> None:
    probe = ScriptedProbe((False, "healthy: the Task App failed (500)"))
    loop = FlakyTaskApp(
        tiny_model,
        tmp_path,
        set(range(0, 50)),
        probe,
        steps=50,
        max_async=1,
        breaker={"consecutive_steps": 2},
    )
    task = asyncio.create_task(loop.run())
    await eventually(loop.paused, 60, "the job paused")
    loop.runner.cancel("fixing the Task App")
    with pytest.raises(JobCancelled):
        await task
    assert loop.runner.step == 2 and probe.calls >= 1
    (saved,) = loop.events(JobEventType.CHECKPOINT_SAVED)
    assert saved["step"] == 2
    assert loop.sent_while_paused == []
