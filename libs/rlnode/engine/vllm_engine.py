"""The vLLM engine: the same interface as the torch engine, on vLLM's async engine (GPU).

vLLM is imported only here, only when this engine is asked for: it is not installed on
CPU machines. Kept thin on purpose: vLLM batches (continuously) by itself, so there is no
scheduler of ours; new weights go into the running engine with `load_weights`, called
between requests by the caller (the rollout-generator drains in-flight requests first).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from rlnode.engine.base import EngineError, FinishReason, GenerationRequest, GenerationResult

INSTALL_HINT = (
    "vLLM is not installed: `pip install vllm` on a machine with a CUDA GPU, or run the "
    "rollout-generator with GENERATOR_ENGINE=torch"
)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise EngineError(f"{INSTALL_HINT} ({e})") from None
    return vllm


class VLLMEngine:
    def __init__(
        self,
        model_path: Path | str,
        *,
        device: str = "cuda",
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        seed: int = 0,
        max_batch_size: int = 256,
        max_wait_ms: float = 0.0,
    ) -> None:
        vllm = _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.model_path = Path(model_path)
        self.policy_version = 0
        args = AsyncEngineArgs(
            model=str(model_path),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            max_num_seqs=max_batch_size,
            enable_prefix_caching=True,
        )
        self._vllm = vllm
        self._engine = vllm.AsyncLLMEngine.from_engine_args(args)
        self.tokenizer = (
            self._engine.engine.tokenizer.tokenizer if hasattr(self._engine, "engine") else None
        )
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._lock = asyncio.Lock()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        params = self._vllm.SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop=request.stop or None,
            stop_token_ids=request.stop_token_ids or None,
            logprobs=0,  # the sampled token's logprob
            # rlnode's logprobs are of logits / temperature (see engine.base).
            logprobs_mode="processed_logprobs",
        )
        version = self.policy_version
        prompt = {"prompt_token_ids": request.prompt_ids}
        final = None
        async for output in self._engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            final = output
        if final is None or not final.outputs:
            raise EngineError("vLLM returned no output")
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs or [], ids, strict=False)
        ]
        if len(logprobs) != len(ids):
            raise EngineError("vLLM returned logprobs that do not line up with the tokens")
        finish: FinishReason = "stop" if completion.finish_reason == "stop" else "length"
        return GenerationResult(ids, logprobs, finish, version)

    async def load_weights(self, path: Path, version: int) -> float:
        from safetensors.torch import load_file

        started = time.perf_counter()
        state: dict[str, Any] = await asyncio.to_thread(load_file, str(path))
        async with self._lock:

            def _load(worker: Any) -> None:
                worker.model_runner.model.load_weights(weights=state.items())

            await self._engine.collective_rpc(_load)
            await self._engine.reset_prefix_cache()  # cached prefixes hold the old weights' KV
            self.policy_version = version
        return time.perf_counter() - started

    async def score(
        self, sequences: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        params = self._vllm.SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        results = []
        for sequence in sequences:
            final = None
            async for output in self._engine.generate(
                {"prompt_token_ids": sequence}, params, request_id=uuid.uuid4().hex
            ):
                final = output
            if final is None:
                raise EngineError("vLLM returned no output")
            steps = (final.prompt_logprobs or [])[1:]
            results.append(
                [step[token].logprob for step, token in zip(steps, sequence[1:], strict=True)]
            )
        return results

    async def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None) or getattr(
            self._engine, "shutdown_background_loop", None
        )
        if shutdown is not None:
            shutdown()
