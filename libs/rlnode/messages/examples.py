"""One well-formed example of every payload: for docs, `rlnode doctor` and tests."""

from __future__ import annotations

import uuid

import blake3

from rlnode.messages.config import JobConfig, ModelSpec, SamplingSpec, TaskAppSpec
from rlnode.messages.dead_letters import DeadLetter
from rlnode.messages.jobs import JobEvent, JobEventType, JobRequest
from rlnode.messages.rollouts import RolloutFailure, RolloutWork, TokenTurn, Trajectory
from rlnode.messages.tinker import ForwardBackward, TinkerCall, TinkerDatum, TinkerResult
from rlnode.messages.weights import ParityProbe, WeightVersion


def example_config() -> JobConfig:
    return JobConfig(
        name="copy-task",
        model=ModelSpec(source="/models/tiny-llama"),
        task_app=TaskAppSpec(name="copy-task", env_config={"length": 4}),
    )


def example_payloads(job_id: str = "job-example", org_id: str = "org-example") -> list:
    ids = {"job_id": job_id, "org_id": org_id}
    config = example_config()
    work = RolloutWork(
        **ids,
        step=3,
        policy_version=2,
        group_id="3/17",
        seed=17,
        sample_index=1,
        samples=2,
        group_size=4,
        model=config.model,
        task_app=config.task_app,
        sampling=SamplingSpec(max_tokens=16, temperature=0.9),
    )
    turn = TokenTurn(
        prompt_ids=[1, 15, 27, 99],
        completion_ids=[42, 43, 2],
        logprobs=[-0.25, -1.5, -0.01],
        policy_version=2,
        finish_reason="stop",
    )
    return [
        JobRequest(**ids, token="rln_example-token", config=config),
        JobRequest(**ids, token="rln_example-token", action="cancel", reason="wrong learning rate"),
        JobEvent(
            **ids,
            type=JobEventType.ACCEPTED,
            source="learner",
            message="accepted",
            data={"steps": 50},
        ),
        JobEvent(
            **ids,
            type=JobEventType.TRAIN_STEP,
            source="learner",
            data={
                "step": 3,
                "total_steps": 50,
                "loss": 0.12,
                "reward_mean": 0.4,
                "reward_std": 0.2,
                "kl": 0.001,
                "clip_fraction": 0.05,
                "staleness_min": 0,
                "staleness_mean": 0.5,
                "staleness_max": 1,
                "tokens_per_s": 1234.5,
                "wait_s": 0.1,
                "compute_s": 0.9,
            },
        ),
        work,
        Trajectory(
            **ids,
            work_id=work.sample_id(1),
            rollout_id="r-" + uuid.uuid4().hex,
            generator="rollout-generator/0",
            step=3,
            group_id="3/17",
            seed=17,
            sample_index=1,
            status="ok",
            turns=[turn],
            reward=0.75,
            step_rewards=[0.75],
            metrics={"chars_matched": 3.0},
            duration_s=0.42,
        ),
        Trajectory(
            **ids,
            work_id=work.sample_id(2),
            rollout_id="r-" + uuid.uuid4().hex,
            generator="rollout-generator/0",
            step=3,
            group_id="3/17",
            seed=17,
            sample_index=2,
            status="failed",
            failure=RolloutFailure(kind="timeout", message="the Task App did not answer in 300s"),
        ),
        WeightVersion(
            **ids,
            version=3,
            step=3,
            uri=f"file:///var/lib/rlnode/checkpoints/{job_id}/weights/v3.safetensors",
            blake3=blake3.blake3(b"weights").hexdigest(),
            size_bytes=123_456,
            dtype="float32",
            probe=ParityProbe(token_ids=[1, 15, 27], logprobs=[-3.2, -4.1]),
        ),
        DeadLetter(
            **ids,
            source_topic="rlnode.trajectories",
            partition=1,
            offset=7,
            key=job_id,
            consumer="learner",
            consumer_group="learner",
            error="validation",
            reason="invalid Trajectory: reward: Input should be a finite number",
            payload_b64="e30=",
            payload_size=2,
        ),
        TinkerCall(
            **ids,
            request_id="7d1c0a52-5b7e-4f0e-9a51-0c2b9d3f6a10",
            seq_id=2,
            call=ForwardBackward(
                datums=[
                    TinkerDatum(
                        input_ids=[1, 15, 27], targets=[15, 27, 2], inputs={"weights": [0, 1, 1]}
                    )
                ],
                loss_fn="cross_entropy",
            ),
        ),
        TinkerResult(
            **ids,
            request_id="7d1c0a52-5b7e-4f0e-9a51-0c2b9d3f6a10",
            seq_id=2,
            op="forward_backward",
            logprobs=[[-3.2, -4.1, -0.7]],
            loss_sum=4.8,
            tokens=3,
        ),
    ]
