"""The Task App contract: what we send carries what Synth's SDK requires; what we read is
normalised whichever optional fields a Task App filled in."""

from __future__ import annotations

import pytest

from rlnode.taskapp.contract import NormalisedRollout, RolloutRequest, RolloutResponse
from rlnode.taskapp.inference import chat_completions_url


def _request() -> RolloutRequest:
    return RolloutRequest.model_validate(
        {
            "run_id": "r1",
            "env": {"env_name": "copy", "seed": 3},
            "policy": {"config": {"inference_url": "http://x"}},
        }
    )


def test_requests_carry_every_field_synth_requires() -> None:
    document = _request().model_dump(mode="json")
    assert document["ops"] == ["agent", "env"]
    assert set(document) >= {
        "run_id",
        "env",
        "policy",
        "ops",
        "record",
        "on_done",
        "safety",
        "training_session_id",
    }
    assert set(document["record"]) == {
        "trajectories",
        "logprobs",
        "value",
        "return_trace",
        "trace_format",
    }
    assert set(document["safety"]) == {"max_ops", "max_time_s"}
    assert document["mode"] == "rl"


def _response(**metrics) -> RolloutResponse:
    return RolloutResponse.model_validate(
        {
            "run_id": "r1",
            "trajectories": [
                {
                    "steps": [
                        {"obs": {}, "tool_calls": [], "reward": 0.25},
                        {"obs": {}, "tool_calls": [], "reward": 0.5, "done": True},
                    ]
                }
            ],
            "metrics": metrics,
        }
    )


@pytest.mark.parametrize(
    ("metrics", "reward"),
    [
        ({"episode_returns": [0.6, 0.8], "mean_return": 0.1}, 0.7),
        ({"mean_return": 0.9}, 0.9),
        ({"outcome_score": 0.3}, 0.3),
        ({}, 0.75),  # sum of step rewards
    ],
)
def test_the_reward_comes_from_the_best_field_there_is(metrics: dict, reward: float) -> None:
    result = NormalisedRollout.from_response(_response(**metrics))
    assert result.reward == pytest.approx(reward)
    assert result.step_rewards == [0.25, 0.5] and result.num_steps == 2


def test_no_reward_at_all_is_an_error() -> None:
    response = RolloutResponse.model_validate(
        {"run_id": "r", "trajectories": [{"steps": [{"obs": {}}]}]}
    )
    with pytest.raises(ValueError, match="no reward"):
        NormalisedRollout.from_response(response)


def test_numeric_details_become_metrics() -> None:
    result = NormalisedRollout.from_response(
        _response(mean_return=1.0, details={"calls": 3, "note": "x", "flag": True})
    )
    assert result.metrics == {"calls": 3.0}


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("http://h:1", "http://h:1/v1/chat/completions"),
        ("http://h:1/", "http://h:1/v1/chat/completions"),
        ("http://h:1/rollouts/abc", "http://h:1/rollouts/abc/v1/chat/completions"),
        ("http://h:1/v1", "http://h:1/v1/chat/completions"),
        ("http://h:1/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://h:1/r/x?cid=7", "http://h:1/r/x/v1/chat/completions?cid=7"),
    ],
)
def test_chat_completions_url(base: str, url: str) -> None:
    assert chat_completions_url(base) == url
