"""A job's model as the trainer and the engines load it: a GGUF `model.source` (or
`model.tokenizer`) becomes the Hugging Face directory it is imported to in the node's model
store (rlnode.models.gguf: once per file, so a resumed job or a second job finds it there);
any other source is used as it is. The import is float32, the dtype the learner trains in:
exactly what the GGUF encodes; the engines cast it to theirs when they load it."""

from __future__ import annotations

import logging
from pathlib import Path

from rlnode.messages import JobConfig
from rlnode.models.gguf import import_gguf, is_gguf_file

log = logging.getLogger("rlnode.training.model_source")


def with_imported_model(config: JobConfig, store: Path) -> JobConfig:
    """`config` with each GGUF it names replaced by its imported directory."""
    model = config.model
    changes: dict[str, str] = {}
    for field in ("source", "tokenizer"):
        source = getattr(model, field)
        if source is None or not is_gguf_file(source):
            continue
        imported = import_gguf(Path(source), store, "float32")
        log.info(
            "model.%s %s: %s %s (%.1fs)",
            field,
            source,
            "found imported at" if imported.reused else "imported to",
            imported.path,
            imported.seconds,
        )
        changes[field] = str(imported.path)
    if not changes:
        return config
    return config.model_copy(update={"model": model.model_copy(update=changes)})
