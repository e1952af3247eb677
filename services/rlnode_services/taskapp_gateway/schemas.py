"""Request and response bodies of the gateway's HTTP API."""

from __future__ import annotations

import shlex
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlnode.messages import ResourceId
from rlnode.taskapp.contract import NormalisedRollout, RolloutRequest
from rlnode_services.taskapp_gateway.managed import RESERVED_ENV
from rlnode_services.taskapp_gateway.sandbox import Limits


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterTaskApp(Strict):
    """External (`url`) or managed (`command`): exactly one."""

    name: ResourceId
    url: str | None = Field(
        None, max_length=2048, description="external: base URL of a running Task App"
    )
    command: list[str] | str | None = Field(
        None,
        description="managed: argv (or one string, split like a shell would); `python` is the gateway's",
    )
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] = Field(
        default_factory=dict, description="managed: extra environment, no secrets"
    )
    secret: ResourceId = Field(
        "ENVIRONMENT_API_KEY", description="the org's vault secret the Task App checks"
    )
    limits: Limits | None = Field(
        None, description="managed: memory, processes and open files (default: the node's)"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        return value.rstrip("/") if value else value

    @field_validator("command")
    @classmethod
    def _argv(cls, value: list[str] | str | None) -> list[str] | None:
        if value is None:
            return None
        argv = shlex.split(value) if isinstance(value, str) else value
        if not argv or not argv[0].strip():
            raise ValueError("command is empty")
        return argv

    @field_validator("env")
    @classmethod
    def _no_reserved_env(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = sorted(RESERVED_ENV & set(value))
        if reserved:
            raise ValueError(
                f"env may not set {', '.join(reserved)}: the gateway sets them (the key comes from the vault)"
            )
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> RegisterTaskApp:
        if (self.url is None) == (self.command is None):
            raise ValueError(
                "give either url (an external Task App) or command (a managed one), not both or neither"
            )
        if self.url is not None and (self.cwd or self.env or self.limits):
            raise ValueError("cwd, env and limits apply to managed Task Apps only")
        return self


class ManagedStatus(BaseModel):
    state: str
    pid: int | None
    port: int | None
    restarts: int
    last_exit_code: int | None
    last_error: str | None


class TaskAppOut(BaseModel):
    org_id: str
    name: str
    kind: Literal["external", "managed"]
    url: str | None
    command: list[str] | None
    secret: str
    created_at: datetime
    managed: ManagedStatus | None = None


class Check(BaseModel):
    ok: bool
    detail: str


class VerifyReport(BaseModel):
    ok: bool
    healthy: Check
    accepts_key: Check
    refuses_wrong_key: Check
    contract: str | None = Field(
        None,
        description="Which contract it speaks: synth-taskapp-2025 (/info, /rollout) or "
        "synth-container (/metadata, /rollouts; rlnode.taskapp.containers); None when it "
        "could not be asked",
    )


class RunRollout(Strict):
    org_id: ResourceId
    task_app: ResourceId
    job_id: ResourceId | None = None
    timeout_s: float | None = Field(None, gt=0, le=86_400)
    request: RolloutRequest


MAX_ROLLOUTS_PER_CALL = 1024


class RunRollouts(Strict):
    """Rollouts of one job on one Task App (a generator sends a group's samples in one
    call): run at once, answered together and in order."""

    org_id: ResourceId
    task_app: ResourceId
    job_id: ResourceId | None = None
    timeout_s: float | None = Field(None, gt=0, le=86_400)
    requests: list[RolloutRequest] = Field(min_length=1, max_length=MAX_ROLLOUTS_PER_CALL)
    with_response: bool = Field(
        False, description="Include each Task App's full response beside its normalised result."
    )


class RolloutError(BaseModel):
    kind: str
    message: str
    status_code: int | None = None


class RolloutOutcome(BaseModel):
    """`status` "ok" with `result` (and the Task App's full `response`), or "failed" with a
    classified `error`. A failed rollout is an answer, not a gateway error: HTTP 200."""

    status: Literal["ok", "failed"]
    run_id: str
    result: NormalisedRollout | None = None
    response: dict[str, Any] | None = None
    error: RolloutError | None = None
    attempts: int = 0
    duration_s: float


class ErrorOut(BaseModel):
    detail: str


class RolloutOutcomes(BaseModel):
    outcomes: list[RolloutOutcome]
