"""The job loop on the in-memory transport: the real `JobRunner`, trainer, torch engine and
copy-task Task App code, in one process and in seconds. Staleness stays within max_async,
duplicates are trained once, cancel keeps a checkpoint, and a resumed loop re-issues the
same work and trains nothing twice."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples import example_job
from rlnode.examples.taskapps import calculator, copy_task
from rlnode.messages import JobConfig, JobEventType, RolloutWork, Trajectory
from rlnode.messages.config import CurriculumSpec
from rlnode.models.build import init_tiny_model
from rlnode.service.openai_api import parse_tool_calls
from rlnode.taskapp import TaskAppDefinition
from rlnode.training.breaker import Probe
from rlnode.training.inprocess import InProcessGenerator
from rlnode.training.loop import (
    JobCancelled,
    JobFailed,
    JobRunner,
    differing_groups,
    trained_work_ids,
)
from rlnode.training.transport import InMemoryTransport
from tests.conftest import eventually

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def config(model: Path, **training) -> JobConfig:
    small = {"prompts_per_step": 2, "group_size": 4, "checkpoint_every": 100}
    return example_job("copy_task", model, **(small | training))


class Loop:
    """A runner, its transport and an in-process generator, as the learner would run them."""

    def __init__(
        self,
        model: Path,
        root: Path,
        job: JobConfig,
        job_id: str = "job-loop",
        probe: Probe | None = None,
        task_app: TaskAppDefinition = copy_task.DEFINITION,
        samples_per_work: int = 16,
        weights_store: Path | None = None,
    ) -> None:
        self.transport = InMemoryTransport()
        self.runner = JobRunner(
            job_id,
            "org",
            job,
            self.transport,
            root,
            ["cpu"],
            60.0,
            probe=probe,
            samples_per_work=samples_per_work,
            weights_dir=weights_store,
        )
        self.engine = TorchEngine(model, dtype="float32", max_wait_ms=1)
        self.generator = InProcessGenerator(self.engine, task_app, self.deliver).attach(
            self.transport
        )
        self.delivered: list[Trajectory] = []
        self.issued_while_at: list[tuple[RolloutWork, int]] = []
        self.transport.on_work.insert(0, self._note_issue)

    def deliver(self, trajectory: Trajectory) -> None:
        self.delivered.append(trajectory)
        self.runner.offer(trajectory)

    async def _note_issue(self, work) -> None:
        self.issued_while_at.extend((w, self.runner.step) for w in work)

    def events(self, kind: JobEventType) -> list[dict]:
        return [e.data for e in self.transport.events if e.type is kind]

    async def run(self) -> None:
        try:
            await self.runner.run()
        finally:
            await self.generator.close()
            await self.engine.close()


@pytest.mark.parametrize("max_async", [0, 2])
async def test_work_runs_at_most_max_async_versions_ahead(tiny_model, tmp_path, max_async):
    loop = Loop(tiny_model, tmp_path, config(tiny_model, steps=4, max_async=max_async))
    await loop.run()
    steps = loop.events(JobEventType.TRAIN_STEP)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["staleness_max"] <= max_async for s in steps)
    # Step s is issued only once step s - max_async is trained ...
    assert all(work.step - trained <= max_async for work, trained in loop.issued_while_at)
    # ... and sampled from a policy at most max_async versions behind the one it trains.
    if max_async == 0:
        assert all(s["staleness_max"] == 0 for s in steps)
    # A work item per group (of 4 samples), each sample trained once.
    assert len(loop.transport.work) == 4 * 2
    assert sum(w.samples for w in loop.transport.work) == 4 * 2 * 4


async def test_weight_versions_in_memory_go_when_the_run_ends(tiny_model, tmp_path):
    store = tmp_path / "shm"
    store.mkdir()
    loop = Loop(tiny_model, tmp_path / "job", config(tiny_model, steps=3), weights_store=store)
    await loop.run()
    uris = [w.uri for w in loop.transport.weights]
    assert uris and all(str(store / "org" / "job-loop") in uri for uri in uris)
    assert not (store / "org" / "job-loop").exists(), "a finished job's versions are gone"
    assert (loop.runner.root / "checkpoints" / "step-000003").is_dir(), "its checkpoint stays"


async def test_a_group_split_over_work_items_trains_each_sample_once(tiny_model, tmp_path):
    loop = Loop(tiny_model, tmp_path, config(tiny_model, steps=2, max_async=1), samples_per_work=3)
    await loop.run()
    # Groups of 4 as items of at most 3: two items of 2 (as even as they come).
    assert [(w.group_id, w.sample_index, w.samples) for w in loop.transport.work[:2]] == [
        ("0/0", 0, 2),
        ("0/0", 2, 2),
    ]
    assert len({w.id for w in loop.transport.work}) == len(loop.transport.work) == 2 * 2 * 2
    assert [b["count"] for b in loop.events(JobEventType.ROLLOUT_BATCH)] == [8, 8]
    trained = trained_work_ids(tmp_path / "org" / "job-loop" / "checkpoints")
    samples = {str(w.sample_id(i)) for w in loop.transport.work for i in w.sample_indices}
    assert sorted(trained) == sorted(samples)


async def test_a_trajectory_offered_twice_is_trained_once(tiny_model, tmp_path):
    loop = Loop(tiny_model, tmp_path, config(tiny_model, steps=3, max_async=1))
    offer = loop.runner.offer

    def twice(trajectory: Trajectory) -> None:  # at-least-once delivery, exaggerated
        offer(trajectory)
        offer(trajectory.model_copy(update={"rollout_id": "again"}))
        for old in loop.delivered[:3]:  # and late copies of trained ones
            offer(old)

    loop.runner.offer = twice  # type: ignore[method-assign]
    await loop.run()
    batches = loop.events(JobEventType.ROLLOUT_BATCH)
    assert [b["count"] for b in batches] == [8, 8, 8]
    assert len(trained_work_ids(tmp_path / "org" / "job-loop" / "checkpoints")) == 24
    assert Counter(t.work_id for t in loop.delivered).most_common(1)[0][1] == 1
    assert not any(loop.runner.buffer.values()), "late copies of trained steps were kept"


async def test_cancel_stops_with_a_checkpoint_of_the_steps_taken(tiny_model, tmp_path):
    loop = Loop(tiny_model, tmp_path, config(tiny_model, steps=50, max_async=1))
    task = asyncio.create_task(loop.run())
    await eventually(lambda: loop.runner.step >= 2, 60, "two steps trained")
    loop.runner.cancel("enough")
    with pytest.raises(JobCancelled):
        await task
    saved = loop.events(JobEventType.CHECKPOINT_SAVED)
    assert saved and saved[-1]["step"] == loop.runner.step >= 2
    assert (
        tmp_path / "org" / "job-loop" / "checkpoints" / f"step-{saved[-1]['step']:06d}"
    ).is_dir()
    assert loop.runner.cancel_reason == "enough"


async def test_a_resumed_loop_reissues_the_same_work_and_trains_nothing_twice(tiny_model, tmp_path):
    schedule = {"warmup_steps": 1, "decay": "linear", "min_lr_ratio": 0.0}
    job = config(
        tiny_model, steps=4, max_async=1, checkpoint_every=2, optimizer={"schedule": schedule}
    )
    first = Loop(tiny_model, tmp_path, job)
    task = asyncio.create_task(first.run())
    # The learner dies right after step 3, past the checkpoint at step 2: no cancel
    # checkpoint, the job stays running.
    first.runner.on_progress = lambda step: task.cancel() if step == 3 else None
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [c["step"] for c in first.events(JobEventType.CHECKPOINT_SAVED)] == [2]

    second = Loop(tiny_model, tmp_path, job)
    replayed = False

    async def redeliver(_work) -> None:
        # Everything the first run saw comes again (the bus re-reads what no checkpoint
        # settled, and may repeat the rest): none of it may be trained twice.
        nonlocal replayed
        if not replayed:
            replayed = True
            for trajectory in first.delivered:
                second.runner.offer(trajectory)

    second.transport.on_work.insert(0, redeliver)
    await second.run()
    started = [e for e in second.transport.events if e.type is JobEventType.STARTED]
    assert len(started) == 1 and "from step 2" in started[0].message
    assert [s["step"] for s in second.events(JobEventType.TRAIN_STEP)] == [3, 4]
    lr = job.training.optimizer.lr
    rates = {s["step"]: s["learning_rate"] for s in first.events(JobEventType.TRAIN_STEP)}
    assert [rates[step] for step in (1, 2, 3)] == pytest.approx([lr / 2, lr, lr * 2 / 3])
    rates = [s["learning_rate"] for s in second.events(JobEventType.TRAIN_STEP)]
    assert rates == pytest.approx([lr * 2 / 3, lr / 3])  # the schedule goes on from step 2
    assert [b["count"] for b in second.events(JobEventType.ROLLOUT_BATCH)] == [8, 8]
    # The same ids for the same work, so copies from before the restart count as done.
    before = {w.id for w in first.transport.work if w.step in (2, 3)}
    after = {w.id for w in second.transport.work if w.step in (2, 3)}
    assert before == after
    every_sample = {
        str(w.sample_id(i)) for w in first.transport.work if w.step < 4 for i in w.sample_indices
    }
    trained = trained_work_ids(tmp_path / "org" / "job-loop" / "checkpoints")
    assert sorted(trained) == sorted(every_sample)  # each of the 4 x 8 samples, once
    # A checkpoint holds the ids since the one before, not all of them.
    assert len(second.runner.trained) == 0  # cleared by the final checkpoint
    # Weight versions keep rising across the restart (generators roll back to the checkpoint).
    assert second.transport.weights[0].version > first.transport.weights[-1].version


def eval_config(model: Path, steps: int, **training) -> JobConfig:
    job = config(model, steps=steps, **training)
    evaluation = {"every": 2, "at_start": True, "seeds": {"start": 1000, "count": 3}, "samples": 2}
    return JobConfig.model_validate(job.model_dump(mode="json") | {"eval": evaluation})


async def test_eval_rounds_sample_their_steps_weights_and_are_never_trained(tiny_model, tmp_path):
    loop = Loop(tiny_model, tmp_path, eval_config(tiny_model, steps=4, max_async=1))
    await loop.run()
    rounds = loop.events(JobEventType.EVAL_COMPLETED)
    assert [r["step"] for r in rounds] == [0, 2, 4]
    assert all(r["count"] + r["failed"] == 6 and len(r["per_seed"]) == 3 for r in rounds)
    assert all({s["seed"] for s in r["per_seed"]} == {1000, 1001, 1002} for r in rounds)
    # Each round sampled exactly the weights of its step: the version it names, published
    # after that step (the starting model is version 0).
    published = {w["version"]: w["step"] for w in loop.events(JobEventType.WEIGHTS_PUBLISHED)}
    for r in rounds:
        assert r["step"] == published.get(r["version"], 0)
        turns = [
            turn
            for t in loop.delivered
            if t.mode == "eval" and t.step == r["step"]
            for turn in t.turns
        ]
        assert turns and {turn.policy_version for turn in turns} == {r["version"]}
    # Eval rollouts ran the held-out seeds, and none was trained on.
    evals = [t for t in loop.delivered if t.mode == "eval"]
    assert {t.seed for t in evals} == {1000, 1001, 1002} and len(evals) == 18
    root = tmp_path / "org" / "job-loop"
    trained = set(trained_work_ids(root / "checkpoints"))
    assert trained and not trained & {str(t.work_id) for t in evals}
    assert all(t.seed < 1000 for t in loop.delivered if t.mode == "train")
    # Evaluated steps are checkpointed (for <job>@best), and every round is recorded.
    assert [c["step"] for c in loop.events(JobEventType.CHECKPOINT_SAVED)] == [2, 4]
    assert sorted(p.name for p in (root / "evals").iterdir()) == [
        "step-000000.json",
        "step-000002.json",
        "step-000004.json",
    ]


async def test_a_round_cut_short_by_a_restart_runs_again(tiny_model, tmp_path):
    job = eval_config(tiny_model, steps=4, max_async=1)
    first = Loop(tiny_model, tmp_path, job)
    task = asyncio.create_task(first.run())
    # The learner dies once step 3 is trained: after the checkpoint of step 2, whose round
    # it had issued and waited for; but say that round's record was lost with the process.
    first.runner.on_progress = lambda step: task.cancel() if step == 3 else None
    with pytest.raises(asyncio.CancelledError):
        await task
    root = tmp_path / "org" / "job-loop"
    (root / "evals" / "step-000002.json").unlink()

    second = Loop(tiny_model, tmp_path, job)
    replayed = False

    async def redeliver(_work) -> None:
        nonlocal replayed
        if not replayed:  # the trajectories of the first run come again
            replayed = True
            for trajectory in first.delivered:
                second.runner.offer(trajectory)

    second.transport.on_work.insert(0, redeliver)
    await second.run()
    assert [r["step"] for r in second.events(JobEventType.EVAL_COMPLETED)] == [2, 4]
    assert len(list((root / "evals").iterdir())) == 3


async def test_a_job_of_no_steps_evaluates_the_model_as_it_is(tiny_model, tmp_path):
    loop = Loop(tiny_model, tmp_path, eval_config(tiny_model, steps=0))
    await loop.run()
    (only,) = loop.events(JobEventType.EVAL_COMPLETED)
    assert only["step"] == 0 and only["version"] == 0 and only["count"] + only["failed"] == 6
    assert not loop.events(JobEventType.TRAIN_STEP) and not loop.transport.weights
    assert loop.runner.policy is None  # nothing to train: no trainer loaded


async def test_logging_writes_each_trackers_run_as_the_job_goes(tiny_model, tmp_path):
    pytest.importorskip("tensorboard", reason="make setup installs it (the dev extra)")
    pytest.importorskip("mlflow", reason="make setup installs it (the dev extra)")
    pytest.importorskip("wandb", reason="make setup installs it (the dev extra)")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlnode.trackers.mlflow import tracking_uri
    from tests.unit.test_trackers import read_wandb_history

    logging = {"tensorboard": True, "mlflow": True, "wandb": {"project": "copy", "run_name": "r1"}}
    job = eval_config(tiny_model, steps=3, max_async=1)
    job = JobConfig.model_validate(job.model_dump(mode="json") | {"logging": logging})
    loop = Loop(tiny_model, tmp_path, job)
    await loop.run()
    await loop.runner.close_trackers()  # the learner does, with the verdict
    trackers = tmp_path / "org" / "job-loop" / "trackers"
    started = loop.transport.events[0]
    assert f"tensorboard in {trackers / 'tensorboard'}" in started.message
    rewards = [s["reward_mean"] for s in loop.events(JobEventType.TRAIN_STEP)]

    board = EventAccumulator(str(trackers / "tensorboard" / "job-loop"))
    board.Reload()
    assert [s.value for s in board.Scalars("train/reward_mean")] == pytest.approx(rewards)
    assert [s.step for s in board.Scalars("eval/reward_mean")] == [0, 2, 3]

    client = MlflowClient(tracking_uri(str(trackers / "mlflow")))
    (run,) = client.search_runs([client.get_experiment_by_name("rlnode").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [m.step for m in history] == [1, 2, 3]

    rows = [r for r in read_wandb_history(trackers / "wandb") if "train/reward_mean" in r]
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert [r["train/reward_mean"] for r in rows] == pytest.approx(rewards)
    assert list((trackers / "wandb" / "wandb").glob("offline-run-*"))


async def test_a_tool_calling_task_trains_on_exactly_the_tokens_sampled(tool_model, tmp_path):
    """The calculator Task App over several turns: the calls the model writes reach the
    episode as `tool_calls`, their results come back as tool messages in the next turn's
    prompt, and every turn trained is exactly what the engine sampled (ids and logprobs)."""
    job = config(
        tool_model, steps=2, max_async=0, prompts_per_step=2, group_size=4, optimizer={"lr": 1e-5}
    )
    job = job.model_copy(
        update={
            "sampling": job.sampling.model_copy(update={"max_tokens": 96}),
            "task_app": job.task_app.model_copy(update={"env_config": {"max_turns": 3}}),
        }
    )
    loop = Loop(tool_model, tmp_path, job, task_app=calculator.DEFINITION)
    sampled: list[tuple[list[int], list[int], list[float]]] = []
    generate = loop.engine.generate

    async def recording(request):
        result = await generate(request)
        sampled.append((list(request.prompt_ids), result.completion_ids, result.logprobs))
        return result

    loop.engine.generate = recording  # type: ignore[method-assign]
    await loop.run()
    assert [s["step"] for s in loop.events(JobEventType.TRAIN_STEP)] == [1, 2]
    tokenizer = loop.engine.tokenizer
    several = [t for t in loop.delivered if t.status == "ok" and len(t.turns) >= 2]
    assert several, "no episode went past its first turn"
    for trajectory in several:
        for before, after in zip(trajectory.turns, trajectory.turns[1:], strict=False):
            written = tokenizer.decode(before.completion_ids, skip_special_tokens=True)
            _content, calls = parse_tool_calls(written)
            assert calls, f"a turn that led to another called no tool: {written!r}"
            shown = tokenizer.decode(after.prompt_ids)
            for call in calls:
                result, _ok = calculator.run_call(call)
                assert f"<tool_response>\n{result}\n</tool_response>" in shown
            # The next prompt holds this turn's prompt as it was.
            assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    engine_said = {(tuple(p), tuple(c)): lp for p, c, lp in sampled}
    for trajectory in loop.delivered:
        for turn in trajectory.turns:
            key = (tuple(turn.prompt_ids), tuple(turn.completion_ids))
            assert engine_said.get(key) == turn.logprobs, "a turn differs from what was sampled"


def _tied_below(first_refill_seed: int) -> TaskAppDefinition:
    """The copy task, except that questions of seeds below `first_refill_seed` (the steps'
    own) give every answer the same reward: a group that teaches nothing."""

    def make_task(seed: int, env: dict) -> dict:
        return {**copy_task.make_task(seed, env), "tied": seed < first_refill_seed}

    def reward(task: dict, answer: str) -> float:
        return 0.5 if task["tied"] else copy_task.reward(task, answer)

    from rlnode.taskapp import single_turn

    return TaskAppDefinition(
        name="copy-task",
        make_task=make_task,
        run_episode=single_turn(copy_task.prompt, reward),
    )


async def test_dapo_dynamic_sampling_refills_tied_groups_with_new_questions(tiny_model, tmp_path):
    job = config(tiny_model, steps=2, max_async=0, algorithm="dapo", dapo={"max_refills": 2})
    own = job.training.steps * job.training.prompts_per_step  # seeds 0..3: all tied
    loop = Loop(tiny_model, tmp_path, job, task_app=_tied_below(own))
    await loop.run()
    steps = loop.events(JobEventType.TRAIN_STEP)
    assert [s["step"] for s in steps] == [1, 2]
    for step, trained in zip((0, 1), steps, strict=True):
        work = [w for w in loop.transport.work if w.step == step]
        assert [w.seed for w in work[:2]] == [step * 2, step * 2 + 1]  # the step's own, tied
        # Then refill rounds of new questions (seeds past every step's own) until two groups
        # differ: round r asks group r*2+p the refill seed (step, r, p).
        refills = work[2:]
        assert refills and all(w.seed >= own for w in refills)
        rounds = []
        for w in refills:
            round_, p = divmod(int(w.group_id.split("/")[1]), 2)
            assert w.seed == job.refill_seed_index(step, round_, p)
            rounds.append(round_)
        differing = differing_groups([t for t in loop.delivered if t.step == step])
        assert len(differing) >= 2 or max(rounds) == 2  # two differ, or no refills are left
        # Only groups that differ are trained: up to prompts_per_step of them.
        assert trained["trained_samples"] == 4 * min(2, len(differing))
    rollouts = [b["count"] for b in loop.events(JobEventType.ROLLOUT_BATCH)]
    assert rollouts == [4 * sum(w.step == s for w in loop.transport.work) for s in (0, 1)]


LORA = {"rank": 4, "alpha": 8, "modules_to_save": ["embed_tokens"]}


async def test_a_lora_job_syncs_adapters_and_resumes_from_an_adapter_checkpoint(
    tiny_model, tmp_path
):
    job = config(tiny_model, steps=4, max_async=1, checkpoint_every=2, lora=LORA)
    first = Loop(tiny_model, tmp_path, job)
    task = asyncio.create_task(first.run())
    first.runner.on_progress = lambda step: task.cancel() if step == 3 else None
    with pytest.raises(asyncio.CancelledError):
        await task
    full = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors"))
    versions = first.transport.weights
    assert versions and all(v.adapter is not None and v.size_bytes < full for v in versions)
    checkpoint = tmp_path / "org" / "job-loop" / "checkpoints" / "step-000002"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    # The generator served each version: its engine's logprobs are the trainer's.
    probe = versions[-1].probe
    (served,) = await first.engine.score([probe.token_ids])
    assert served == pytest.approx(probe.logprobs, abs=1e-4)

    second = Loop(tiny_model, tmp_path, job)
    await second.run()
    started = [e for e in second.transport.events if e.type is JobEventType.STARTED]
    assert "from step 2" in started[0].message
    # Resumed from the adapters: its first version (the checkpoint's) scores as the first
    # run's step-2 version did.
    at_step_2 = next(v for v in versions if v.step == 2)
    assert second.transport.weights[0].probe.logprobs == pytest.approx(
        at_step_2.probe.logprobs, abs=1e-5
    )
    assert [s["step"] for s in second.events(JobEventType.TRAIN_STEP)] == [3, 4]


async def test_lora_targets_the_model_lacks_fail_the_job_saying_which(tiny_model, tmp_path):
    job = config(tiny_model, steps=1, lora={"rank": 4, "target_modules": ["c_attn"]})
    loop = Loop(tiny_model, tmp_path, job)
    with pytest.raises(JobFailed, match=r"target_modules \['c_attn'\] are not modules"):
        await loop.run()


async def test_a_curriculum_issues_work_at_its_level_and_reports_it(tiny_model, tmp_path):
    # The copy task reads `length` from its env config: the level is the string's length.
    job = config(tiny_model, steps=3, max_async=0)
    spec = CurriculumSpec(key="length", start=1, max_level=2, threshold=0.0, patience=1)
    task_app = job.task_app.model_copy(update={"curriculum": spec})
    loop = Loop(tiny_model, tmp_path, job.model_copy(update={"task_app": task_app}))
    await loop.run()
    steps = loop.events(JobEventType.TRAIN_STEP)
    assert [s["curriculum_level"] for s in steps] == [2, 2, 2]
    issued = {w.step: w.task_app.env_config["length"] for w, _ in loop.issued_while_at}
    assert issued == {0: 1, 1: 2, 2: 2}
    # What the Task App reported about its rollouts, averaged per step.
    assert steps[0]["task_metrics"]["inference_calls"] == 1.0
    state = (tmp_path / "org" / "job-loop" / "checkpoints").glob("step-*/trainer_state.json")
    assert [json.loads(p.read_text())["curriculum_level"] for p in sorted(state)][-1] == 2
