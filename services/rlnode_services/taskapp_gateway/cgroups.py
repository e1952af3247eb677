"""A cgroup (v2) per managed Task App user, so that the Task App rules (firewall.py) can let
an app reach its own listening sockets and no one else's.

An app that talks to itself over loopback TCP (verifiers 0.4's relay between its harness and
the model, any server with worker processes) would otherwise be refused like any other port
of the machine: the output hook sees who connects (`meta skuid`), not who listens. The input
hook does see the listener: nftables' `socket cgroupv2` looks up the socket a packet is for
and compares its cgroup. So each app's processes run in a cgroup of their own (the sandbox
joins it before the command starts; children stay in it); its new loopback connections are
marked with its uid on the way out (`ct mark`), and on the way in one chain per uid accepts
only a listener in that uid's cgroup.

Where no cgroup v2 hierarchy is mounted (or nft cannot name it: it resolves paths under
/sys/fs/cgroup), an app cannot reach its own ports, as before, and /health says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("taskapp_gateway.cgroups")

NFT_CGROUP_ROOT = Path("/sys/fs/cgroup")  # where nft resolves `socket cgroupv2` paths


def cgroup2_mount(mounts: Path = Path("/proc/mounts")) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified
    on a hybrid host), if it is."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


class OwnCgroups:
    """`<mount>/rlnode-taskapps/<table>/uid-<uid>`: one per managed Task App user."""

    def __init__(self, mount: Path, table: str) -> None:
        self.mount = mount
        self.base = mount / "rlnode-taskapps" / table

    @classmethod
    def here(cls, table: str) -> OwnCgroups | None:
        mount = cgroup2_mount()
        if mount is None or not mount.is_relative_to(NFT_CGROUP_ROOT):
            return None
        return cls(mount, table)

    def path(self, uid: int) -> Path:
        return self.base / f"uid-{uid}"

    def create(self, uid: int) -> Path:
        path = self.path(uid)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove(self, uid: int) -> None:
        with contextlib.suppress(OSError):  # busy: something of it still runs; kept
            self.path(uid).rmdir()

    def remove_all(self) -> None:
        """The table's cgroups that nothing runs in any more, and their parent."""
        if self.base.exists():
            for path in self.base.glob("uid-*"):
                with contextlib.suppress(OSError):
                    path.rmdir()
        with contextlib.suppress(OSError):
            self.base.rmdir()

    def nft_match(self, uid: int) -> str:
        """The nftables expression true for a socket of `uid`'s cgroup."""
        path = self.path(uid)
        level = len(path.relative_to(self.mount).parts)
        return f'socket cgroupv2 level {level} "{path.relative_to(NFT_CGROUP_ROOT)}"'


def join(cgroup: Path) -> None:
    """Move the calling process into `cgroup` (the sandbox, as root, before the command)."""
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
