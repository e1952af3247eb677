"""Deciding whether a job request can run: a valid org token with jobs:write for the org
it names, a Task App the gateway has and verifies, the secret it needs in the vault, and a
GPU plan that fits. Each refusal says what to do."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlnode.messages import JobConfig, JobRequest
from rlnode.node.plan import PlanError, make_plan
from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.sdk.vault import VaultClient, VaultError
from rlnode.service.auth import AuthError, Scope, TokenVerifier
from rlnode_services.learner.settings import LearnerSettings


@dataclass
class Verdict:
    ok: bool
    reason: str = ""


class JobIntake:
    def __init__(self, settings: LearnerSettings, verifier: TokenVerifier) -> None:
        self.settings = settings
        self.verifier = verifier
        self._token = settings.service_token.get_secret_value() if settings.service_token else None

    async def check(self, request: JobRequest) -> Verdict:
        try:
            claims = await asyncio.to_thread(self.verifier.verify, request.token)
            self.verifier.authorize_claims(claims, scopes=[Scope.JOBS_WRITE], org_id=request.org_id)
        except AuthError as e:
            return Verdict(False, f"the request's token was refused: {e.message}")
        if request.action == "cancel":
            return Verdict(True)
        assert request.config is not None
        plan = self.check_plan(request.config)
        if not plan.ok:
            return plan
        if self._token is None:
            return Verdict(
                False,
                "the learner has no service token (LEARNER_SERVICE_TOKEN) to check Task Apps and secrets with; ask the node's operator",
            )
        return await asyncio.to_thread(self._check_dependencies, request.org_id, request.config)

    def check_plan(self, config: JobConfig) -> Verdict:
        """The job's topology against this node's GPUs (rlnode.node.plan: the rules `rlnode plan`
        prints)."""
        try:
            make_plan(self.settings.visible_gpus, config.topology)
        except PlanError as e:
            return Verdict(False, f"the GPU plan does not fit this node: {e}")
        return Verdict(True)

    def _check_dependencies(self, org_id: str, config: JobConfig) -> Verdict:
        name, secret = config.task_app.name, config.task_app.secret
        try:
            with VaultClient(self.settings.vault_url, self._token) as vault:
                vault.get_secret_info(secret, org_id)
        except VaultError as e:
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
            if e.status == 404:
                return Verdict(
                    False,
                    f"org {org_id!r} has no Task App named {name!r}: register it with `rlnode taskapp register {name}`",
                )
            return Verdict(
                False, f"could not check the Task App {name!r} with the gateway: {e.message}"
            )
        if not report["ok"]:
            failed = [
                f"{k}: {report[k]['detail']}"
                for k in ("healthy", "accepts_key", "refuses_wrong_key")
                if not report[k]["ok"]
            ]
            return Verdict(
                False,
                f"the Task App {name!r} does not pass verification ({'; '.join(failed)}); `rlnode taskapp verify {name}` shows it",
            )
        return Verdict(True)
