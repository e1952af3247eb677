"""Client of the checkpoint-server: your jobs and checkpoints, their files and metrics, and
chat with any checkpoint (the server is OpenAI-compatible: the `openai` client works too,
with base_url=<server>/v1 and your org token as the API key)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlnode.sdk.http import ApiClient, ApiError
from rlnode.service.registry import CHECKPOINT_SERVER


class CheckpointError(ApiError):
    service = "checkpoint-server"


class CheckpointClient(ApiClient):
    error = CheckpointError
    spec = CHECKPOINT_SERVER

    def __init__(
        self, url: str | None = None, token: str | None = None, *, timeout_s: float = 300.0
    ) -> None:
        super().__init__(url, token, timeout_s=timeout_s)

    def jobs(self) -> list[dict]:
        return self._request("GET", "/v1/jobs")

    def job(self, job_id: str) -> dict:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def metrics(self, job_id: str) -> list[dict]:
        text = self._request("GET", f"/v1/jobs/{job_id}/metrics")
        return [json.loads(line) for line in str(text).splitlines() if line.strip()]

    def evals(self, job_id: str) -> list[dict]:
        """The job's evaluation rounds (eval.completed), by step."""
        return self._request("GET", f"/v1/jobs/{job_id}/evals")

    def checkpoints(self, job_id: str | None = None) -> list[dict]:
        return self._request("GET", "/v1/checkpoints", params={"job": job_id} if job_id else None)

    def checkpoint(self, model: str) -> tuple[dict, dict]:
        """A checkpoint (`<job>@<step>`, `@latest` or `@best`): its listing entry (step, uri)
        and the trainer state saved with it (step, and the job's config where it has one)."""
        job_id, _, which = model.rpartition("@")
        if not job_id:
            raise CheckpointError(400, f"{model!r} is not '<job_id>@<step|latest|best>'")
        state = json.loads(
            self._send("GET", f"/v1/checkpoints/{job_id}/{which}/files/trainer_state.json").text
        )
        entry = next((c for c in self.checkpoints(job_id) if c["step"] == state["step"]), None)
        if entry is None:
            raise CheckpointError(404, f"checkpoint {job_id}@{state['step']} is not listed")
        return entry, state

    def models(self) -> list[str]:
        return [m["id"] for m in self._request("GET", "/v1/models")["data"]]

    def download(self, model: str, name: str, to: Path) -> Path:
        job_id, _, step = model.rpartition("@")
        to.write_bytes(self._send("GET", f"/v1/checkpoints/{job_id}/{step}/files/{name}").content)
        return to

    def download_merged(self, model: str, to: Path) -> Path:
        """A LoRA checkpoint's whole weights (base + adapters merged) as one safetensors file;
        its config and tokenizer are the base model's."""
        job_id, _, step = model.rpartition("@")
        response = self._send("GET", f"/v1/checkpoints/{job_id}/{step}/merged/model.safetensors")
        to.write_bytes(response.content)
        return to

    def chat(self, model: str, messages: list[dict[str, Any]] | str, **sampling: Any) -> dict:
        """One chat completion (the whole OpenAI response)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self._request(
            "POST", "/v1/chat/completions", json={"model": model, "messages": messages, **sampling}
        )

    def complete(self, model: str, prompt: str, **sampling: Any) -> dict:
        return self._request(
            "POST", "/v1/completions", json={"model": model, "prompt": prompt, **sampling}
        )
