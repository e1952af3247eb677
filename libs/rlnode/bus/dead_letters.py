"""A record a consumer cannot use becomes a dead letter: the record (base64, bounded), where
it came from and why, on `rlnode.dead-letters`; and, where it names a job, an event that
tells the job why (docs/architecture.md §2). A bad job event or dead letter begets no event: no loops."""

from __future__ import annotations

import base64
import re
from typing import Any

from aiokafka.structs import ConsumerRecord

from rlnode.messages import (
    ID_PATTERN,
    DeadLetter,
    DeadLetterError,
    JobEvent,
    JobEventType,
    topics,
)
from rlnode.messages.jobs import DeadLetteredData
from rlnode.service.auth import redact_token_bytes, redact_tokens

# A dead letter keeps at most this much of the bad record, so that it still fits the topic.
PAYLOAD_LIMIT = 1024 * 1024

# Which job event a bad record on each topic earns the job it names.
REJECT_EVENT: dict[str, JobEventType | None] = {
    topics.JOB_REQUESTS: JobEventType.REJECTED,
    topics.ROLLOUT_WORK: JobEventType.FAILED,
    topics.TRAJECTORIES: JobEventType.FAILED,
    topics.WEIGHT_VERSIONS: JobEventType.FAILED,
    topics.JOB_EVENTS: None,
    topics.DEAD_LETTERS: None,
}

_id_re = re.compile(ID_PATTERN)


def dead_letter(
    record: ConsumerRecord,
    error: DeadLetterError,
    reason: str,
    *,
    consumer: str,
    group_id: str | None,
    document: Any,
) -> DeadLetter:
    # A token in a bad record (in whichever field) is not copied on: the dead-letter topic is
    # read by operators, not only by the token's org.
    value = redact_token_bytes(record.value or b"")
    job_id, org_id = named_job(document)
    return DeadLetter(
        job_id=job_id,
        org_id=org_id,
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key.decode(errors="replace") if record.key else None,
        consumer=consumer,
        consumer_group=group_id,
        error=error,
        reason=redact_tokens(reason),
        payload_b64=base64.b64encode(value[:PAYLOAD_LIMIT]).decode(),
        payload_size=len(value),
        payload_truncated=len(value) > PAYLOAD_LIMIT,
    )


def event_for(letter: DeadLetter, kind: JobEventType | None, source: str) -> JobEvent | None:
    """The event that tells the job a record of it was unusable, if it names one."""
    if kind is None or letter.job_id is None or letter.org_id is None:
        return None
    return JobEvent.of(
        letter.job_id,
        letter.org_id,
        source,
        kind,
        f"a {letter.source_topic} record for this job was unusable: {letter.reason}",
        DeadLetteredData(
            reason=letter.reason,
            dead_letter_id=str(letter.id),
            topic=letter.source_topic,
            partition=letter.partition,
            offset=letter.offset,
        ),
    )


def named_job(document: Any) -> tuple[str | None, str | None]:
    """The job and org a bad record names, if it parsed as JSON and names well-formed ones."""
    if not isinstance(document, dict):
        return None, None

    def well_formed(value: Any) -> str | None:
        return value if isinstance(value, str) and _id_re.match(value) else None

    return well_formed(document.get("job_id")), well_formed(document.get("org_id"))
