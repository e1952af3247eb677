"""Write a Task App in a few functions.

    def make_task(seed, config) -> dict           # the task for a seed (shown by /task_info)
    async def run_episode(task, episode) -> None  # ask the policy (episode.chat), score (episode.step)

`create_task_app(TaskAppDefinition(...))` gives a FastAPI app with `/health`, `/info`,
`/task_info` and `/rollout` (the contract in docs/taskapp-contract.md), guarded by the
`ENVIRONMENT_API_KEY` it is started with; `serve(definition)` runs it on $HOST:$PORT.
`single_turn(prompt, reward)` builds `run_episode` for one-question tasks.

An episode that raises fails that rollout (500, with the exception's type and message) and the
app goes on. For code that may also hang or crash (an environment library's generator or
scorer), pass `Isolated(build, kwargs)` instead of the definition: the episodes then run in
worker processes that a deadline can kill (rlnode.taskapp.workers).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from rlnode.service.pooled_http import PooledHttp
from rlnode.taskapp.contract import (
    RolloutMetrics,
    RolloutRequest,
    RolloutResponse,
    RolloutStep,
    RolloutTrajectory,
    TaskInfo,
)
from rlnode.taskapp.inference import ChatResult, InferenceClient, InferenceError
from rlnode.taskapp.workers import EpisodeError, EpisodeWorkers, Isolated

KEY_ENV = "ENVIRONMENT_API_KEY"
MAX_TASK_INFO_SEEDS = 256


class Policy(Protocol):
    """What an episode asks for actions: OpenAI-style chat (`InferenceClient` over HTTP)."""

    @property
    def calls(self) -> int:
        """How many chat calls the episode has made so far."""
        ...

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatResult: ...


class Episode:
    """What `run_episode` works with: the policy (`chat`) and the record (`step`)."""

    def __init__(self, request: RolloutRequest, policy: Policy) -> None:
        self.request = request
        self.seed = request.env.seed if request.env.seed is not None else 0
        self.config = request.env.config
        self._policy = policy
        self.steps: list[RolloutStep] = []
        # Numbers about the episode for the rollout's metrics.details (the learner averages
        # them per step into train.step's task_metrics): per-task accuracy, a level.
        self.details: dict[str, float] = {}

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatResult:
        """One inference call on the rollout's inference URL (OpenAI chat format)."""
        return await self._policy.chat(messages, **sampling)

    def step(
        self,
        observation: dict[str, Any],
        action: str,
        reward: float | None,
        done: bool = False,
        info: dict[str, Any] | None = None,
    ) -> None:
        """Record a step: what the policy saw, what it did, what it earned."""
        self.steps.append(
            RolloutStep(
                obs=observation,
                tool_calls=[{"type": "text", "text": action}],
                reward=reward,
                done=done,
                info=info or {},
            )
        )

    @property
    def total_reward(self) -> float:
        return float(sum(s.reward or 0.0 for s in self.steps))


@dataclass
class TaskAppDefinition:
    name: str
    make_task: Callable[[int, dict[str, Any]], dict[str, Any]]
    run_episode: Callable[[dict[str, Any], Episode], Awaitable[None]]
    description: str = ""
    version: str = "1"
    dataset: dict[str, Any] = field(default_factory=dict)
    action_space: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    rubric: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=lambda: {"max_turns": 1})


def single_turn(
    prompt: Callable[[dict[str, Any]], list[dict[str, Any]]],
    reward: Callable[[dict[str, Any], str], float],
) -> Callable[[dict[str, Any], Episode], Awaitable[None]]:
    """`run_episode` for a one-question task: ask `prompt(task)`, score with `reward(task, answer)`."""

    async def run_episode(task: dict[str, Any], episode: Episode) -> None:
        messages = prompt(task)
        answer = await episode.chat(messages)
        episode.step(
            {"messages": messages},
            answer.text,
            reward(task, answer.text),
            done=True,
            info={"finish_reason": answer.finish_reason},
        )

    return run_episode


def _expected_key() -> str | None:
    return os.environ.get(KEY_ENV) or None


async def require_api_key(
    x_api_key: Annotated[str | None, Header(alias="X-API-Key")] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> None:
    """The key in X-API-Key or Authorization: Bearer, compared in constant time."""
    expected = _expected_key()
    if expected is None:
        raise HTTPException(
            503, f"this Task App has no key configured: start it with {KEY_ENV} set"
        )
    given = x_api_key
    if given is None and authorization and authorization.lower().startswith("bearer "):
        given = authorization[7:].strip()
    if given is None:
        raise HTTPException(401, "missing API key: send it in X-API-Key (or Authorization: Bearer)")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(401, "invalid API key")


Authorized = Annotated[None, Depends(require_api_key)]


def policy_for(request: RolloutRequest, client: PooledHttp | None) -> InferenceClient:
    """The policy a rollout's episode asks: the request's inference URL, model and sampling.
    `client`: a connection pool shared by the app's episodes (None: one of its own)."""
    config = request.policy.config
    return InferenceClient(
        config.inference_url,
        config.model,
        {"max_tokens": config.max_tokens, "temperature": config.temperature, "top_p": config.top_p},
        timeout_s=request.safety.max_time_s,
        client=client,
    )


def create_task_app(app_spec: TaskAppDefinition | Isolated) -> FastAPI:
    isolated = app_spec if isinstance(app_spec, Isolated) else None
    definition = isolated.definition() if isolated else app_spec
    assert isinstance(definition, TaskAppDefinition)
    workers: EpisodeWorkers | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal workers
        # One connection pool for every episode's inference calls (see InferenceClient).
        client = PooledHttp()
        app.state.inference_http = client
        workers = EpisodeWorkers(isolated) if isolated else None
        app.state.episode_workers = workers
        try:
            yield
        finally:
            await client.aclose()
            if workers is not None:
                workers.close()

    async def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
        try:
            if workers is not None:
                return await workers.make_task(seed, config)
            return definition.make_task(seed, config)
        except EpisodeError as e:
            raise HTTPException(504 if e.timed_out else 500, str(e)) from None
        except Exception as e:
            raise HTTPException(500, f"making the task raised {type(e).__name__}: {e}") from None

    app = FastAPI(
        title=f"Task App: {definition.name}", version=definition.version, lifespan=lifespan
    )

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail})

    async def task_info(seed: int, config: dict[str, Any]) -> TaskInfo:
        return TaskInfo(
            task={"id": definition.name, "seed": seed, **(await make_task(seed, config))},
            environments=[definition.name],
            action_space=definition.action_space,
            observation={"type": "chat"},
            dataset={"id": definition.name, **definition.dataset},
            rubric=definition.rubric,
            inference={"endpoint": "/v1/chat/completions", "format": "openai"},
            capabilities={"multi_turn": definition.limits.get("max_turns", 1) > 1},
            limits=definition.limits,
        )

    @app.get("/health")
    async def health(_: Authorized) -> dict[str, Any]:
        return {
            "healthy": True,
            "service": {"name": definition.name, "version": definition.version},
        }

    @app.get("/info")
    async def info(_: Authorized) -> dict[str, Any]:
        return {
            "service": {
                "name": definition.name,
                "version": definition.version,
                "description": definition.description,
            },
            "dataset": {"id": definition.name, **definition.dataset},
            "capabilities": {
                "rollout": True,
                "multi_turn": definition.limits.get("max_turns", 1) > 1,
            },
            "limits": definition.limits,
        }

    @app.get("/task_info")
    async def task_infos(
        _: Authorized, seeds: Annotated[list[int] | None, Query()] = None
    ) -> list[dict[str, Any]]:
        seeds = seeds or [0]
        if len(seeds) > MAX_TASK_INFO_SEEDS:
            raise HTTPException(400, f"ask for at most {MAX_TASK_INFO_SEEDS} seeds at once")
        return [(await task_info(seed, {})).model_dump() for seed in seeds]

    @app.post("/rollout", response_model=RolloutResponse)
    async def rollout(request: RolloutRequest, http_request: Request, _: Authorized) -> Response:
        try:
            if workers is not None:
                response = await workers.rollout(request)
            else:
                # No pool outside the app's lifespan (a test's bare app): the policy's own.
                policy = policy_for(
                    request, getattr(http_request.app.state, "inference_http", None)
                )
                try:
                    response = await run_rollout(definition, request, policy)
                finally:
                    await policy.aclose()
        except InferenceError as e:
            raise HTTPException(502, str(e)) from None
        except EpisodeError as e:
            raise HTTPException(504 if e.timed_out else 500, str(e)) from None
        except Exception as e:
            raise HTTPException(500, f"the episode raised {type(e).__name__}: {e}") from None
        # Encoded once by pydantic: FastAPI would turn the model into a dict, check it against
        # the response model and encode that again.
        return Response(response.model_dump_json(), media_type="application/json")

    return app


async def run_rollout(
    definition: TaskAppDefinition, request: RolloutRequest, policy: Policy
) -> RolloutResponse:
    """Play one episode of `definition` as `request` asks, with `policy` answering its chat
    calls (over HTTP from `/rollout`; in-process for the job loop's tests and benchmarks).
    An episode that runs out of time is aborted, not failed."""
    started = time.monotonic()
    seed = request.env.seed if request.env.seed is not None else 0
    task = definition.make_task(seed, request.env.config)
    episode = Episode(request, policy)
    aborted = False
    try:
        async with asyncio.timeout(request.safety.max_time_s):
            await definition.run_episode(task, episode)
    except TimeoutError:
        aborted = True
    total = episode.total_reward
    trajectory = RolloutTrajectory(
        env_id=f"{definition.name}:{seed}",
        policy_id=request.policy.policy_id or request.policy.config.model,
        steps=episode.steps,
        final={"reward": total, "aborted": aborted},
        length=len(episode.steps),
    )
    return RolloutResponse(
        run_id=request.run_id,
        trajectories=[trajectory],
        metrics=RolloutMetrics(
            episode_returns=[total],
            mean_return=total,
            num_steps=len(episode.steps),
            num_episodes=1,
            outcome_score=total,
            details={
                # An episode whose library calls the policy with a client of its own
                # (verifiers) counts its calls itself: its count is the one kept.
                "inference_calls": policy.calls,
                "duration_s": time.monotonic() - started,
                **episode.details,
            },
        ),
        aborted=aborted,
        ops_executed=len(episode.steps),
    )


def serve(app_spec: TaskAppDefinition | Isolated, argv: list[str] | None = None) -> int:
    """Run the Task App on $HOST:$PORT (or --host/--port) until SIGTERM."""
    import argparse

    import uvicorn

    definition = app_spec.definition() if isinstance(app_spec, Isolated) else app_spec
    parser = argparse.ArgumentParser(description=definition.description or definition.name)
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    args = parser.parse_args(argv)
    if _expected_key() is None:
        print(f"warning: {KEY_ENV} is not set: every call will get 503", file=sys.stderr)
    uvicorn.run(create_task_app(app_spec), host=args.host, port=args.port, log_level="warning")
    return 0
