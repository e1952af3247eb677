"""Checkpoints and weight versions on a store that can fill up.

Each is written under a temporary sibling name, `.<name>.tmp-<pid>`, and renamed into place
once complete and synced, so a write that fails (or a learner that dies mid-write) leaves
nothing a reader takes: resume looks for `step-*`, weight versions are `v*.safetensors`, the
checkpoint-server lists only what events name. Temporaries a crash left are removed when the
job resumes.

A write that fails for want of room (ENOSPC, EDQUOT) pauses the job: it is tried again with
backoff for up to `wait_s` (LEARNER_DISK_FULL_WAIT_S), then the job fails saying where, how
much is free and what to do. Waiting rather than failing at once because a full disk is
usually freed within minutes, and a job that waits keeps its optimizer state, its place and
its generators; a failed one is not resumed. Other errors (EIO, EROFS) fail the job at once:
waiting mends none of them."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("rlnode.training.storage")
T = TypeVar("T")
OUT_OF_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
FIRST_RETRY_S, LONGEST_RETRY_S = 0.5, 30.0
# How Rust writers (safetensors, tokenizers) name the OS error behind their own.
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


class StoreWriteFailed(Exception):
    """A checkpoint or weights write that did not happen; nothing of it is left behind."""


def temporary_sibling(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (same directory, so the
    rename is atomic; a dot name, so no reader's glob matches it)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_temporaries(directory: Path) -> list[str]:
    """Remove what interrupted writes left in `directory`; returns their names."""
    if not directory.is_dir():
        return []
    removed = []
    for stale in directory.glob(".*.tmp-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale.name)
    return removed


def free_bytes(path: Path) -> int:
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


def os_error_of(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: the error itself, one it was raised while
    handling (torch.save's RuntimeError over a file's ENOSPC), or one its text names."""
    seen: BaseException | None = error
    for _ in range(8):  # a short chain; never a cycle
        if seen is None:
            return None
        if isinstance(seen, OSError):
            return seen
        if found := _OS_ERROR_IN_TEXT.search(str(seen)):
            number = int(found.group(1))
            return OSError(number, os.strerror(number))
        seen = seen.__cause__ or seen.__context__
    return None


def describe(what: str, path: Path, error: OSError) -> str:
    reason = error.strerror or str(error)
    return (
        f"{what} could not be written to {path.parent}: {reason} "
        f"({free_bytes(path) / 2**20:.1f} MiB free there)"
    )


async def write_waiting_for_room(
    write: Callable[[], T],
    what: str,
    path: Path,
    wait_s: float,
    give_up: asyncio.Event,
    paused: Callable[[str | None], None] = lambda _why: None,
) -> T:
    """Run `write` (which writes `path` atomically) in a thread; while it fails for want of
    room, try again with backoff for up to `wait_s`, or until `give_up` is set. Raises
    StoreWriteFailed with the reason and what to do. `paused` hears why while it waits, and
    None once the write is done or given up."""
    deadline = time.monotonic() + wait_s
    delay = FIRST_RETRY_S
    try:
        while True:
            try:
                return await asyncio.to_thread(write)
            except Exception as e:
                error = os_error_of(e)
                if error is None:
                    raise
                problem = describe(what, path, error)
                if error.errno not in OUT_OF_ROOM:
                    raise StoreWriteFailed(f"{problem}; check that store's disk") from e
                if give_up.is_set() or time.monotonic() + delay > deadline:
                    raise StoreWriteFailed(
                        f"{problem}; waited {wait_s:g}s for room (LEARNER_DISK_FULL_WAIT_S): "
                        "free space there"
                    ) from e
            log.warning("%s; paused, trying again in %.1fs", problem, delay)
            paused(problem)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(give_up.wait(), timeout=delay)
            delay = min(delay * 2, LONGEST_RETRY_S)
    finally:
        paused(None)
