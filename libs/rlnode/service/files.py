"""Files the node writes are its own: databases, keys, tokens, logs, checkpoints and weights
are readable by the user the services run as, and by no one else (managed Task Apps run as
other users: docs/security.md)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private() -> None:
    """From now on this process creates files 0600 and directories 0700."""
    os.umask(PRIVATE_UMASK)


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner may enter (created, or tightened if looser)."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    _tighten(path, PRIVATE_DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """`path` as a file only its owner may read (created empty if missing, or tightened)."""
    private_dir(path.parent)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE_MODE))
    _tighten(path, PRIVATE_FILE_MODE)
    return path


def write_private(path: Path, data: bytes) -> None:
    """`data` written whole under a temporary name (0600 from the start), then renamed into
    place: a reader never sees half a key or a file anyone else may read."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _tighten(path: Path, mode: int) -> None:
    info = path.stat()
    # Only what this user owns: a shared directory given as a parent is left as it is.
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & ~mode:
        path.chmod(mode)
