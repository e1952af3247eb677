"""One job's training loop: issue rollout work at most `max_async` policy versions ahead,
gather each step's trajectories (deduplicated by work id), take a GRPO step, publish
weights and checkpoints, evaluate on held-out seeds where the job asks (its rounds are in
rlnode.training.evaluation), and report every step as a job event.

The loop knows no wire: records leave through a `JobTransport` (the bus in the learner,
memory in tests and benchmarks) and trajectories arrive through `offer`, from whoever
reads them."""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rlnode.messages import (
    EventData,
    JobConfig,
    JobEvent,
    JobEventType,
    RolloutWork,
    Trajectory,
    sample_id,
)
from rlnode.messages.jobs import RolloutBatchData, RolloutSampleData, TrainStepData
from rlnode.models.gguf import GgufError
from rlnode.service.registry import LEARNER
from rlnode.service.stores import job_dir
from rlnode.trackers.live import LiveTrackers
from rlnode.training.breaker import Probe, TaskAppBreaker, TaskAppDown
from rlnode.training.curriculum import Curriculum
from rlnode.training.distributed import DataParallelError
from rlnode.training.evaluation import (
    EvalRound,
    eval_message,
    eval_work,
    evals_dir,
    record_round,
    recorded_rounds,
    summarise,
)
from rlnode.training.grpo import TIED, group_advantages, sample_batch
from rlnode.training.losses import loss_class
from rlnode.training.losses.dapo import overlong_shaped
from rlnode.training.model_source import with_imported_model
from rlnode.training.policy import JobCancelled, JobFailed, Policy
from rlnode.training.rank_hosts import RankHub
from rlnode.training.samples import describe, pick, task_metrics
from rlnode.training.schedule import learning_rate_at
from rlnode.training.storage import remove_temporaries
from rlnode.training.trainer import TrainerConfig
from rlnode.training.transport import JobTransport

__all__ = ["JobCancelled", "JobFailed", "JobRunner", "trained_work_ids", "work_id"]
log = logging.getLogger("rlnode.training.loop")


def prompt_index(trajectory: Trajectory) -> int:
    """The prompt of a training trajectory within its step (group ids are "step/prompt")."""
    return int(trajectory.group_id.rpartition("/")[2])


def differing_groups(trajectories: list[Trajectory]) -> dict[str, None]:
    """The groups (in order of first appearance) whose ok rewards are not all equal."""
    rewards: dict[str, list[float]] = defaultdict(list)
    for x in trajectories:
        if x.status == "ok" and x.reward is not None:
            rewards[x.group_id].append(x.reward)
    return {g: None for g, r in rewards.items() if len(r) > 1 and max(r) - min(r) > TIED}


def work_id(job_id: str, step: int, prompt: int, sample: int) -> uuid.UUID:
    """The id of one training sample's trajectory. Deterministic, so that work re-issued
    after a restart is recognised as the same."""
    return sample_id(job_id, f"{step}/{prompt}", sample)


class JobRunner:
    def __init__(
        self,
        job_id: str,
        org_id: str,
        config: JobConfig,
        transport: JobTransport,
        checkpoint_root: Path,
        devices: list[str],
        step_timeout_s: float,
        on_progress: Callable[[int], None] = lambda _step: None,
        source: str = LEARNER.name,
        reference_device: str | None = None,
        weights_dir: Path | None = None,
        weights_dtype: str = "float32",
        max_checkpoint_bytes: int | None = None,
        probe: Probe | None = None,
        disk_full_wait_s: float = 600.0,
        samples_per_work: int = 16,
        model_store: Path | None = None,
        rank_hosts: RankHub | None = None,
        collective_timeout_s: float = 600.0,
    ) -> None:
        """`weights_dir`: the weights store, where weight versions go when it has room
        (None: beside the checkpoints); `weights_dtype`: the engines' dtype, which they are
        written in; `probe`: asks whether the Task App answers, for the breaker (None: no
        breaker, as in the in-process benchmarks, which have no gateway to ask);
        `disk_full_wait_s`: how long a write waits for room in a full store before the job
        fails (rlnode.training.storage); `samples_per_work`: samples of a group in one work
        item (a generator runs them together; fewer spread a group over more generators);
        `model_store`: where a GGUF model.source is imported to (None: GGUF is not taken);
        `rank_hosts`: the rendezvous of other hosts' training ranks, which the job trains on
        beside `devices` (rlnode.training.rank_hosts); `collective_timeout_s`: how long this
        host's training ranks wait for each other in one collective before the job fails
        with the stacks of those that live."""
        self.job_id, self.org_id, self.config = job_id, org_id, config
        self.transport = transport
        self.root = job_dir(checkpoint_root, org_id, job_id)
        self.devices = devices
        self.rank_hosts = rank_hosts
        self.collective_timeout_s = collective_timeout_s
        self.reference_device = reference_device
        self.weights_root = weights_dir
        self.weights_dtype = weights_dtype
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.disk_full_wait_s = disk_full_wait_s
        self.samples_per_work = samples_per_work
        self.model_store = model_store
        self.step_timeout_s = step_timeout_s
        self.on_progress = on_progress
        self.source = source
        t = config.training
        self.per_step = t.prompts_per_step * t.group_size
        self.buffer: dict[int, dict[uuid.UUID, Trajectory]] = defaultdict(dict)
        self.arrived = asyncio.Event()
        # Work ids trained on since the last checkpoint (earlier steps are settled: their
        # trajectories are refused by step), so the set and each checkpoint stay bounded.
        self.trained: set[str] = set()
        self.step = 0  # optimizer steps done
        self.issued = -1  # highest step whose work was published
        self.checkpointed_step = -1  # steps < this + 1 are settled
        self.cancelled = asyncio.Event()
        self.cancel_reason = "cancelled by request"
        # The trainer, weight versions and checkpoints (made once the model is known).
        self.policy: Policy | None = None
        self.breaker = (
            TaskAppBreaker(t.breaker, config.task_app.name, probe) if probe is not None else None
        )
        # Evaluation rounds (the job's [eval]): the steps due, those recorded in the job's
        # directory, those running, and trajectories of a round not (again) issued yet
        # (read back after a restart before the round is issued again).
        self.eval_steps = frozenset(config.eval_steps())
        self.evaluated: set[int] = set()
        self.evals: dict[int, EvalRound] = {}
        self.early_evals: dict[int, dict[uuid.UUID, Trajectory]] = defaultdict(dict)
        # The job's [logging]: its events into trackers under its directory, as they happen.
        self.trackers: LiveTrackers | None = None
        self.curriculum = Curriculum(config.task_app.curriculum)

    @property
    def version(self) -> int:
        """The newest weight version published (0: the model as it was loaded)."""
        return self.policy.version if self.policy is not None else 0

    @property
    def waiting_for_room(self) -> str | None:
        """Why the job waits for room in a store, while it does (None: it does not)."""
        return self.policy.waiting_for_room if self.policy is not None else None

    @property
    def _policy(self) -> Policy:
        assert self.policy is not None, "the job's policy is made when it starts training"
        return self.policy

    # -- trajectories in ------------------------------------------------------------------

    def offer(self, trajectory: Trajectory) -> None:
        """A trajectory of this job arrived (possibly again)."""
        if trajectory.mode == "eval":
            self._offer_eval(trajectory)
            return
        if trajectory.step < self.step or str(trajectory.work_id) in self.trained:
            return  # already trained on this step
        self.buffer[trajectory.step].setdefault(trajectory.work_id, trajectory)
        self.arrived.set()

    def _offer_eval(self, trajectory: Trajectory) -> None:
        if trajectory.step in self.evaluated or trajectory.step not in self.eval_steps:
            return
        running = self.evals.get(trajectory.step)
        results = running.results if running else self.early_evals[trajectory.step]
        results.setdefault(trajectory.work_id, trajectory)
        self.arrived.set()

    def settled(self, trajectory_step: int) -> bool:
        """Whether a trajectory of this step is covered by a durable checkpoint (an
        evaluation round is recorded before any later checkpoint is saved)."""
        return trajectory_step <= self.checkpointed_step

    def cancel(self, reason: str | None = None) -> None:
        self.cancel_reason = reason or self.cancel_reason
        self.cancelled.set()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        if self.model_store is not None:
            try:
                self.config = await asyncio.to_thread(
                    with_imported_model, self.config, self.model_store
                )
            except GgufError as e:
                raise JobFailed(f"model.source could not be imported: {e}") from None
        t = self.config.training
        if self.config.logging is not None and self.trackers is None:
            self.trackers = LiveTrackers(self.job_id, self.config.logging, self.root / "trackers")
        if t.steps == 0:
            await self._evaluate_only()
            return
        self.policy = self._make_policy()
        try:
            try:
                await self.policy.start()
            except DataParallelError as e:  # a rank host missing, or unable to load the model
                raise JobFailed(f"the training ranks could not start: {e}") from None
            except ValueError as e:  # the config does not fit the model (e.g. LoRA targets)
                raise JobFailed(f"the model cannot be trained as configured: {e}") from None
            await self._run()
        except DataParallelError as e:  # a rank exited or stopped answering
            raise JobFailed(f"training stopped at step {self.step}: {e}") from None
        finally:
            await self.policy.close()

    def _make_policy(self) -> Policy:
        t = self.config.training
        return Policy(
            self.job_id,
            self.org_id,
            self.root,
            self.config.model.source,
            TrainerConfig.for_job(self.config),
            self.devices,
            publish_weights=self.transport.publish_weights,
            event=self._event,
            cancelled=self.cancelled,
            # Generators may still be loading the last few versions (up to max_async behind).
            kept_versions=t.max_async + 2,
            adapter=t.lora,
            reference_on_trainer=t.kl_coef > 0
            and self.config.topology.reference in ("trainer", "dedicated"),
            reference_device=self.reference_device
            if self.config.topology.reference == "dedicated"
            else None,
            rank_hosts=self.rank_hosts,
            collective_timeout_s=self.collective_timeout_s,
            weights_root=self.weights_root,
            weights_dtype=self.weights_dtype,
            max_checkpoint_bytes=self.max_checkpoint_bytes,
            disk_full_wait_s=self.disk_full_wait_s,
        )

    async def _run(self) -> None:
        t = self.config.training
        resumed = await self._resume()
        await self._event(
            JobEventType.STARTED,
            f"training from step {self.step} of {t.steps}"
            + (" (resumed)" if resumed else "")
            + self._tracked_where(),
        )
        if resumed:
            await self._publish_weights()
        # The starting model (eval.at_start), or a round a restart cut short.
        await self._start_eval(self.step)
        for step in range(self.step, min(self.step + t.max_async, t.steps - 1) + 1):
            await self._issue(step)
        while self.step < t.steps:
            if self.cancelled.is_set():
                await self._stop_for_cancel()
            waited_from = time.perf_counter()
            try:
                trajectories = await self._gather(self.step)
            except JobCancelled:
                await self._stop_for_cancel()
            try:
                trajectories = await self._refill(self.step, trajectories)
            except JobCancelled:
                await self._stop_for_cancel()
            self.buffer.pop(self.step, None)
            wait_s = time.perf_counter() - waited_from
            await self._train(self.step, trajectories, wait_s)
            await self._pause_while_failing(trajectories)
            # A step to evaluate gets its weights published (the round samples them) and a
            # checkpoint (which <job>@best serves).
            evaluate = self.step in self.eval_steps
            if self.step % t.weight_sync_every == 0 or evaluate:
                await self._publish_weights()
            # After publishing: the new work is tagged with the version it may be sampled
            # from at the earliest, which bounds its staleness by max_async.
            if self.step + t.max_async < t.steps:
                await self._issue(self.step + t.max_async)
            if self.step % t.checkpoint_every == 0 or self.step == t.steps or evaluate:
                await self._checkpoint(final=self.step == t.steps)
            await self._start_eval(self.step)
            self.on_progress(self.step)
        await self._finish_evals()

    async def _evaluate_only(self) -> None:
        """A job of no training steps: one round on the model as it is (weight version 0,
        which the generators load from model.source)."""
        self.evaluated = await asyncio.to_thread(recorded_rounds, self.root)
        spec = self.config.eval
        assert spec is not None, "JobConfig refuses 0 steps without [eval]"
        await self._event(
            JobEventType.STARTED,
            f"evaluating {self.config.model.source} on {spec.seeds.count} held-out seeds"
            + self._tracked_where(),
        )
        await self._start_eval(0)
        await self._finish_evals()

    # -- evaluation ---------------------------------------------------------------------------

    async def _start_eval(self, step: int) -> None:
        """Issue the round of `step` on the newest weights, if one is due and not recorded;
        training goes on while it runs."""
        if step not in self.eval_steps or step in self.evaluated or step in self.evals:
            return
        task_app = self.curriculum.task_app(self.config.task_app)
        work = eval_work(
            self.job_id,
            self.org_id,
            self.config,
            step,
            self.version,
            self.samples_per_work,
            task_app,
        )
        round_ = EvalRound(
            step,
            self.version,
            expected=sum(w.samples for w in work),
            curriculum_level=self.curriculum.level,
        )
        round_.results.update(self.early_evals.pop(step, {}))
        self.evals[step] = round_
        await self.transport.publish_work(work)

    async def _finish_evals(self) -> None:
        """Wait for the running rounds, then report and record each (reported first: a
        crash in between runs the round again, and the event says the same twice)."""
        spec = self.config.eval
        for step in sorted(self.evals):
            round_ = self.evals[step]
            await self._wait_for_round(round_)
            assert spec is not None, "a round runs only for a job with [eval]"
            data = summarise(round_, spec)
            message = eval_message(data)
            if self.curriculum.observe("eval", data.pass_at_1):
                message += f"; curriculum level raised to {self.curriculum.level}"
            await self._event(JobEventType.EVAL_COMPLETED, message, data)
            await asyncio.to_thread(record_round, self.root, data)
            self.evaluated.add(step)
            del self.evals[step]

    async def _pause_while_failing(self, trajectories: list[Trajectory]) -> None:
        """The Task App breaker (rlnode.training.breaker): after the step that trips it,
        publish no weights and issue no work until the Task App answers. That step stays
        trained, as any step with failed rollouts is; after the last step there is nothing
        left to protect."""
        if self.breaker is None or self.step >= self.config.training.steps:
            return
        paused = self.breaker.judge(self.step - 1, trajectories)
        if paused is None:
            return
        await self._event(JobEventType.PAUSED, self.breaker.paused_message(paused), paused)
        try:
            resumed = await self.breaker.hold(self.cancelled, self.issued)
        except TaskAppDown as e:
            raise JobFailed(str(e)) from None
        if resumed is None:
            await self._stop_for_cancel()  # cancelled while paused
        else:
            await self._event(JobEventType.RESUMED, self.breaker.resumed_message(resumed), resumed)

    async def _wait_for_round(self, round_: EvalRound) -> None:
        await self._wait_until(
            lambda: round_.complete,
            round_.started + self.step_timeout_s,
            lambda: (
                f"the evaluation of step {round_.step} got {len(round_.results)} of "
                f"{round_.expected} rollouts in {self.step_timeout_s:g}s: are "
                "rollout-generators running and healthy?"
            ),
        )

    async def _stop_for_cancel(self) -> None:
        """Keep what was learned: a checkpoint of the steps taken (the run can be served or
        looked at like any other), then stop (leaving running evaluation rounds)."""
        if self.step > 0 and self.checkpointed_step < self.step - 1:
            await self._checkpoint(final=False, after_evals=False)
        raise JobCancelled

    async def _issue(self, step: int) -> None:
        if step <= self.issued:
            return
        t = self.config.training
        prompts = [
            (prompt, self.config.seed_of(step * t.prompts_per_step + prompt))
            for prompt in range(t.prompts_per_step)
        ]
        await self.transport.publish_work(self._work(step, prompts))
        self.issued = step

    def _work(self, step: int, prompts: list[tuple[int, int]]) -> list[RolloutWork]:
        """The rollout work of groups (prompt index, seed) of a step."""
        t = self.config.training
        task_app = self.curriculum.task_app(self.config.task_app)
        work: list[RolloutWork] = []
        for prompt, seed in prompts:
            group = RolloutWork(
                job_id=self.job_id,
                org_id=self.org_id,
                step=step,
                policy_version=self.version,
                group_id=f"{step}/{prompt}",
                seed=seed,
                sample_index=0,
                samples=t.group_size,
                group_size=t.group_size,
                model=self.config.model,
                task_app=task_app,
                sampling=self.config.sampling,
                lora=t.lora,
            )
            work.extend(group.split(self.samples_per_work))
        return work

    async def _refill(self, step: int, trajectories: list[Trajectory]) -> list[Trajectory]:
        """DAPO's dynamic sampling: while fewer than prompts_per_step groups of the step have
        rewards that differ, sample that many more prompts (new seeds, a round at a time, at
        most `max_refills` rounds). Returns the step's trajectories: the first
        prompts_per_step groups that differ, then the tied ones (trained on by nobody, but
        counted in the step's events)."""
        t = self.config.training
        dapo = t.dapo_options
        if dapo is None or not dapo.dynamic_sampling:
            return trajectories
        per_round = t.prompts_per_step
        for round_ in range(1, dapo.max_refills + 1):
            missing = per_round - len(differing_groups(trajectories))
            if missing <= 0:
                break
            prompts = [
                (
                    round_ * per_round + p,
                    self.config.seed_of(self.config.refill_seed_index(step, round_, p)),
                )
                for p in range(missing)
            ]
            groups = {f"{step}/{prompt}" for prompt, _ in prompts}
            await self.transport.publish_work(self._work(step, prompts))
            trajectories = trajectories + await self._wait_for_groups(
                step, groups, missing * t.group_size, f"step {step}'s refill round {round_}"
            )
        differing = differing_groups(trajectories)
        kept = set(list(differing)[:per_round])
        return [x for x in trajectories if x.group_id in kept] + [
            x for x in trajectories if x.group_id not in differing
        ]

    async def _wait_for_groups(
        self, step: int, groups: set[str], expected: int, what: str
    ) -> list[Trajectory]:
        def arrived() -> list[Trajectory]:
            return [x for x in self.buffer[step].values() if x.group_id in groups]

        await self._wait_until(
            lambda: len(arrived()) >= expected,
            time.monotonic() + self.step_timeout_s,
            lambda: (
                f"{what} got {len(arrived())} of {expected} trajectories in "
                f"{self.step_timeout_s:g}s: are rollout-generators running and healthy?"
            ),
        )
        return arrived()

    async def _gather(self, step: int) -> list[Trajectory]:
        """The step's own groups (a DAPO refill's, which a restart may deliver early, stay
        in the buffer for `_refill`)."""
        per_step = self.config.training.prompts_per_step

        def own() -> list[Trajectory]:
            return [x for x in self.buffer[step].values() if prompt_index(x) < per_step]

        await self._wait_until(
            lambda: len(own()) >= self.per_step,
            time.monotonic() + self.step_timeout_s,
            lambda: (
                f"step {step} got {len(own())} of {self.per_step} trajectories in "
                f"{self.step_timeout_s:g}s: are rollout-generators running and healthy?"
            ),
        )
        return own()

    async def _wait_until(
        self, done: Callable[[], bool], deadline: float, timed_out: Callable[[], str]
    ) -> None:
        """Until `done()` as trajectories arrive; JobFailed past the (monotonic) deadline,
        JobCancelled on a cancel."""
        while not done():
            if self.cancelled.is_set():
                raise JobCancelled
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobFailed(timed_out())
            self.arrived.clear()
            cancel = asyncio.ensure_future(self.cancelled.wait())
            arrive = asyncio.ensure_future(self.arrived.wait())
            await asyncio.wait(
                {cancel, arrive}, timeout=min(remaining, 5.0), return_when=asyncio.FIRST_COMPLETED
            )
            cancel.cancel()
            arrive.cancel()

    async def _train(self, step: int, trajectories: list[Trajectory], wait_s: float) -> None:
        trainer = self._policy.started
        ok = [t for t in trajectories if t.status == "ok"]
        rewards = [t.reward for t in ok if t.reward is not None]
        reward_mean = statistics.fmean(rewards) if rewards else None
        reward_std = statistics.pstdev(rewards) if rewards else None
        await self._event(
            JobEventType.ROLLOUT_BATCH,
            f"step {step}: {len(ok)} of {len(trajectories)} rollouts ok",
            RolloutBatchData(
                step=step,
                count=len(trajectories),
                failed=len(trajectories) - len(ok),
                reward_mean=reward_mean,
                reward_std=reward_std,
                failures=sorted({t.failure.kind for t in trajectories if t.failure}),
            ),
        )
        await self._show_samples(step, trajectories)
        advantages = group_advantages(
            self._shaped(ok), scale_by_std=loss_class(self.config.training.algorithm).scale_by_std
        )
        batch = sample_batch(ok, advantages)
        staleness = [self.version - s.policy_version for s in batch.samples]
        samples = [s for s in batch.samples if s.advantage != 0.0]
        started = time.perf_counter()
        # Data parallel needs a sample per rank; a batch with fewer to learn from is skipped.
        if len(samples) >= trainer.world:
            metrics = await self._policy.on_trainer_thread(trainer.step, samples, step)
            loss, kl, clip, tokens = metrics.loss, metrics.kl, metrics.clip_fraction, metrics.tokens
            mismatch_kl, micro_batch_tokens = metrics.mismatch_kl, metrics.micro_batch_tokens
            grad_norm: float | None = metrics.grad_norm
        else:  # every group tied: nothing to learn from this batch, but the step counts
            loss, kl, clip, tokens, mismatch_kl, micro_batch_tokens = 0.0, None, 0.0, 0, None, 0
            grad_norm = None
        compute_s = time.perf_counter() - started
        self.trained.update(str(t.work_id) for t in trajectories)
        self.step = step + 1
        t = self.config.training
        shown = f"{reward_mean:.3f}" if reward_mean is not None else "nan"
        message = f"step {self.step}/{t.steps}: reward {shown}, loss {loss:.4f}"
        if self.curriculum.observe("train", reward_mean):
            message += f"; curriculum level raised to {self.curriculum.level}"
        await self._event(
            JobEventType.TRAIN_STEP,
            message,
            TrainStepData(
                step=self.step,
                total_steps=t.steps,
                loss=loss,
                reward_mean=reward_mean or 0.0,
                reward_std=reward_std or 0.0,
                kl=kl,
                clip_fraction=clip,
                staleness_min=min(staleness, default=0),
                staleness_mean=statistics.fmean(staleness) if staleness else 0.0,
                staleness_max=max(staleness, default=0),
                tokens_per_s=tokens / compute_s if compute_s > 0 else 0.0,
                wait_s=wait_s,
                compute_s=compute_s,
                generation_s=max((t.duration_s for t in trajectories), default=0.0),
                trained_samples=len(samples),
                micro_batch_tokens=micro_batch_tokens or None,
                world_size=trainer.world,
                failed_rollouts=len(trajectories) - len(ok),
                merged_trajectories=batch.merged_trajectories,
                per_turn_trajectories=batch.per_turn_trajectories,
                mismatch_kl=mismatch_kl,
                learning_rate=learning_rate_at(t.optimizer, step, t.steps),
                grad_norm=grad_norm,
                curriculum_level=self.curriculum.level,
                task_metrics=task_metrics(ok),
            ),
        )

    async def _show_samples(self, step: int, trajectories: list[Trajectory]) -> None:
        """A few of the step's episodes as text (`rollout.sample`), for people to read."""
        chosen = pick(trajectories, self.config.training.rollout_samples)
        if not chosen:
            return
        tokenizer = self._policy.started.tokenizer
        samples = [describe(x, tokenizer) for x in chosen]
        await self._event(
            JobEventType.ROLLOUT_SAMPLE,
            f"step {step}: {len(samples)} of {len(trajectories)} episodes",
            RolloutSampleData(step=step, episodes=len(trajectories), samples=samples),
        )

    def _shaped(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """The trajectories with the rewards advantages are computed from: DAPO's overlong
        penalty on the longest completion of each (the events report the Task App's)."""
        dapo = self.config.training.dapo_options
        if dapo is None or dapo.overlong_buffer == 0:
            return trajectories
        max_tokens = self.config.sampling.max_tokens
        shaped = []
        for x in trajectories:
            if x.reward is None:
                shaped.append(x)
                continue
            longest = max((len(turn.completion_ids) for turn in x.turns), default=0)
            reward = overlong_shaped(
                x.reward, longest, max_tokens, dapo.overlong_buffer, dapo.overlong_penalty
            )
            shaped.append(x.model_copy(update={"reward": reward}))
        return shaped

    # -- weights and checkpoints ------------------------------------------------------------

    async def _publish_weights(self) -> None:
        # A running evaluation round samples the newest weights: they stay until it is in.
        await self._finish_evals()
        await self._policy.publish_weights(self.step)

    async def _checkpoint(self, final: bool, after_evals: bool = True) -> None:
        """`after_evals`: first wait for the running evaluation rounds, so that the
        trajectories this checkpoint settles include theirs only once they are recorded."""
        if after_evals:
            await self._finish_evals()
        state = {
            "sampler_position": self.step * self.config.training.prompts_per_step,
            # The steps since the previous checkpoint; the chain of checkpoints holds all.
            "trained_work_ids": sorted(self.trained),
            "previous_checkpoint_step": self.checkpointed_step + 1,
            "final": final,
            # What `rlnode job eval` runs a checkpoint with (its Task App, its sampling).
            "job_config": self.config.model_dump(mode="json"),
            **self.curriculum.state(),
        }
        await self._policy.save_checkpoint(f"step-{self.step:06d}", self.step, state, final)
        self.checkpointed_step = self.step - 1
        self.trained.clear()

    async def _resume(self) -> bool:
        # What writes cut short by a crash left (no reader takes it; see training.storage).
        if removed := await asyncio.to_thread(remove_temporaries, evals_dir(self.root)):
            log.warning("job %s: removed unfinished writes %s", self.job_id, removed)
        state = await self._policy.resume()
        self.evaluated = await asyncio.to_thread(recorded_rounds, self.root)
        if state is None:
            return False
        self.step = state["step"]
        self.curriculum.restore(state)
        self.trained = set()
        self.checkpointed_step = self.step - 1
        for step in list(self.buffer):
            if step < self.step:
                del self.buffer[step]
        return True

    async def _event(self, kind: JobEventType, message: str, data: EventData | None = None) -> None:
        event = JobEvent.of(self.job_id, self.org_id, self.source, kind, message, data)
        await self.transport.publish_event(event)
        if self.trackers is not None:
            self.trackers.log(event)

    def _tracked_where(self) -> str:
        return f"; metrics to {self.trackers.where()}" if self.trackers is not None else ""

    async def close_trackers(self, verdict: JobEvent | None = None) -> None:
        """The job is over (`verdict`: how it ended, which the learner publishes): write it
        and close the trackers."""
        trackers, self.trackers = self.trackers, None
        if trackers is None:
            return
        if verdict is not None:
            trackers.log(verdict)
        await asyncio.to_thread(trackers.close)


def trained_work_ids(checkpoints: Path) -> list[str]:
    """Every work id the newest checkpoint under `checkpoints` was trained on, in step
    order, from the chain of checkpoints behind it (each holds the ids since the one
    before). An id listed twice was trained twice."""
    states = {
        int(path.parent.name.removeprefix("step-")): json.loads(path.read_text())
        for path in checkpoints.glob("step-*/trainer_state.json")
    }
    chain: list[list[str]] = []
    step = max(states, default=0)
    while step > 0:
        if step not in states:
            raise FileNotFoundError(f"the checkpoint of step {step} is missing under {checkpoints}")
        chain.append(states[step]["trained_work_ids"])
        previous = states[step]["previous_checkpoint_step"]
        if previous >= step:
            raise ValueError(f"the checkpoint of step {step} names {previous} as the one before")
        step = previous
    return [work for ids in reversed(chain) for work in ids]
