"""Records a consumer could not use, kept with the reason so an operator can act."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, NonNegativeInt

from rlnode.messages.base import ResourceId, Stamped

# producer: unsigned, signed by no service the vault certified, or by one that may not
# produce this record (rlnode.bus.signing).
DeadLetterError = Literal["decode", "validation", "producer", "handler"]


class DeadLetter(Stamped):
    SCHEMA: ClassVar[Literal["rlnode.DeadLetter/1"]] = "rlnode.DeadLetter/1"
    schema_: Literal["rlnode.DeadLetter/1"] = Field(SCHEMA, alias="schema")

    # Taken from the bad record where it names them (and they are well formed).
    job_id: ResourceId | None = None
    org_id: ResourceId | None = None

    source_topic: str
    partition: NonNegativeInt
    offset: NonNegativeInt
    key: str | None = None
    consumer: str = Field(description="The service whose consumer gave up on the record.")
    consumer_group: str | None = None
    error: DeadLetterError
    reason: str
    payload_b64: str = Field(description="The record's value, base64, possibly truncated.")
    payload_size: NonNegativeInt
    payload_truncated: bool = False
