"""The torch engine: Hugging Face transformers models on CPU or GPU, batched sampling with a
KV cache, and a small scheduler that coalesces concurrent requests into batches."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlnode.engine.base import (
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    check_digest,
    check_prompt,
    check_weights_fit,
)
from rlnode.engine.precision import resolved_dtype
from rlnode.messages.config import LoraSpec
from rlnode.models.hf import load_causal_lm, load_tokenizer
from rlnode.models.lora import AdapterError, check_adapter_fits, merged_weights, saved_in_full
from rlnode.models.safetensors_io import MappedSafetensors
from rlnode.service.supervised import Supervised

log = logging.getLogger("rlnode.engine.torch")

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


def _cache_of(output: Any) -> Any:
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values


def load_model(path: Path, device: str, dtype: str = "auto"):
    """Load a Hugging Face causal LM and its tokenizer: the same code for the tiny local
    model and a real one."""
    import torch

    torch_dtype = getattr(torch, DTYPES[resolved_dtype(dtype, device)])
    try:
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype=torch_dtype)
    except OSError as e:
        raise EngineError(f"cannot load a model from {path}: {e}") from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' stub of the @wraps(Module.to) method wants the model as its first argument
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


class TorchEngine:
    def __init__(
        self,
        model_path: Path | str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        seed: int = 0,
    ) -> None:
        import torch

        self.model_path = Path(model_path)
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.model, self.tokenizer = load_model(self.model_path, device, dtype)
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings
        # transformers 5 calls the KV cache `cache`; 4.x called it `past_key_values`.
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self.policy_version = 0
        self.batches = 0
        self.batched_requests = 0
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        # Batches requests; if it dies, the requests it held fail and it starts again.
        self._scheduler = Supervised("torch engine scheduler", self._schedule)
        self._model_lock = asyncio.Lock()  # held by a batch and by a weight load: never both
        # The base model's weights of the modules adapters were merged into (LoRA jobs).
        self._base_weights: dict[str, Any] = {}
        self.closed = False

    # -- public interface --------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.closed:
            raise EngineError("the engine was closed")
        check_prompt(request.prompt_ids, self.vocab_size)
        self._scheduler.start()
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(request, future))
        return await future

    async def load_weights(
        self,
        path: Path,
        version: int,
        digest: str | None = None,
        adapter: LoraSpec | None = None,
    ) -> float:
        """The file is mapped, hashed from the mapping and copied from it into the model's
        parameters: its pages are read once and the weights copied once. An adapter is merged
        into the base weights (kept aside the first time, so each version merges into the
        base, not into the last merge)."""
        started = time.perf_counter()
        try:
            mapped = await asyncio.to_thread(MappedSafetensors, path)
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot read weights {path}: {e}") from None
        try:
            await asyncio.to_thread(check_digest, path, mapped.buffer, digest)
            async with self._model_lock:  # waits for the batch in flight to finish
                if adapter is None:
                    await asyncio.to_thread(self._apply_state, mapped.tensors())
                else:
                    await asyncio.to_thread(self._apply_adapter, mapped.tensors(), adapter)
                self.policy_version = version
        finally:
            mapped.close()
        return time.perf_counter() - started

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        for sequence in sequences:
            check_prompt(sequence, self.vocab_size)
        async with self._model_lock:
            return await asyncio.to_thread(self.score_sync, sequences)

    async def close(self) -> None:
        self.closed = True
        await self._scheduler.stop()
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(EngineError("the engine was closed"))

    # -- scheduling ----------------------------------------------------------------------

    def failures(self) -> dict[str, str]:
        failure = self._scheduler.failure
        return {self._scheduler.name: failure} if failure is not None else {}

    async def _schedule(self) -> None:
        while True:
            batch = [await self._queue.get()]
            try:
                await self._run_batch(batch)
            except BaseException as e:  # its requests fail with the cause, not hang
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(
                            EngineError(f"the scheduler failed: {type(e).__name__}: {e}")
                        )
                raise

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """Fill `batch` (in place, so that the caller can fail what it holds) for up to
        `max_wait_s`, generate, and resolve each request."""
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            try:
                # Not wait_for: on Python 3.11 it can swallow a cancel that comes as get()
                # completes, and close() would wait for ever on a scheduler that goes on.
                async with asyncio.timeout(timeout):
                    batch.append(await self._queue.get())
            except TimeoutError:
                break
        wanted = [p for p in batch if not p.future.cancelled()]
        if not wanted:
            return
        async with self._model_lock:
            version = self.policy_version
            try:
                results = await asyncio.to_thread(
                    self._generate_batch, [p.request for p in wanted], version
                )
            except Exception as e:  # a failing batch fails its requests, not the engine
                log.exception("batch of %d failed", len(wanted))
                for p in wanted:
                    if not p.future.done():
                        p.future.set_exception(
                            EngineError(f"generation failed: {type(e).__name__}: {e}")
                        )
                return
        self.batches += 1
        self.batched_requests += len(wanted)
        for p, result in zip(wanted, results, strict=True):
            if not p.future.done():
                p.future.set_result(result)

    # -- compute (in a worker thread) ------------------------------------------------------

    def _apply_state(self, state: dict[str, Any]) -> None:
        import torch

        check_weights_fit(
            {k: tuple(v.shape) for k, v in self.model.state_dict().items()},
            {k: tuple(v.shape) for k, v in state.items()},
        )
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)

    def _apply_adapter(self, tensors: dict[str, Any], adapter: LoraSpec) -> None:
        import torch

        state = self.model.state_dict()
        try:
            modules = check_adapter_fits(
                {k: tuple(v.shape) for k, v in tensors.items()},
                {k: tuple(v.shape) for k, v in state.items()},
                adapter,
            )
        except AdapterError as e:
            raise EngineError(f"the adapter does not fit the model: {e}") from None
        for module in modules:
            name = f"{module}.weight"
            if name not in self._base_weights and name in state:
                self._base_weights[name] = state[name].detach().clone()
        full = {name: state[name] for name in saved_in_full(tensors).values() if name in state}
        try:
            merged = merged_weights({**full, **self._base_weights}, tensors, adapter)
        except AdapterError as e:
            raise EngineError(f"the adapter does not fit the model: {e}") from None
        with torch.no_grad():
            self.model.load_state_dict(merged, strict=False)

    def _generate_batch(
        self, requests: list[GenerationRequest], version: int
    ) -> list[GenerationResult]:
        import torch

        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        size = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((size, width), pad, dtype=torch.long)
        mask = torch.zeros((size, width), dtype=torch.long)
        for row, r in enumerate(requests):  # left padding: every row's next token is at the end
            input_ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([r.temperature for r in requests], device=self.device).unsqueeze(
            -1
        )
        greedy = temperature.squeeze(-1) <= 0
        temperature = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
        top_p = torch.tensor([r.top_p for r in requests], device=self.device).unsqueeze(-1)
        top_k = [r.top_k for r in requests]
        # A request with a seed draws from a generator of its own: the same seed and prompt
        # sample the same completion whatever else is in the batch.
        seeded = [
            torch.Generator(device=self.device).manual_seed(r.seed) if r.seed is not None else None
            for r in requests
        ]
        limits = [r.max_tokens for r in requests]
        stops = [set(r.stop_token_ids) | eos for r in requests]
        completions: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[FinishReason | None] = [None] * size
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True
            )
            cache = _cache_of(out)
            logits = out.logits[:, -1, :].float()
            next_position = positions[:, -1:] + 1
            for _ in range(max(limits)):
                scaled = torch.log_softmax(logits / temperature, dim=-1)
                sampled, sampled_from = self._sample(scaled, top_p, greedy, top_k, seeded)
                chosen = sampled_from.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
                ids, lps = sampled.tolist(), chosen.tolist()
                for row in range(size):
                    if finish[row] is not None:
                        continue
                    completions[row].append(ids[row])
                    logprobs[row].append(lps[row])
                    if ids[row] in stops[row]:
                        finish[row] = "stop"
                    elif self._hit_stop_string(requests[row], completions[row]):
                        finish[row] = "stop"
                    elif len(completions[row]) >= limits[row]:
                        finish[row] = "length"
                if all(f is not None for f in finish):
                    break
                mask = torch.cat(
                    [mask, torch.ones((size, 1), dtype=mask.dtype, device=self.device)], dim=-1
                )
                out = self.model(
                    input_ids=sampled.unsqueeze(-1),
                    attention_mask=mask,
                    position_ids=next_position,
                    use_cache=True,
                    **{self._cache_arg: cache},
                )
                cache = _cache_of(out)
                logits = out.logits[:, -1, :].float()
                next_position = next_position + 1
        return [
            GenerationResult(
                completion_ids=c, logprobs=lp, finish_reason=f or "length", policy_version=version
            )
            for c, lp, f in zip(completions, logprobs, finish, strict=True)
        ]

    def _sample(self, scaled_logprobs, top_p, greedy, top_k=None, seeded=None):
        """The sampled ids and the log-distribution they were drawn from: the tempered one,
        cut to the top k and renormalised over the top-p nucleus where asked (as vLLM
        reports it)."""
        import torch

        for row, k in enumerate(top_k or []):
            if 0 < k < scaled_logprobs.shape[-1]:
                kth = scaled_logprobs[row].topk(k).values[-1]
                scaled_logprobs[row] = torch.log_softmax(
                    scaled_logprobs[row].masked_fill(scaled_logprobs[row] < kth, float("-inf")),
                    dim=-1,
                )
        if bool((top_p < 1.0).any()):
            sorted_probs, order = scaled_logprobs.exp().sort(dim=-1, descending=True)
            # Keep the smallest set reaching top_p (rows with top_p 1 keep everything).
            outside = (sorted_probs.cumsum(-1) - sorted_probs > top_p) & (top_p < 1.0)
            dropped = torch.zeros_like(outside).scatter(-1, order, outside)
            scaled_logprobs = torch.log_softmax(
                scaled_logprobs.masked_fill(dropped, float("-inf")), dim=-1
            )
        probs = scaled_logprobs.exp()
        sampled = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
        for row, generator in enumerate(seeded or []):
            if generator is not None:
                sampled[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
        return torch.where(greedy, scaled_logprobs.argmax(-1), sampled), scaled_logprobs

    def _hit_stop_string(self, request: GenerationRequest, completion: list[int]) -> bool:
        if not request.stop:
            return False
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        return any(s in text for s in request.stop)

    def score_sync(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        import torch

        pad = self.tokenizer.pad_token_id
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, s in enumerate(sequences):  # right padding: positions start at 0 everywhere
            input_ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits.float()
            scaled = torch.log_softmax(
                logits[:, :-1] / (temperature if temperature > 0 else 1.0), dim=-1
            )
            chosen = scaled.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return [chosen[row, : len(s) - 1].tolist() for row, s in enumerate(sequences)]
