"""Real HTTP servers for gateway tests: a scripted policy behind an OpenAI-compatible
endpoint, and Task Apps that misbehave in specific ways. They are stand-ins for the *user's*
code (a model, a buggy Task App), never for rlnode's own components."""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
from collections import Counter
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import PlainTextResponse


def scripted_policy() -> tuple[FastAPI, Counter]:
    """Answers chat completions like a competent model would on the example tasks: copies
    "Copy: xxx" exactly, and binary-searches guess-a-number from the feedback so far."""
    app = FastAPI()
    calls: Counter = Counter()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        messages = body["messages"]
        calls[body.get("model", "")] += 1
        text = "I do not know"
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        if last_user.startswith("Copy: "):
            text = last_user.removeprefix("Copy: ")
        elif match := re.search(r"between 1 and (\d+)", system):
            low, high = 1, int(match.group(1))
            for said, heard in itertools.pairwise(messages):
                if said["role"] == "assistant" and heard["role"] == "user":
                    guess = int(said["content"])
                    if heard["content"] == "higher":
                        low = guess + 1
                    elif heard["content"] == "lower":
                        high = guess - 1
            text = str((low + high) // 2)
        return {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "policy"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }

    return app, calls


def misbehaving_taskapps(key: str) -> FastAPI:
    """One server, one misbehaviour per path prefix: /garbage, /shape, /hang, /crash,
    /synth400, /noreward, /nokeycheck, /oddseeds (crashes on odd seeds only). All but
    /nokeycheck check the key."""
    app = FastAPI()

    def check(mode: str, given: str | None) -> None:
        if mode != "nokeycheck" and given != key:
            if mode == "synth400":
                raise HTTPException(400, "unauthorised")
            raise HTTPException(401, "invalid API key")

    @app.get("/{mode}/health")
    async def health(mode: str, x_api_key: str | None = Header(None)) -> dict[str, Any]:
        check(mode, x_api_key)
        return {"healthy": True}

    @app.get("/{mode}/info")
    async def info(mode: str, x_api_key: str | None = Header(None)) -> dict[str, Any]:
        check(mode, x_api_key)
        return {"service": {"name": mode}}

    @app.post("/{mode}/rollout")
    async def rollout(mode: str, request: Request, x_api_key: str | None = Header(None)):
        if mode == "synth400":
            raise HTTPException(
                400, "unauthorised"
            )  # as Synth's SDK answers a key it does not like
        check(mode, x_api_key)
        body = await request.json()
        if mode == "garbage":
            return PlainTextResponse("<html>Internal things happened</html>")
        if mode == "shape":
            return {"run_id": body["run_id"], "result": "done"}
        if mode == "hang":
            await asyncio.sleep(60)
        if mode == "crash" or (mode == "oddseeds" and body["env"]["seed"] % 2):
            raise HTTPException(500, "Traceback: KeyError 'board'")
        if mode == "noreward":
            return {
                "run_id": body["run_id"],
                "trajectories": [{"steps": [{"obs": {}, "tool_calls": []}]}],
            }
        return {
            "run_id": body["run_id"],
            "trajectories": [
                {
                    "env_id": "e",
                    "policy_id": "p",
                    "steps": [{"obs": {}, "tool_calls": [], "reward": 0.5, "done": True}],
                    "length": 1,
                }
            ],
            "metrics": {"episode_returns": [0.5], "mean_return": 0.5, "num_steps": 1},
        }

    return app


class RecordingPolicy:
    """An OpenAI-compatible endpoint that keeps every request it answers: subclasses write
    `chat(request)` (the user's model, scripted), calling `record` with the body first."""

    def __init__(self) -> None:
        self.url = ""  # once served
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    def record(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.bodies.append(body)

    def take(self) -> list[dict[str, Any]]:
        """The requests since the last `take`."""
        with self.lock:
            bodies, self.bodies = self.bodies, []
        return bodies

    async def chat(self, request: Request) -> Any:
        raise NotImplementedError

    @staticmethod
    def completion(body: dict[str, Any], message: dict[str, Any], finish_reason: str) -> dict:
        """A chat completion answering `body` with `message`."""
        return {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        }
