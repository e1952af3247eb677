"""What one job request may cost and where its model may come from: the node's quotas
(LEARNER_MAX_*), and `model.source` as a Hugging Face repo id, a directory or GGUF file the
operator allows (LEARNER_MODEL_DIRS), the node's model store (imported models, shared by
every org) or the org's own checkpoints. Each refusal names the limit and the setting."""

from __future__ import annotations

import math
import re
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from rlnode.messages import JobConfig
from rlnode.models.gguf import GgufError, inspect_gguf, is_gguf_file
from rlnode.trackers.registry import installed
from rlnode_services.learner.settings import LearnerSettings
from rlnode_services.learner.store import ACTIVE, JobRecord

# `org/name` or `name`, as the Hugging Face hub spells repo ids.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
# Bytes a checkpoint holds per byte of model file: fp32 weights and AdamW's two moments.
CHECKPOINT_BYTES_PER_MODEL_BYTE = 3


class OverLimit(ValueError):
    """A request the node refuses: the message names the limit and its setting."""


def check_limits(settings: LearnerSettings, config: JobConfig) -> None:
    t = config.training
    checks = [
        (
            "rollouts per step (prompts_per_step x group_size)",
            t.prompts_per_step * t.group_size,
            settings.max_rollouts_per_step,
            "LEARNER_MAX_ROLLOUTS_PER_STEP",
        ),
        (
            "sampling.max_tokens",
            config.sampling.max_tokens,
            settings.max_tokens_per_sample,
            "LEARNER_MAX_TOKENS_PER_SAMPLE",
        ),
        (
            "model.max_seq_len",
            config.model.max_seq_len,
            settings.max_seq_len,
            "LEARNER_MAX_SEQ_LEN",
        ),
        ("training.steps", t.steps, settings.max_steps, "LEARNER_MAX_STEPS"),
    ]
    for what, asked, limit, setting in checks:
        if asked > limit:
            raise OverLimit(f"{what} is {asked}; this node allows at most {limit} ({setting})")


def check_org_jobs(settings: LearnerSettings, engine: Engine, org_id: str) -> None:
    with Session(engine) as s:
        active = s.exec(
            select(func.count())
            .select_from(JobRecord)
            .where(JobRecord.org_id == org_id, col(JobRecord.status).in_(ACTIVE))
        ).one()
    if active >= settings.max_jobs_per_org:
        raise OverLimit(
            f"org {org_id!r} has {active} jobs queued or running; this node allows "
            f"{settings.max_jobs_per_org} at once (LEARNER_MAX_JOBS_PER_ORG): wait for one "
            "to end or cancel one"
        )


def local_model(source: str) -> Path | None:
    """The directory or file `source` names on this machine, if it names one (as transformers
    would read it: a path that exists is a path, whatever it looks like)."""
    path = Path(source).expanduser()
    return path.resolve() if path.exists() else None


def check_model_source(settings: LearnerSettings, config: JobConfig, org_id: str) -> None:
    for field, source in (
        ("model.source", config.model.source),
        ("model.tokenizer", config.model.tokenizer),
    ):
        if source is not None:
            check_source(settings, field, source, org_id)


def check_source(settings: LearnerSettings, field: str, source: str, org_id: str) -> None:
    """A model the org may train: a Hugging Face repo id, a directory (or .gguf) in
    LEARNER_MODEL_DIRS or the model store, or one of the org's own checkpoints."""
    path = local_model(source)
    if path is None:
        if not HUB_ID.match(source) or ".." in source:
            raise OverLimit(
                f"{field} {source!r} is neither a directory on this node nor a Hugging "
                "Face repo id (org/name)"
            )
        return
    _check_local(settings, field, source, path, org_id)
    if path.is_file():
        _check_gguf(field, source, path)


def _check_gguf(field: str, source: str, path: Path) -> None:
    if not is_gguf_file(path):
        raise OverLimit(
            f"{field} {source!r} is a file that is not GGUF: name a Hugging Face directory, a "
            ".gguf file or a Hugging Face repo id"
        )
    try:
        inspect_gguf(path)
    except GgufError as e:
        raise OverLimit(f"{field} {source!r}: {e}") from None


def _check_local(
    settings: LearnerSettings, field: str, source: str, path: Path, org_id: str
) -> None:
    node = settings.node
    own = [store.resolve() / org_id for store in node.stores]
    if any(path.is_relative_to(mine) for mine in own):
        return  # the org's own checkpoints: training on from one is fine
    if path.is_relative_to(node.model_dir.resolve()):
        return  # imported models (rlnode model import|fetch): public to the node's orgs
    private = [node.data_dir.resolve(), *(store.resolve() for store in node.stores)]
    if any(path.is_relative_to(p) for p in private):
        raise OverLimit(
            f"{field} {source!r} lies in the node's own data (another org's checkpoints, or "
            "the services' files); a job may start from its org's own checkpoints, a Hugging "
            "Face repo id or a directory in LEARNER_MODEL_DIRS"
        )
    allowed = [d.expanduser().resolve() for d in settings.model_dirs]
    if not any(path.is_relative_to(d) for d in allowed):
        where = ", ".join(str(d) for d in allowed) or "none are set"
        raise OverLimit(
            f"{field} {source!r} is outside the directories this node loads models from "
            f"(LEARNER_MODEL_DIRS: {where}); use a Hugging Face repo id, or ask the operator"
        )


def check_trackers(config: JobConfig) -> None:
    """The trackers [logging] names have their libraries on this node."""
    if config.logging is None:
        return
    missing = [name for name in config.logging.trackers if not installed(name)]
    if missing:
        raise OverLimit(
            f"logging names {', '.join(missing)}, which this node's learner lacks: the "
            "operator installs them with pip install 'rlnode[trackers]'; or drop them from "
            "[logging] and replay the job later with rlnode job export"
        )


def estimated_checkpoint_bytes(config: JobConfig) -> int | None:
    """What the job's checkpoints will hold, from its model's files (None for a hub model,
    which is only measured as it is saved)."""
    path = local_model(config.model.source)
    if path is None:
        return None
    if path.is_file():  # a GGUF, imported in float32 (rlnode_services.learner.models)
        model_bytes = inspect_gguf(path).parameters * 4
    else:
        model_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    t = config.training
    checkpoints = math.ceil(t.steps / t.checkpoint_every) + 1  # and the final one
    return model_bytes * CHECKPOINT_BYTES_PER_MODEL_BYTE * checkpoints


def check_checkpoint_bytes(settings: LearnerSettings, config: JobConfig) -> None:
    estimate = estimated_checkpoint_bytes(config)
    if estimate is not None and estimate > settings.max_checkpoint_bytes:
        raise OverLimit(
            f"the job's checkpoints would hold about {estimate / 2**30:.1f} GiB; this node "
            f"allows {settings.max_checkpoint_bytes / 2**30:.1f} GiB per job "
            "(LEARNER_MAX_CHECKPOINT_BYTES): checkpoint less often (training.checkpoint_every)"
        )
