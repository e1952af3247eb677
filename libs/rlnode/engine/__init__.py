"""Inference engines behind one interface (see `base.Engine`)."""

from rlnode.engine.base import (
    BadPrompt,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    cut_at_stop,
    render_chat,
)


def create_engine(kind: str, model_path, **options) -> Engine:
    """`kind` is "torch" (CPU or GPU), "vllm" (GPU; imported only when asked for) or
    "instant" (fixed tokens at once: for measuring the control plane, never for training)."""
    if kind == "torch":
        from rlnode.engine.torch_engine import TorchEngine

        return TorchEngine(model_path, **options)
    if kind == "vllm":
        from rlnode.engine.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **options)
    if kind == "instant":
        from rlnode.engine.instant import InstantEngine

        return InstantEngine(model_path, **options)
    raise EngineError(f"unknown engine {kind!r}: use 'torch' or 'vllm'")


__all__ = [
    "BadPrompt",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "GenerationResult",
    "create_engine",
    "cut_at_stop",
    "render_chat",
]
