"""Sampling sessions' requests, served by the node's rollout-generators: the SDK's asample
becomes a SampleRequest (rlnode.messages.tinker) to one of them, in the background; its
answer, as the SDK's protobuf SampleResponse, resolves the future."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import httpx

from rlnode.messages.config import LoraSpec
from rlnode.messages.tinker import SampleRequest, SampleResult
from rlnode.service.pooled_http import IDLE_CONNECTION_S
from rlnode_services.tinker_api import wire
from rlnode_services.tinker_api.futures import Answer, Futures
from rlnode_services.tinker_api.settings import TinkerApiSettings

log = logging.getLogger("tinker-api.sampling")
# What the SDK may ask that this node does not compute (refused, naming it).
UNSUPPORTED = {
    "topk_prompt_logprobs": "top-k prompt logprobs",
    "topk_sample_logprobs": "top-k sample logprobs",
    "prompt_alt_tokens_k": "alternative prompt tokens",
}


def sample_request(
    body: dict[str, Any],
    *,
    org_id: str,
    base_source: str,
    job_id: str | None,
    weight_version: int | None,
    weights_uri: str | None,
    adapter: LoraSpec | None,
) -> SampleRequest:
    """The generator's request for the SDK's SampleRequest `body` (WireError: not servable)."""
    for key, what in UNSUPPORTED.items():
        if body.get(key):
            raise wire.WireError(f"{key}: {what} are not computed by this node; ask for 0")
    if body.get("target_prompt_logprobs") is not None:
        raise wire.WireError("target_prompt_logprobs are not computed by this node")
    params = body.get("sampling_params") or {}
    stop = params.get("stop")
    stop_strings: list[str] = []
    stop_ids: list[int] = []
    if isinstance(stop, str):
        stop_strings = [stop]
    elif isinstance(stop, list):
        stop_strings = [s for s in stop if isinstance(s, str)]
        stop_ids = [int(s) for s in stop if not isinstance(s, str)]
    try:
        return SampleRequest(
            org_id=org_id,
            job_id=job_id,
            base_model=base_source,
            weights_uri=weights_uri,
            weight_version=weight_version,
            adapter=adapter,
            prompt_ids=wire.prompt_tokens(body.get("prompt") or {}),
            num_samples=int(body.get("num_samples") or 1),
            max_tokens=int(params.get("max_tokens") or 256),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            seed=params.get("seed"),
            stop=stop_strings,
            stop_token_ids=stop_ids,
            prompt_logprobs=bool(body.get("prompt_logprobs")),
        )
    except ValueError as e:
        raise wire.WireError(f"the sample request: {e}") from None


class Sampling:
    def __init__(self, settings: TinkerApiSettings, futures: Futures) -> None:
        self.settings, self.futures = settings, futures
        self._next = itertools.cycle(range(max(1, len(settings.generator_list))))
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, request_id: str, request: SampleRequest, last_n: int | None) -> None:
        task = asyncio.create_task(self._serve(request_id, request, last_n))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request_id: str, request: SampleRequest, last_n: int | None) -> None:
        try:
            result = await self._ask(request)
            answer = Answer(wire.sample_response(result, last_n), "application/x-protobuf")
        except SampleFailed as e:
            answer = Answer.error(str(e), e.category)
        except Exception as e:  # ours: the client hears of it, the service goes on
            log.exception("sample request %s failed", request_id)
            answer = Answer.error(f"sampling failed: {type(e).__name__}: {e}", "server")
        self.futures.resolve(request_id, answer)

    async def _ask(self, request: SampleRequest) -> SampleResult:
        generators = self.settings.generator_list
        if not generators:
            raise SampleFailed("no rollout-generator serves sampling (TINKER_API_GENERATOR_URLS)")
        token = self.settings.service_token
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.settings.sample_timeout_s,
                limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S),
            )
        last: str = ""
        for _ in range(len(generators)):  # the next one when one cannot be reached
            url = generators[next(self._next) % len(generators)] + "/v1/tinker/sample"
            try:
                answer = await self._client.post(
                    url, content=request.model_dump_json(), headers=headers | _JSON
                )
            except httpx.HTTPError as e:
                last = f"{url}: {type(e).__name__}: {e}"
                continue
            if answer.status_code == 200:
                return SampleResult.model_validate_json(answer.content)
            detail = _detail(answer)
            if answer.status_code == 400:
                raise SampleFailed(detail, "user")
            last = f"{url} answered {answer.status_code}: {detail}"
        raise SampleFailed(f"no generator could sample: {last}")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()


class SampleFailed(Exception):
    def __init__(self, message: str, category: str = "server") -> None:
        super().__init__(message)
        self.category = category


_JSON = {"Content-Type": "application/json"}


def _detail(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return answer.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body.get("detail", body)) if isinstance(body, dict) else str(body)
