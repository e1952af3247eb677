"""Deciding whether a job request can run: a job token (single-use, for this job, of the org
it names, with jobs:write), a Task App the gateway has and verifies, the secret it needs in
the vault, and a GPU plan that fits. Each refusal says what to do."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, delete

from rlnode.bus import Retryable
from rlnode.messages import JobConfig, JobRequest, utc_now
from rlnode.node.plan import PlanError, make_plan
from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.sdk.vault import VaultClient, VaultError
from rlnode.service.auth import LEEWAY_S, AuthError, Scope, TokenClaims, TokenVerifier
from rlnode.service.db import session_scope
from rlnode_services.learner.limits import (
    OverLimit,
    check_checkpoint_bytes,
    check_limits,
    check_model_source,
    check_org_jobs,
    check_trackers,
)
from rlnode_services.learner.probe import failed_checks
from rlnode_services.learner.settings import LearnerSettings
from rlnode_services.learner.store import UsedJobToken

# Used tokens are kept until they could no longer pass verification anyway.
LEEWAY = timedelta(seconds=LEEWAY_S)


# A dependency's answer that says nothing of the job: 0 = no answer at all (the SDK
# clients' status for a connection that failed), 503 = it cannot answer just now.
UNAVAILABLE = (0, 503)


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    # This very request was judged before (it is handled again after a failure): what it
    # did then (its job record) is its own, not a reuse of the job id.
    repeated: bool = False
    # Its job token was the org's: the org it names is who sent it.
    org_verified: bool = False


class JobIntake:
    def __init__(self, settings: LearnerSettings, verifier: TokenVerifier, engine: Engine) -> None:
        self.settings = settings
        self.verifier = verifier
        self.engine = engine
        self._token = settings.service_token.get_secret_value() if settings.service_token else None

    async def check(self, request: JobRequest) -> Verdict:
        try:
            claims = await asyncio.to_thread(self.verifier.verify, request.token)
            self.verifier.authorize_claims(claims, scopes=[Scope.JOBS_WRITE], org_id=request.org_id)
        except AuthError as e:
            if e.status == 503:  # the vault cannot check tokens just now: not a verdict
                raise Retryable(e.message) from None
            return Verdict(False, f"the request's token was refused: {e.message}")
        if claims.kind != "job":
            return Verdict(
                False,
                f"the request carries {'an org' if claims.kind == 'org' else 'a service'} token: "
                "job requests carry a job token (rlnode job start and the SDK mint one; or POST "
                f"/v1/orgs/{request.org_id}/job-tokens on the vault). Anyone who reads the topic "
                "has seen that token: revoke it (rlnode token revoke)",
            )
        if claims.job_id != request.job_id:
            return Verdict(
                False,
                f"the request's job token is for job {claims.job_id!r}, not {request.job_id!r}",
            )
        taken = await asyncio.to_thread(self._take, claims, request)
        if taken is None:
            return Verdict(
                False, "the request's job token was used already: each is good for one request"
            )
        verdict = await self._judge(request)
        verdict.repeated = taken == "again"
        verdict.org_verified = True
        return verdict

    async def _judge(self, request: JobRequest) -> Verdict:
        if request.action == "cancel":
            return Verdict(True)
        assert request.config is not None
        try:
            check_limits(self.settings, request.config)
            check_model_source(self.settings, request.config, request.org_id)
            check_checkpoint_bytes(self.settings, request.config)
            check_trackers(request.config)
            await asyncio.to_thread(check_org_jobs, self.settings, self.engine, request.org_id)
        except OverLimit as e:
            return Verdict(False, str(e))
        plan = self.check_plan(request.config)
        if not plan.ok:
            return plan
        if self._token is None:
            return Verdict(
                False,
                "the learner has no service token (LEARNER_SERVICE_TOKEN) to check Task Apps and secrets with; ask the node's operator",
            )
        return await asyncio.to_thread(self._check_dependencies, request.org_id, request.config)

    def _take(self, claims: TokenClaims, request: JobRequest) -> Literal["new", "again"] | None:
        """Mark the job token used: "new"; "again" if this very request took it before
        (handled again after a failure); None if another request did. Expired ones are
        forgotten here (the verifier refuses them anyway)."""
        now = utc_now()
        try:
            with session_scope(self.engine) as s:
                s.exec(delete(UsedJobToken).where(col(UsedJobToken.expires_at) < now - LEEWAY))
                s.add(
                    UsedJobToken(
                        token_id=claims.token_id,
                        job_id=request.job_id,
                        request_id=str(request.id),
                        expires_at=datetime.fromtimestamp(claims.expires_at, UTC),
                    )
                )
        except IntegrityError:
            with Session(self.engine) as s:
                held = s.get(UsedJobToken, claims.token_id)
            return "again" if held is not None and held.request_id == str(request.id) else None
        return "new"

    def check_plan(self, config: JobConfig) -> Verdict:
        """The job's topology against this host's GPUs and roles (rlnode.node.plan: the rules
        `rlnode plan --role` prints). On a host without inference, what the topology says of
        engines is the inference hosts' to plan, not this one's."""
        roles = tuple(self.settings.host_roles)
        topology = config.topology
        if "inference" not in roles:
            topology = topology.model_copy(update={"inference_gpus": "auto"})
        try:
            make_plan(self.settings.visible_gpus, topology, roles)
        except PlanError as e:
            where = "this node" if "inference" in roles else "this training host"
            return Verdict(False, f"the GPU plan does not fit {where}: {e}")
        return Verdict(True)

    def _check_dependencies(self, org_id: str, config: JobConfig) -> Verdict:
        name, secret = config.task_app.name, config.task_app.secret
        try:
            with VaultClient(self.settings.vault_url, self._token) as vault:
                vault.get_secret_info(secret, org_id)
        except VaultError as e:
            # Unreachable (restarting, say) or its database down: not a verdict on the job,
            # ask again later (the request waits on its partition, as for a token check).
            if e.status in UNAVAILABLE:
                raise Retryable(e.message) from None
            if e.status == 404:
                return Verdict(
                    False,
                    f"org {org_id!r} has no secret {secret!r}: set it with `rlnode secrets set {secret}`",
                )
            return Verdict(
                False, f"could not check the secret {secret!r} with the vault: {e.message}"
            )
        try:
            with GatewayClient(self.settings.gateway_url, self._token) as gateway:
                report = gateway.verify(name, org_id)
        except GatewayError as e:
            if e.status in UNAVAILABLE:
                raise Retryable(e.message) from None
            if e.status == 404:
                return Verdict(
                    False,
                    f"org {org_id!r} has no Task App named {name!r}: register it with `rlnode taskapp register {name}`",
                )
            return Verdict(
                False, f"could not check the Task App {name!r} with the gateway: {e.message}"
            )
        if not report["ok"]:
            return Verdict(
                False,
                f"the Task App {name!r} does not pass verification ({failed_checks(report)}); `rlnode taskapp verify {name}` shows it",
            )
        return Verdict(True)
