"""Loading Hugging Face models and tokenizers, one at a time in a process. transformers is
not safe to load from two threads at once: its lazily imported modules and the global
switches `from_pretrained` flips while it builds a model (meta-device initialisation) are
shared, and two jobs starting together in the learner failed with "cannot import name
'AutoModelForCausalLM'" and then "Cannot copy out of meta tensor" (found by the chaos
benchmark, bench/chaos.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_loading = threading.Lock()


def load_tokenizer(path: Path | str, **options: Any) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(path, **options)."""
    with _loading:
        from transformers import AutoTokenizer

        _quiet()
        return AutoTokenizer.from_pretrained(path, **options)


def load_causal_lm(path: Path | str, **options: Any) -> PreTrainedModel:
    """AutoModelForCausalLM.from_pretrained(path, **options), on the CPU."""
    with _loading:
        from transformers import AutoModelForCausalLM

        _quiet()
        return AutoModelForCausalLM.from_pretrained(path, **options)


def _quiet() -> None:
    """No progress bars or warnings from transformers: loading is logged by the caller."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
