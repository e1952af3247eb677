"""Calls from the gateway to Task Apps, and what their failures are called.

Every failure is one of the Trajectory failure kinds (rlnode.messages.rollouts.FailureKind),
so a rollout-generator can publish it as it is. Only connection errors are retried: once a
request reached the Task App, sending it again could run the episode twice."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rlnode.messages.codec import describe_validation_error
from rlnode.service.pooled_http import ConnectFailed, ConnectionBroke, PooledHttp, Reply, TimedOut
from rlnode.taskapp.contract import (
    API_KEY_HEADER,
    NormalisedRollout,
    RolloutRequest,
    RolloutResponse,
)


class TaskAppFailure(Exception):
    def __init__(
        self, kind: str, message: str, status_code: int | None = None, verdict: str | None = None
    ) -> None:
        """`verdict`: the message without anything the Task App sent (what `verify` may
        report: the gateway is no way to read what an address answers)."""
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status_code = status_code
        self.verdict = verdict or message


@dataclass
class RolloutCall:
    result: NormalisedRollout
    response: RolloutResponse
    attempts: int
    duration_s: float


def _refusal_looks_like_auth(status: int, body: str) -> bool:
    # Synth's SDK answers a wrong key with 400 "unauthorised" (docs/architecture.md §8).
    if status in (401, 403):
        return True
    text = body.lower()
    return status == 400 and ("unauthori" in text or "api key" in text or "api_key" in text)


def classify_status(status: int, body: str) -> TaskAppFailure:
    excerpt = body[:300]
    if _refusal_looks_like_auth(status, body):
        kind, verdict = "task_app_auth_refused", f"the Task App refused the key ({status})"
    elif status >= 500:
        kind, verdict = "task_app_error", f"the Task App failed ({status})"
    else:
        kind, verdict = "task_app_error", f"the Task App refused the request ({status})"
    return TaskAppFailure(kind, f"{verdict}: {excerpt}", status, verdict)


class TaskAppClient:
    def __init__(self, connect_timeout_s: float, connect_retries: int) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.connect_retries = connect_retries
        self._http = PooledHttp(max_connections=1024, connect_timeout_s=connect_timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        url: str,
        key: str | None,
        timeout_s: float,
        json: Any = None,
        params: Any = None,
    ) -> tuple[Reply, int]:
        """One call, retried on connection errors only; returns (reply, attempts)."""
        headers = {API_KEY_HEADER: key} if key is not None else {}
        attempts = 0
        while True:
            attempts += 1
            try:
                reply = await self._http.request(
                    method, url, headers=headers, json=json, params=params, timeout_s=timeout_s
                )
                return reply, attempts
            except ConnectFailed as e:
                if attempts > self.connect_retries:
                    raise TaskAppFailure(
                        "task_app_unreachable",
                        f"cannot connect to the Task App at {url} after {attempts} attempts: {e}",
                    ) from None
                await asyncio.sleep(min(0.2 * 2 ** (attempts - 1), 2.0))
            except TimedOut:
                raise TaskAppFailure(
                    "timeout", f"the Task App did not answer {method} {url} within {timeout_s:g}s"
                ) from None
            except ConnectionBroke as e:
                raise TaskAppFailure(
                    "task_app_error", f"the connection to the Task App broke: {e}"
                ) from None

    async def get_json(
        self, base_url: str, path: str, key: str | None, timeout_s: float = 10.0, params: Any = None
    ) -> Any:
        response, _ = await self.request(
            "GET", base_url.rstrip("/") + path, key, timeout_s, params=params
        )
        if response.status != 200:
            raise classify_status(response.status, response.text)
        try:
            return response.json()
        except ValueError:
            raise TaskAppFailure(
                "task_app_invalid_response",
                f"{path} did not answer JSON: {response.text[:200]}",
                verdict=f"{path} did not answer JSON",
            ) from None

    async def rollout(
        self, base_url: str, key: str, request: RolloutRequest, timeout_s: float
    ) -> RolloutCall:
        started = time.monotonic()
        response, attempts = await self.request(
            "POST",
            base_url.rstrip("/") + "/rollout",
            key,
            timeout_s,
            json=request.model_dump(mode="json"),
        )
        if response.status != 200:
            raise classify_status(response.status, response.text)
        try:
            parsed = RolloutResponse.model_validate_json(response.content)
        except ValidationError as e:
            if any(err["type"] == "json_invalid" for err in e.errors()):
                raise TaskAppFailure(
                    "task_app_invalid_response",
                    f"/rollout did not answer JSON: {response.text[:200]}",
                ) from None
            raise TaskAppFailure(
                "task_app_invalid_response", describe_validation_error(e, "RolloutResponse")
            ) from None
        if parsed.run_id != request.run_id:
            raise TaskAppFailure(
                "task_app_invalid_response",
                f"/rollout answered run_id {parsed.run_id!r} for {request.run_id!r}",
            )
        try:
            result = NormalisedRollout.from_response(parsed)
        except ValueError as e:
            raise TaskAppFailure("task_app_invalid_response", str(e)) from None
        return RolloutCall(result, parsed, attempts, time.monotonic() - started)
