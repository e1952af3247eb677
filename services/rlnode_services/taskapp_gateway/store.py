"""The gateway's registry of Task Apps, per org. No key is ever stored here: the key comes
from the vault, sealed to the gateway, when a Task App is started or called."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column, UniqueConstraint
from sqlmodel import Field, SQLModel

from rlnode.messages import utc_now
from rlnode.service.db import UTCDateTime


class TaskAppRecord(SQLModel, table=True):
    __tablename__ = "gateway_taskapps"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    name: str = Field(max_length=128)
    kind: str = Field(max_length=16, description="external | managed")
    url: str | None = Field(default=None, max_length=2048, description="external: the base URL")
    command: str | None = Field(default=None, max_length=8192, description="managed: argv as JSON")
    cwd: str | None = Field(default=None, max_length=4096)
    env: str = Field(
        default="{}", max_length=16384, description="managed: extra env as JSON (no secrets)"
    )
    secret: str = Field(default="ENVIRONMENT_API_KEY", max_length=128)
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


class SandboxRecord(SQLModel, table=True):
    """The user a managed Task App runs as and the limits it asked for (a table of its own:
    registrations made before sandboxes get one when next started)."""

    __tablename__ = "gateway_taskapp_sandboxes"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    name: str = Field(max_length=128)
    uid: int = Field(unique=True)
    limits: str = Field(default="{}", max_length=1024, description="Limits as JSON")


class ManagedEndpointRecord(SQLModel, table=True):
    """Where a managed Task App answers while it is healthy, written by the gateway that runs
    it (`GATEWAY_RUNS_MANAGED`) for the node's other gateways, which run rollouts on it."""

    __tablename__ = "gateway_managed_endpoints"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    name: str = Field(max_length=128)
    url: str = Field(max_length=2048)
    owner: str = Field(max_length=256, description="The gateway that runs it (host-pid)")
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


TABLES = (TaskAppRecord, SandboxRecord, ManagedEndpointRecord)
