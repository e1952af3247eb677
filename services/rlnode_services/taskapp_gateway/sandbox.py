"""What a managed Task App runs inside: it is untrusted code (docs/security.md).

- a user of its own (a uid no other Task App and no service has; no /etc/passwd entry is
  needed) when the gateway runs as root, with no supplementary groups and no way to gain
  privileges (no_new_privs);
- an environment built from an allowlist: PATH, HOME, TMPDIR, LANG, the key, PORT, HOST and
  what its registration declares; nothing of the gateway's;
- a private home directory (0700, its own) as HOME, TMPDIR and, unless the registration
  names one, its working directory;
- resource limits (address space, processes, open files; no core dumps) from its
  registration, within the node's caps;
- SIGKILL when the gateway that started it dies (a gateway killed with SIGKILL cannot stop
  it, and the one started after would start another).

The node's data directory is 0700 and the services' own, so a Task App running as another
user reads none of it, and cannot read other processes' environments.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import resource
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rlnode_services.taskapp_gateway.cgroups import join

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
UID_SPAN = 1 << 20  # Task App uids: base .. base + span


class Limits(BaseModel):
    """Per Task App; each within the node's cap (GATEWAY_TASKAPP_MAX_*)."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(None, ge=64, description="Address space, MiB.")
    processes: int | None = Field(None, ge=8, description="Processes and threads of its user.")
    open_files: int | None = Field(None, ge=32, description="Open file descriptors.")


@dataclass(frozen=True)
class Sandbox:
    uid: int | None  # None: the gateway's own user (it does not run as root)
    home: Path
    memory_mb: int
    processes: int
    open_files: int
    path: str

    def environment(self, declared: dict[str, str], key: str, port: int) -> dict[str, str]:
        return {
            "PATH": self.path,
            "LANG": "C.UTF-8",
            **declared,
            "HOME": str(self.home),
            "TMPDIR": str(self.home / "tmp"),
            "ENVIRONMENT_API_KEY": key,
            "PORT": str(port),
            "HOST": "127.0.0.1",
        }

    def process_options(self, cgroup: Path | None = None) -> dict[str, Any]:
        """Keyword arguments for the subprocess call that starts the Task App. The user is
        taken in `preexec_fn` too: uvloop's subprocesses take no `user=`. `cgroup`: one of
        its own (cgroups.py), joined first."""
        parent = os.getpid()
        return {"preexec_fn": lambda: self._enter(parent, cgroup)}

    def _enter(self, parent: int, cgroup: Path | None) -> None:
        # Runs in the child before it runs the command: its cgroup and limits (as root, hard
        # ones too), then the user, then no way back to privileges.
        if cgroup is not None:
            join(cgroup)
        memory = self.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_NPROC, (self.processes, self.processes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
        # After the user changed (a change of user clears it), and checked against a parent
        # that died before it was set.
        if _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os._exit(1)
        if _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


_LIBC = ctypes.CDLL(None, use_errno=True)


def preferred_uid(base: int, org_id: str, name: str, attempt: int) -> int:
    """Where the uid search for a Task App starts: spread by its name, so that gateways with
    separate databases on one machine rarely meet."""
    digest = hashlib.blake2b(f"{org_id}\0{name}\0{attempt}".encode(), digest_size=8).digest()
    return base + int.from_bytes(digest, "big") % UID_SPAN


def runs_as_root() -> bool:
    return os.geteuid() == 0


def prepare_home(home: Path, uid: int | None) -> Path:
    """A fresh private directory for one Task App (its last run's files are removed), owned
    by its user."""
    root = home.parent
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    if root.stat().st_uid == os.geteuid():
        root.chmod(0o711)  # others may enter their own directory here, not list the others
    shutil.rmtree(home, ignore_errors=True)
    (home / "tmp").mkdir(parents=True, mode=0o700)
    home.chmod(0o700)
    if uid is not None:
        for path in (home, home / "tmp"):
            os.chown(path, uid, uid)
    return home


def kill_user_processes(uid: int, rounds: int = 5) -> int:
    """SIGKILL every process of `uid` (a Task App's own user): what it forked into a session
    of its own escapes the process group a stop signals, and must not outlive it (nor
    its network rules). Repeated while it still finds some (one may fork as it dies).
    How many it killed."""
    killed = 0
    for _ in range(rounds):
        found = [pid for pid in _pids() if _owner(pid) == uid]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def uids_running(first: int, last: int) -> set[int]:
    """The uids from `first` to `last` that own a process on this machine now."""
    return {uid for pid in _pids() if (uid := _owner(pid)) is not None and first <= uid <= last}


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def remove_home(home: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)


def readable_by(path: str, uid: int) -> bool:
    """Whether user `uid` (in no group of note) may read `path` and enter each directory above."""
    target = Path(path)
    for parent in reversed(target.parents):
        if not _allows(parent, uid, 0o001, 0o100):
            return False
    return _allows(
        target, uid, 0o005 if target.is_dir() else 0o004, 0o500 if target.is_dir() else 0o400
    )


def _allows(path: Path, uid: int, other_bits: int, owner_bits: int) -> bool:
    try:
        info = path.stat()
    except OSError:
        return False
    if info.st_uid == uid:
        return info.st_mode & owner_bits == owner_bits
    return info.st_mode & other_bits == other_bits
