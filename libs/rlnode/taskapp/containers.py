"""Synth's container contract beside the 2025 Task App one (contract.py): how the gateway
tells them apart, an rlnode `RolloutRequest` as the container's rollout request, and the
container's rollout record as rlnode's `RolloutResponse`.

Pinned to what was tested: synth-containers==0.4.6 (contract version 2026-05-28, protocol
`synth.container.contract.v1`; requirements/environments/synth-containers.txt). Its pydantic
models cannot be imported here: it needs fastapi>=0.141.1 and vLLM pins fastapi<0.137, so
it lives in a venv of its own, not the gateway's. The request is therefore written out
below, and tests/integration/test_env_synth_containers.py validates it against
synth-containers' own `RolloutRequestModel` (extra fields forbidden) in that venv: a release
that changes the request fails a test, not a job. What a container answers is read
leniently, since containers are user code.

The routes, as the gateway uses them:
- `GET /metadata`: a JSON object with `capabilities` (its `contract_version`) is a
  container; a 2025 Task App answers 404 there.
- `GET /dataset` (Synth's cookbooks), else `GET /taskset` (the 0.4.6 SDK's):
  `{"splits": {name: rows}}`. An `rl` rollout asks for the container's training split, an
  `eval` one for its held-out split (in `env.split` and `task_instance_id` "<split>:<seed>");
  the seed goes unchanged: the container maps it to one of its rows.
- `POST /dataset/rows` `{"split", "seeds": [seed]}` -> `{"rows": [row]}` where `/dataset`
  answered: the row goes in the rollout as `task`, as Synth's optimizers send it.
- `POST /rollouts` with `submission_mode: "async"`, then `GET /rollouts/{id}` until the
  record is terminal: an exception in the container's rollout comes back as a failed record
  with its message (a blocking call would answer a bare 500), and a rollout past its time is
  stopped with `POST /rollouts/{id}/terminate`. A container that answers a terminal record at
  once is read as it is. (The SDK keeps every async rollout's record in memory, about
  2.5 KB each, measured: a managed restart frees them.)
- No key: the contract has none (the gateway's `X-API-Key` is ignored).

The reward is `reward_info.outcome_reward` (else `summary.outcome_reward`, else
`summary.reward`); `reward_info.event_rewards` become step rewards; numbers in
`reward_info.details` and `summary` become metrics.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rlnode.taskapp.contract import (
    RolloutMetrics,
    RolloutRequest,
    RolloutResponse,
    RolloutStep,
    RolloutTrajectory,
)
from rlnode.taskapp.inference import chat_completions_url

TESTED_VERSION = "synth-containers==0.4.6"
TESTED_CONTRACT_VERSION = "2026-05-28"
# What `verify` reports (our words only: what an address answered is never echoed back).
CONTAINER_CONTRACT = "synth-container"
LEGACY_CONTRACT = "synth-taskapp-2025"
TRAIN_SPLITS = ("train", "training")
HELDOUT_SPLITS = ("test", "heldout", "held_out", "validation", "val", "eval", "dev")
IN_PROGRESS = frozenset({"queued", "pending", "running", "in_progress"})
FAILED = frozenset({"failed", "error", "cancelled", "canceled", "terminated", "stopped"})
# synth_containers.event_log.validate_rollout_id
_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class ContainerRolloutFailed(ValueError):
    """The container's record says the rollout failed (its own words in the message)."""


@dataclass(frozen=True)
class ContainerApp:
    """What a container said about itself: its contract version, its splits, and whether it
    serves `/dataset/rows`."""

    contract_version: str
    splits: tuple[str, ...] = ()
    serves_rows: bool = False

    def verdict(self) -> str:
        if self.contract_version == TESTED_CONTRACT_VERSION:
            return f"speaks Synth's container contract, the version tested ({TESTED_VERSION})"
        return (
            "speaks Synth's container contract, in a version other than the one tested "
            f"({TESTED_CONTRACT_VERSION}, {TESTED_VERSION})"
        )

    def split_for(self, mode: str) -> str | None:
        """Its training split for an `rl` rollout, its held-out one for `eval`; None when it
        names none of them (it then picks, as it would for a request without a split)."""
        wanted = HELDOUT_SPLITS if mode == "eval" else TRAIN_SPLITS
        by_name = {name.lower(): name for name in self.splits}
        return next((by_name[name] for name in wanted if name in by_name), None)


def container_app(
    metadata: Any, dataset: Any = None, serves_rows: bool = False
) -> ContainerApp | None:
    """The container `GET /metadata` describes (with what `/dataset` or `/taskset` said), or
    None when the answer is not the container contract's."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("capabilities"), dict):
        return None
    return ContainerApp(
        contract_version=str(metadata["capabilities"].get("contract_version") or ""),
        splits=split_names(dataset),
        serves_rows=serves_rows,
    )


def split_names(dataset: Any) -> tuple[str, ...]:
    """`splits` of a `/dataset` or `/taskset` answer: a {name: rows} mapping, or a list of
    names or of {"name"|"split": ...} objects."""
    splits = dataset.get("splits") if isinstance(dataset, dict) else None
    if isinstance(splits, dict):
        return tuple(str(name) for name in splits)
    if isinstance(splits, list):
        names = (s.get("name") or s.get("split") if isinstance(s, dict) else s for s in splits)
        return tuple(str(name) for name in names if name)
    return ()


def rollout_id(request: RolloutRequest) -> str:
    """rlnode's run id where the container contract accepts it as a rollout id, else a
    digest of it (the contract allows 1-128 of [A-Za-z0-9._:-])."""
    if _ROLLOUT_ID.fullmatch(request.run_id):
        return request.run_id
    return "rlnode-" + hashlib.blake2b(request.run_id.encode(), digest_size=16).hexdigest()


def policy_spec(request: RolloutRequest) -> dict[str, Any]:
    """The typed OpenAI-compatible target the contract wants: rlnode's per-rollout endpoint,
    which needs no credential from the container (`credential_mode: proxy`)."""
    config = request.policy.config
    endpoint = chat_completions_url(config.inference_url)
    spec: dict[str, Any] = {
        "provider": "rlnode",
        "model": config.model,
        "api_family": "chat_completions",
        "inference_url": endpoint,
        "credential_mode": "proxy",
    }
    # `<base_url>/chat/completions` would drop a query string: then only the full URL goes.
    if not urlsplit(endpoint).query:
        spec["base_url"] = endpoint.removesuffix("/chat/completions")
    if config.max_tokens is not None:
        spec["max_tokens"] = config.max_tokens
    sampling = {"temperature": config.temperature, "top_p": config.top_p}
    spec["config"] = {k: v for k, v in sampling.items() if v is not None}
    return spec


def rollout_body(
    request: RolloutRequest, split: str | None = None, row: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The container's rollout request for rlnode's `request` (its seed in `split`, and the
    row `/dataset/rows` gave for it, if any)."""
    identity = rollout_id(request)
    seed = request.env.seed
    env: dict[str, Any] = {"config": request.env.config}
    body: dict[str, Any] = {
        "rollout_id": identity,
        "trace_correlation_id": identity,
        "submission_mode": "async",
        "mode": request.mode,
        "env": env,
        "policy": policy_spec(request),
    }
    if seed is not None:
        body["seed"] = env["seed"] = seed
        # The contract's task instance identity: "<anything>:<integer seed>".
        body["task_instance_id"] = f"{split or 'seed'}:{seed}"
    if split is not None:
        env["split"] = split
    if row is not None:
        body["task"] = row
    if request.training_session_id:
        body["run_id"] = request.training_session_id
    return body


def in_progress(record: dict[str, Any]) -> bool:
    return str(record.get("status") or "").lower() in IN_PROGRESS


def rollout_response(request: RolloutRequest, record: Any) -> RolloutResponse:
    """rlnode's response for the container's terminal `record`. ContainerRolloutFailed when
    the record says the rollout failed; ValueError when it is not a scored rollout record."""
    if not isinstance(record, dict):
        raise ValueError(f"the rollout record is not a JSON object: {str(record)[:200]}")
    sent = rollout_id(request)
    if record.get("rollout_id") not in (None, sent):
        raise ValueError(
            f"the rollout record is for rollout {record['rollout_id']!r}, not {sent!r}"
        )
    status = str(record.get("status") or "completed").lower()
    if status in FAILED:
        detail = record.get("status_detail") or record.get("error") or "no detail given"
        raise ContainerRolloutFailed(f"the Task App reported the rollout {status}: {detail}")
    if status != "completed":
        raise ValueError(f"the rollout record has status {status!r}, not completed")
    reward_info = _object(record.get("reward_info"))
    summary = _object(record.get("summary"))
    reward = _reward(reward_info, summary)
    events = [
        r for r in map(_event_reward, _list(reward_info.get("event_rewards"))) if r is not None
    ]
    rewards = events or [reward]
    info = {key: record[key] for key in ("status", "success_status", "task_id") if key in record}
    steps = [
        RolloutStep(reward=r, done=i == len(rewards) - 1, info=info | {"summary": summary})
        for i, r in enumerate(rewards)
    ]
    details = _numbers(summary) | _numbers(_object(reward_info.get("details")))
    return RolloutResponse(
        run_id=request.run_id,
        trajectories=[
            RolloutTrajectory(
                env_id=str(record.get("task_id") or "container"),
                policy_id=request.policy.policy_id or "policy",
                steps=steps,
                length=len(steps),
            )
        ],
        metrics=RolloutMetrics(
            episode_returns=[reward],
            mean_return=reward,
            outcome_score=reward,
            num_steps=len(steps),
            num_episodes=1,
            details=details,
        ),
        ops_executed=len(steps),
        trace={"container_record": record} if request.record.return_trace else None,
    )


def _reward(reward_info: dict[str, Any], summary: dict[str, Any]) -> float:
    for value in (
        reward_info.get("outcome_reward"),
        summary.get("outcome_reward"),
        summary.get("reward"),
    ):
        if isinstance(value, int | float) and not isinstance(value, bool):
            if (reward := _finite(value)) is None:
                raise ValueError("the rollout's reward is not a finite number")
            return reward
    raise ValueError(
        "the rollout reports no reward: no reward_info.outcome_reward, summary.outcome_reward "
        "or summary.reward"
    )


def _event_reward(event: Any) -> float | None:
    return _finite(event.get("reward", event.get("value")) if isinstance(event, dict) else event)


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: number for k, v in values.items() if (number := _finite(v)) is not None}


def _finite(value: Any) -> float | None:
    """A finite number's value (a bool is not one), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
