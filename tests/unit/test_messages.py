"""The contract models: what they accept, what they refuse, and how they say why."""

from __future__ import annotations

import uuid

import orjson
import pytest
from pydantic import ValidationError

from rlnode.messages import (
    ENDED_STATUSES,
    EVENT_DATA,
    JOB_ENDED,
    PAYLOAD_TYPES,
    JobConfig,
    JobEvent,
    JobEventType,
    JobRequest,
    ParityProbe,
    RolloutWork,
    TokenTurn,
    Trajectory,
    WeightVersion,
    topics,
)
from rlnode.messages.codec import DecodeError, decode, decode_any, describe_validation_error, encode
from rlnode.messages.examples import example_config, example_payloads


@pytest.mark.parametrize("message", example_payloads(), ids=lambda m: f"{type(m).__name__}")
def test_every_payload_round_trips_through_json(message) -> None:
    raw = encode(message)
    assert decode(raw, type(message)) == message
    assert decode_any(raw) == message


def test_examples_cover_every_payload_type() -> None:
    assert {type(m) for m in example_payloads()} == set(PAYLOAD_TYPES.values())


def test_envelope_fields_are_on_the_wire() -> None:
    for message in example_payloads():
        document = orjson.loads(encode(message))
        assert document["schema"] == type(message).SCHEMA
        uuid.UUID(document["id"])
        assert document["ts"].endswith("+00:00")
        assert document["job_id"] == "job-example" and document["org_id"] == "org-example"


def test_a_record_of_one_type_is_refused_as_another() -> None:
    event = JobEvent(job_id="j", org_id="o", type=JobEventType.STARTED, source="learner")
    with pytest.raises(DecodeError) as info:
        decode(encode(event), JobRequest)
    assert info.value.kind == "validation"
    assert "schema" in info.value.reason


def test_not_json_is_a_decode_error() -> None:
    with pytest.raises(DecodeError) as info:
        decode(b"\x00garbage", JobEvent)
    assert info.value.kind == "decode"
    assert "not valid JSON" in info.value.reason


def test_unknown_schema_names_the_known_ones() -> None:
    with pytest.raises(DecodeError, match=r"unknown schema 'rlnode\.Nope/1'.*rlnode\.JobEvent/1"):
        decode_any(b'{"schema": "rlnode.Nope/1"}')


def test_start_needs_config_and_cancel_takes_none() -> None:
    with pytest.raises(ValidationError, match="'start' request needs a config"):
        JobRequest(job_id="j", org_id="o", token="t")
    with pytest.raises(ValidationError, match="'cancel' request takes no config"):
        JobRequest(job_id="j", org_id="o", token="t", action="cancel", config=example_config())
    JobRequest(job_id="j", org_id="o", token="t", action="cancel")


@pytest.mark.parametrize("bad", ["../etc", "a/b", "job@3", "", "-lead", "x" * 129, "sp ace"])
def test_ids_are_path_and_model_name_safe(bad: str) -> None:
    with pytest.raises(ValidationError):
        JobEvent(job_id=bad, org_id="o", type=JobEventType.STARTED, source="s")


def test_the_token_is_not_in_repr_nor_echoed_in_errors() -> None:
    request = JobRequest(job_id="j", org_id="o", token="rln_super-secret", config=example_config())
    assert "rln_super-secret" not in repr(request)
    with pytest.raises(ValidationError) as info:
        JobRequest(job_id="j", org_id="o", token=12345, config=example_config())
    text = describe_validation_error(info.value, "JobRequest")
    assert "token" in text and "12345" not in text and "withheld" in text


def test_unknown_config_keys_are_reported_by_path() -> None:
    document = example_config().model_dump()
    document["training"]["learning_rte"] = 1e-5
    with pytest.raises(ValidationError) as info:
        JobConfig.model_validate(document)
    text = describe_validation_error(info.value, "JobConfig")
    assert "training.learning_rte: Extra inputs are not permitted" in text


def test_kl_without_reference_says_how_to_fix_it() -> None:
    document = example_config().model_dump()
    document["training"]["kl_coef"] = 0.1
    document["topology"]["reference"] = "none"
    with pytest.raises(ValidationError, match=r"set topology\.reference to 'auto'"):
        JobConfig.model_validate(document)


def test_group_size_one_is_refused_for_grpo() -> None:
    document = example_config().model_dump()
    document["training"]["group_size"] = 1
    with pytest.raises(ValidationError, match="group_size"):
        JobConfig.model_validate(document)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("max_failed_share", 0.0, "greater than 0"),
        ("max_failed_share", 1.5, "less than or equal to 1"),
        ("consecutive_steps", 0, "greater than 0"),
        ("give_up_after_s", 0, "greater than 0"),
        ("give_up_after_s", -5.0, "greater than 0"),
    ],
)
def test_bad_breaker_settings_are_named(field: str, value: float, says: str) -> None:
    document = example_config().model_dump()
    document["training"]["breaker"] = {field: value}
    with pytest.raises(ValidationError) as info:
        JobConfig.model_validate(document)
    text = describe_validation_error(info.value, "JobConfig")
    assert f"training.breaker.{field}: Input should be {says}" in text
    assert f"(got {value})" in text


def test_the_breaker_has_defaults() -> None:
    breaker = example_config().training.breaker
    assert (breaker.max_failed_share, breaker.consecutive_steps) == (0.5, 2)
    assert breaker.give_up_after_s == 600.0


def test_a_work_item_holds_samples_of_one_group_and_names_each() -> None:
    work = next(m for m in example_payloads() if isinstance(m, RolloutWork))
    whole = work.model_copy(update={"sample_index": 0, "samples": 7, "group_size": 7})
    parts = whole.split(3)
    assert [(p.sample_index, p.samples) for p in parts] == [(0, 3), (3, 2), (5, 2)]
    assert len({p.id for p in parts}) == 3 and whole.split(3)[1].id == parts[1].id
    # A sample's id depends on the job, the group and the index, not on how it was split.
    assert parts[1].sample_id(4) == whole.sample_id(4) == whole.split(7)[0].sample_id(4)
    assert len({whole.sample_id(i) for i in whole.sample_indices}) == 7
    with pytest.raises(ValidationError, match=r"samples 3..7 are outside a group of 7"):
        RolloutWork.model_validate(
            {**whole.model_dump(by_alias=True), "sample_index": 3, "samples": 5}
        )
    with pytest.raises(ValidationError, match="samples"):
        RolloutWork.model_validate({**whole.model_dump(by_alias=True), "samples": 0})


def test_turn_logprobs_must_align_with_tokens() -> None:
    with pytest.raises(ValidationError, match="2 logprobs for 3 completion tokens"):
        TokenTurn(
            prompt_ids=[1],
            completion_ids=[1, 2, 3],
            logprobs=[0.0, 0.0],
            policy_version=0,
            finish_reason="stop",
        )
    with pytest.raises(ValidationError, match="1 ref_logprobs for 2"):
        TokenTurn(
            prompt_ids=[1],
            completion_ids=[1, 2],
            logprobs=[0.0, 0.0],
            ref_logprobs=[0.0],
            policy_version=0,
            finish_reason="length",
        )


def _trajectory(**changes) -> Trajectory:
    ok = next(m for m in example_payloads() if isinstance(m, Trajectory) and m.status == "ok")
    return Trajectory.model_validate({**ok.model_dump(), **changes})


def test_trajectory_status_rules() -> None:
    with pytest.raises(ValidationError, match="needs a reward"):
        _trajectory(reward=None)
    with pytest.raises(ValidationError, match="needs at least one turn"):
        _trajectory(turns=[])
    with pytest.raises(ValidationError, match="needs a failure"):
        _trajectory(status="failed")
    with pytest.raises(ValidationError, match="carries no failure"):
        _trajectory(failure={"kind": "timeout", "message": "x"})
    assert _trajectory().policy_versions == (2, 2)
    # A turn that new weights went into while it was generated counts both versions.
    turns = [t | {"last_policy_version": 3} for t in _trajectory().model_dump()["turns"]]
    assert _trajectory(turns=turns).policy_versions == (2, 3)


def test_nan_rewards_are_refused() -> None:
    with pytest.raises(ValidationError):
        _trajectory(reward=float("nan"))
    with pytest.raises(DecodeError):
        # orjson writes NaN as null, which an 'ok' trajectory refuses
        decode(encode(_trajectory()).replace(b'"reward":0.75', b'"reward":null'), Trajectory)


def test_weight_version_must_point_into_the_store_with_a_digest() -> None:
    wv = next(m for m in example_payloads() if isinstance(m, WeightVersion))
    with pytest.raises(ValidationError, match="uri"):
        WeightVersion.model_validate({**wv.model_dump(), "uri": "s3://bucket/w"})
    with pytest.raises(ValidationError, match="blake3"):
        WeightVersion.model_validate({**wv.model_dump(), "blake3": "abc"})
    with pytest.raises(ValidationError, match="a probe of 3 tokens has 2 logprobs, not 1"):
        ParityProbe(token_ids=[1, 2, 3], logprobs=[0.0])


def test_event_data_is_checked_against_its_type() -> None:
    with pytest.raises(ValidationError, match="reason"):
        JobEvent(job_id="j", org_id="o", type=JobEventType.FAILED, source="learner", data={})
    with pytest.raises(ValidationError, match="loss"):
        JobEvent(
            job_id="j", org_id="o", type=JobEventType.TRAIN_STEP, source="learner", data={"step": 1}
        )
    event = JobEvent(
        job_id="j",
        org_id="o",
        type=JobEventType.FAILED,
        source="learner",
        data={"reason": "out of memory", "device": "cuda:0"},
    )
    assert event.typed_data().reason == "out of memory"
    assert event.data["device"] == "cuda:0"  # producers may add fields


def test_paused_and_resumed_are_the_learners_to_say() -> None:
    paused = JobEvent(
        job_id="j",
        org_id="o",
        type=JobEventType.PAUSED,
        source="learner",
        data={
            "step": 3,
            "bad_steps": 2,
            "rollouts": 16,
            "failed": 15,
            "failures": {"task_app_unreachable": 12, "timeout": 3},
            "max_failed_share": 0.5,
            "give_up_after_s": 600,
        },
    )
    assert paused.typed_data().failures == {"task_app_unreachable": 12, "timeout": 3}
    assert not paused.type.ends_a_job
    with pytest.raises(ValidationError, match="failures"):
        JobEvent(job_id="j", org_id="o", type=JobEventType.PAUSED, source="learner", data={})
    with pytest.raises(ValidationError, match="probes"):
        JobEvent(
            job_id="j", org_id="o", type=JobEventType.RESUMED, source="learner", data={"step": 3}
        )
    assert topics.may_produce(topics.LEARNER, topics.JOB_EVENTS, paused)
    assert not topics.may_produce(topics.GENERATOR, topics.JOB_EVENTS, paused)


def test_the_events_that_end_a_job() -> None:
    ended = {t for t in JobEventType if t.ends_a_job}
    assert (
        ended
        == JOB_ENDED
        == {
            JobEventType.COMPLETED,
            JobEventType.FAILED,
            JobEventType.CANCELLED,
        }
    )
    assert ENDED_STATUSES == {"completed", "failed", "cancelled"}
    assert set(EVENT_DATA) <= set(JobEventType)
