"""Test hosts on one machine: a Linux network namespace per host, joined by veth pairs to a
bridge, each with addresses of its own in a test subnet and, where asked, its own tmpfs over
a directory (what one host writes there the others do not see). This process stays in the
root namespace with an address on the bridge: the user's machine.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; `available()` says why not."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None if test hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"rlprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    bridge_end: str  # the veth end on the bridge (in the root namespace)

    def command(self, argv: list[str], private_dirs: tuple[Path, ...] = ()) -> list[str]:
        """`argv` run on this host: in its namespace, with a fresh tmpfs over each of
        `private_dirs` (in a mount namespace of its own: nobody else sees what it writes)."""
        mounts = " && ".join(
            f'mount -t tmpfs -o mode=0700 tmpfs "${i + 1}"' for i in range(len(private_dirs))
        )
        script = (mounts + " && " if mounts else "") + f'shift {len(private_dirs)} && exec "$@"'
        return [
            "ip", "netns", "exec", self.namespace, "sh", "-c", script, "host",
            *map(str, private_dirs), *argv,
        ]  # fmt: skip

    def link(self, up: bool) -> None:
        """Its network cable plugged in or pulled (the host's own end of the pair)."""
        _ip("-n", self.namespace, "link", "set", "eth0", "up" if up else "down")


class TestNetwork:
    """`with TestNetwork() as net: a = net.add_host("a")` — hosts on a /24 of 10.x.y.0, a
    subnet picked from this process's pid so that two runs on one machine do not meet."""

    def __init__(self) -> None:
        tag = os.getpid() % 50000
        self.prefix = f"10.{200 + tag // 250 % 50}.{tag % 250}"
        self.tag = f"rl{tag}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self.address = f"{self.prefix}.254"  # this process's, on the bridge

    def __enter__(self) -> TestNetwork:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(name, f"{self.tag}-{name}", f"{self.prefix}.{index}", f"{self.tag}v{index}")
        self.hosts.append(host)
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.bridge_end, "type", "veth", "peer", "name", "eth0", "netns",
            host.namespace)  # fmt: skip
        _ip("link", "set", host.bridge_end, "master", self.bridge, "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.namespace, "link", "set", "eth0", "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", host.bridge_end], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __exit__(self, *_exc) -> None:
        self.close()
