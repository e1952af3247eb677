"""Record signatures: what verifies, what does not, and who may produce what."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from nacl.signing import SigningKey

from rlnode.bus.signing import (
    CERT_HEADER,
    SIG_HEADER,
    RecordRefused,
    RecordVerifier,
    issue_certificate,
    record_digest,
)
from rlnode.messages import JobEvent, JobEventType, topics


@dataclass
class Record:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


class Tokens:
    """The verifier's view of the vault: its key and revocation list, no HTTP."""

    def __init__(self, vault: SigningKey, revoked: set[str] | None = None) -> None:
        self.verify_key = vault.verify_key
        self.revoked = revoked or set()

    def needs_refresh(self) -> bool:
        return False

    def is_revoked(self, token_id: str) -> bool:
        return token_id in self.revoked


def signed(
    vault: SigningKey,
    service: str,
    value: bytes,
    *,
    expires_in: int = 3600,
    topic=topics.TRAJECTORIES,
    token_id="t_1",
) -> Record:
    key = SigningKey.generate()
    certificate = issue_certificate(
        vault, "kid", service, bytes(key.verify_key), token_id, int(time.time()) + expires_in
    )
    signature = key.sign(record_digest(topic, b"job", value)).signature
    return Record(
        topic, b"job", value, [(CERT_HEADER, certificate.encode()), (SIG_HEADER, signature)]
    )


def test_a_signed_record_names_its_producer_and_a_changed_one_does_not() -> None:
    vault = SigningKey.generate()
    verifier = RecordVerifier(Tokens(vault))  # type: ignore[arg-type]
    record = signed(vault, "rollout-generator", b'{"reward": 0.1}')
    assert verifier.producer_now(record) == "rollout-generator"
    record.value = b'{"reward": 1.0}'
    with pytest.raises(RecordRefused, match="does not match"):
        verifier.producer_now(record)


def test_unsigned_foreign_expired_and_revoked_records_are_refused() -> None:
    vault = SigningKey.generate()
    verifier = RecordVerifier(Tokens(vault, revoked={"t_gone"}))  # type: ignore[arg-type]
    with pytest.raises(RecordRefused, match="unsigned"):
        verifier.producer_now(Record(topics.TRAJECTORIES, b"job", b"{}", []))
    with pytest.raises(RecordRefused, match="not the vault's"):
        verifier.producer_now(signed(SigningKey.generate(), "learner", b"{}"))
    with pytest.raises(RecordRefused, match="expired"):
        verifier.producer_now(signed(vault, "learner", b"{}", expires_in=-3600))
    with pytest.raises(RecordRefused, match="revoked"):
        verifier.producer_now(signed(vault, "learner", b"{}", token_id="t_gone"))
    # A signature made for another topic does not carry over.
    moved = signed(vault, "learner", b"{}", topic=topics.ROLLOUT_WORK)
    moved.topic = topics.WEIGHT_VERSIONS
    with pytest.raises(RecordRefused, match="does not match"):
        verifier.producer_now(moved)


def test_who_may_produce_what() -> None:
    def event(kind: JobEventType) -> JobEvent:
        return JobEvent.model_construct(type=kind)  # only its type matters here

    assert topics.may_produce("learner", topics.WEIGHT_VERSIONS, object())
    assert not topics.may_produce("rollout-generator", topics.WEIGHT_VERSIONS, object())
    assert not topics.may_produce("learner", topics.TRAJECTORIES, object())
    assert topics.may_produce("learner", topics.JOB_EVENTS, event(JobEventType.CHECKPOINT_SAVED))
    assert topics.may_produce(
        "rollout-generator", topics.JOB_EVENTS, event(JobEventType.WEIGHTS_LOADED)
    )
    assert not topics.may_produce(
        "rollout-generator", topics.JOB_EVENTS, event(JobEventType.COMPLETED)
    )
    assert not topics.may_produce("taskapp-gateway", topics.JOB_EVENTS, event(JobEventType.FAILED))
