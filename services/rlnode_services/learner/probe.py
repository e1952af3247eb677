"""Asking the gateway whether a job's Task App answers: its verification (healthy, accepts the
org's key, refuses a wrong one), with the learner's service token (taskapps:read). Intake
runs it before a job starts; the breaker (rlnode.training.breaker) runs it while a job is
paused. The gateway knows the Task App, managed or external, and holds the key; what comes
back is a verdict, never what the Task App sent."""

from __future__ import annotations

import asyncio
from typing import Any

from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.training.breaker import Probe
from rlnode_services.learner.settings import LearnerSettings

CHECKS = ("healthy", "accepts_key", "refuses_wrong_key")
# A managed Task App that is restarting may take the gateway's start timeout to answer.
PROBE_TIMEOUT_S = 60.0


def failed_checks(report: dict[str, Any]) -> str:
    """The checks a verification report failed, with the gateway's verdict on each."""
    return "; ".join(f"{k}: {report[k]['detail']}" for k in CHECKS if not report[k]["ok"])


def verify(gateway_url: str, token: str, org_id: str, name: str) -> dict[str, Any]:
    """The gateway's report; raises GatewayError when the gateway says no."""
    with GatewayClient(gateway_url, token, timeout_s=PROBE_TIMEOUT_S) as gateway:
        return gateway.verify(name, org_id)


def task_app_probe(settings: LearnerSettings, org_id: str, name: str) -> Probe:
    """The breaker's probe of org `org_id`'s Task App `name`: (passes verification, why)."""
    token = settings.service_token.get_secret_value() if settings.service_token else None

    def ask() -> tuple[bool, str]:
        if token is None:
            return False, "the learner has no service token (LEARNER_SERVICE_TOKEN) to ask with"
        try:
            report = verify(settings.gateway_url, token, org_id, name)
        except GatewayError as e:
            return False, f"the gateway could not verify it: {e}"
        if not report["ok"]:
            return False, failed_checks(report)
        return True, "passes the gateway's verification"

    async def probe() -> tuple[bool, str]:
        return await asyncio.to_thread(ask)

    return probe
