"""Held-out evaluation while training (a job's `[eval]` section): the work of one round,
what its trajectories add up to, and where rounds are recorded in the job's directory.

A round runs the held-out seeds on the weights of one step with the Task App's mode "eval";
its rollouts are never trained on. The loop (rlnode.training.loop) issues a round after
publishing that step's weights and lets training go on, but publishes no newer weights (and
saves no later checkpoint) until the round is in: so every rollout of the round samples the
weights it names, and a checkpoint after it means the round was recorded."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rlnode.messages import JobConfig, RolloutWork, SamplingSpec, TaskAppSpec, Trajectory
from rlnode.messages.config import EvalSpec
from rlnode.messages.jobs import EvalCompletedData, SeedEval
from rlnode.training.samples import task_metrics
from rlnode.training.storage import temporary_sibling


@dataclass
class EvalRound:
    step: int
    version: int
    expected: int
    started: float = field(default_factory=time.monotonic)
    curriculum_level: int | None = None
    results: dict[uuid.UUID, Trajectory] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.results) >= self.expected


def eval_sampling(config: JobConfig) -> SamplingSpec:
    spec = _spec(config)
    return SamplingSpec(
        max_tokens=spec.max_tokens or config.sampling.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
    )


def eval_work(
    job_id: str,
    org_id: str,
    config: JobConfig,
    step: int,
    version: int,
    samples_per_work: int,
    task_app: TaskAppSpec | None = None,
) -> list[RolloutWork]:
    """Every held-out seed, `samples` times, to sample from weight version `version`
    (with `task_app`, the job's at its curriculum level, in place of the config's)."""
    spec = _spec(config)
    sampling = eval_sampling(config)
    work = []
    for seed in spec.seeds.range:
        group = RolloutWork(
            job_id=job_id,
            org_id=org_id,
            step=step,
            policy_version=version,
            group_id=f"eval/{step}/{seed}",
            seed=seed,
            sample_index=0,
            samples=spec.samples,
            group_size=spec.samples,
            model=config.model,
            task_app=task_app or config.task_app,
            sampling=sampling,
            mode="eval",
            lora=config.training.lora,
        )
        work.extend(group.split(samples_per_work))
    return work


def summarise(round_: EvalRound, spec: EvalSpec) -> EvalCompletedData:
    """Mean reward over the rollouts that ran; pass@1 (the expected share of seeds one
    sample passes, a failed rollout counting as not passing) and, with several samples per
    seed, pass@k (the share of seeds with at least one passing sample among the k)."""
    by_seed: dict[int, list[Trajectory]] = {seed: [] for seed in spec.seeds.range}
    for trajectory in round_.results.values():
        by_seed.setdefault(trajectory.seed, []).append(trajectory)
    per_seed: list[SeedEval] = []
    rewards: list[float] = []
    for seed, trajectories in sorted(by_seed.items()):
        ran = [t.reward for t in trajectories if t.status == "ok" and t.reward is not None]
        rewards.extend(ran)
        per_seed.append(
            SeedEval(
                seed=seed,
                samples=len(ran),
                failed=len(trajectories) - len(ran),
                reward_mean=statistics.fmean(ran) if ran else None,
                passed=sum(r >= spec.pass_threshold for r in ran),
            )
        )
    k = spec.samples
    pass_at_1 = statistics.fmean(s.passed / k for s in per_seed) if per_seed else None
    pass_at_k = statistics.fmean(s.passed > 0 for s in per_seed) if k > 1 and per_seed else None
    count = sum(s.samples for s in per_seed)
    return EvalCompletedData(
        step=round_.step,
        version=round_.version,
        seeds=spec.seeds.count,
        samples_per_seed=k,
        count=count,
        failed=sum(s.failed for s in per_seed),
        reward_mean=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        pass_at_1=pass_at_1,
        pass_at_k=pass_at_k,
        k=k,
        pass_threshold=spec.pass_threshold,
        temperature=spec.temperature,
        duration_s=time.monotonic() - round_.started,
        per_seed=per_seed,
        curriculum_level=round_.curriculum_level,
        task_metrics=task_metrics(list(round_.results.values())),
    )


def eval_message(data: EvalCompletedData) -> str:
    reward = f"{data.reward_mean:.3f}" if data.reward_mean is not None else "nan"
    passes = f", pass@1 {data.pass_at_1:.3f}" if data.pass_at_1 is not None else ""
    if data.pass_at_k is not None:
        passes += f", pass@{data.k} {data.pass_at_k:.3f}"
    failed = f", {data.failed} failed" if data.failed else ""
    return (
        f"eval at step {data.step}: reward {reward}{passes} "
        f"({data.seeds} held-out seeds x {data.samples_per_seed}{failed})"
    )


def evals_dir(job_root: Path) -> Path:
    return job_root / "evals"


def recorded_rounds(job_root: Path) -> set[int]:
    """The steps whose round is recorded under the job's directory."""
    directory = evals_dir(job_root)
    if not directory.exists():
        return set()
    return {int(p.stem.removeprefix("step-")) for p in directory.glob("step-*.json")}


def record_round(job_root: Path, data: EvalCompletedData) -> Path:
    """Written whole or not at all (a crash leaves the round to be run again)."""
    directory = evals_dir(job_root)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{data.step:06d}.json"
    temporary = temporary_sibling(path)
    temporary.write_text(json.dumps(data.model_dump(mode="json"), indent=1) + "\n")
    temporary.replace(path)
    return path


def _spec(config: JobConfig) -> EvalSpec:
    if config.eval is None:
        raise ValueError("the job has no [eval] section")
    return config.eval
