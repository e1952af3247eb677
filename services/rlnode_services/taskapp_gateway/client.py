"""Calls from the gateway to Task Apps, and what their failures are called.

Every failure is one of the Trajectory failure kinds (rlnode.messages.rollouts.FailureKind),
so a rollout-generator can publish it as it is. Only connection errors are retried: once a
request reached the Task App, sending it again could run the episode twice.

A Task App speaks Synth's 2025 contract (`rollout`) or its container contract
(`container_rollout`; rlnode.taskapp.containers); `detect` tells which."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rlnode.messages.codec import describe_validation_error
from rlnode.service.pooled_http import ConnectFailed, ConnectionBroke, PooledHttp, Reply, TimedOut
from rlnode.taskapp import containers
from rlnode.taskapp.containers import ContainerApp
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

    # -- Synth's container contract (rlnode.taskapp.containers) ----------------------------

    async def detect(self, base_url: str, key: str | None) -> ContainerApp | None:
        """The container at `base_url` as its /metadata and /dataset (or /taskset) describe
        it; None for a 2025 Task App (no container /metadata)."""
        base = base_url.rstrip("/")
        metadata = await self._optional_json(base + "/metadata", key)
        if containers.container_app(metadata) is None:
            return None
        dataset = await self._optional_json(base + "/dataset", key)
        serves_rows = dataset is not None
        if dataset is None:
            dataset = await self._optional_json(base + "/taskset", key)
        return containers.container_app(metadata, dataset, serves_rows)

    async def _optional_json(self, url: str, key: str | None) -> Any:
        """What GET `url` answers, or None when the route is not there (or answers no JSON)."""
        reply, _ = await self.request("GET", url, key, 10.0)
        if reply.status in (404, 405):
            return None
        if reply.status != 200:
            raise classify_status(reply.status, reply.text)
        try:
            return reply.json()
        except ValueError:
            return None

    async def container_rollout(
        self,
        base_url: str,
        key: str,
        request: RolloutRequest,
        timeout_s: float,
        app: ContainerApp,
    ) -> RolloutCall:
        """Submit it (async), poll its record until terminal, and stop it past `timeout_s`."""
        started = time.monotonic()
        deadline = started + timeout_s
        base = base_url.rstrip("/")
        split, row = app.split_for(request.mode), None
        if split is not None and app.serves_rows and request.env.seed is not None:
            rows = await self._json_of(
                "POST",
                base + "/dataset/rows",
                key,
                deadline,
                {"split": split, "seeds": [request.env.seed]},
            )
            found = rows.get("rows") if isinstance(rows, dict) else None
            if isinstance(found, list) and found and isinstance(found[0], dict):
                row = found[0]
        body = containers.rollout_body(request, split, row)
        rollout = f"{base}/rollouts/{body['rollout_id']}"
        try:
            record = await self._json_of("POST", base + "/rollouts", key, deadline, body)
            delay = 0.01  # polls: quick for short episodes, at most 4 a second for long ones
            while isinstance(record, dict) and containers.in_progress(record):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TaskAppFailure("timeout", "past its time")
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.25)
                record = await self._json_of("GET", rollout, key, deadline)
        except TaskAppFailure as e:
            if e.kind != "timeout":
                raise
            # The contract's way to stop it: the container cancels it and keeps serving.
            with contextlib.suppress(TaskAppFailure):
                await self.request("POST", rollout + "/terminate", key, 5.0, json={})
            raise TaskAppFailure(
                "timeout",
                f"the Task App did not finish rollout {body['rollout_id']} within "
                f"{timeout_s:g}s (asked it to terminate the rollout)",
            ) from None
        try:
            response = containers.rollout_response(request, record)
        except containers.ContainerRolloutFailed as e:
            raise TaskAppFailure("task_app_error", str(e)) from None
        except ValueError as e:
            raise TaskAppFailure("task_app_invalid_response", str(e)) from None
        result = NormalisedRollout.from_response(response)
        return RolloutCall(result, response, 1, time.monotonic() - started)

    async def _json_of(
        self, method: str, url: str, key: str, deadline: float, json: Any = None
    ) -> Any:
        # A poll answers at once; one that comes as the time runs out still gets a moment.
        timeout_s = max(deadline - time.monotonic(), 0.5)
        reply, _ = await self.request(method, url, key, timeout_s, json=json)
        if reply.status not in (200, 202):
            raise classify_status(reply.status, reply.text)
        try:
            return reply.json()
        except ValueError:
            path = url.split("/", 3)[-1]
            raise TaskAppFailure(
                "task_app_invalid_response", f"/{path} did not answer JSON: {reply.text[:200]}"
            ) from None
