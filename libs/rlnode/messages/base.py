"""The envelope every record carries, and the strict base used by every contract model."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, ClassVar
from uuid import UUID, uuid4

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

# Ids end up in model names ("<job_id>@<step>"), file paths (checkpoint directories)
# and HTTP routes, so they are restricted to a path- and URL-safe alphabet.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ResourceId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]


def utc_now() -> datetime:
    return datetime.now(UTC)


class StrictModel(BaseModel):
    """Base of every contract model: unknown fields are errors (a typo in a config is
    reported, not silently ignored) and NaN/inf never pass as numbers."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )


class Stamped(StrictModel):
    """Identity and time of a record: the part shared by every payload."""

    # Each concrete payload declares `schema_` as a Literal "rlnode.<Name>/<version>",
    # so a record of one type sent to another type's topic fails validation; its SCHEMA
    # is that same Literal, so the type checker holds the two (and the default) equal.
    SCHEMA: ClassVar[str]

    id: UUID = Field(default_factory=uuid4, description="Unique id of this record.")
    ts: AwareDatetime = Field(default_factory=utc_now, description="When it was produced (UTC).")


class Envelope(Stamped):
    """A record that belongs to one job of one org. Records are keyed by `job_id`, so all
    records of a job share one partition and keep their order."""

    job_id: ResourceId
    org_id: ResourceId

    @property
    def key(self) -> bytes:
        return self.job_id.encode()
