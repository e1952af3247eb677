"""What a managed Task App may reach on the network: per-uid nftables rules (docs/decisions.md).

Each managed Task App runs as a uid of its own (sandbox.py). The node's gateways keep one
nftables table (`inet <table>`, one per node: named from the database its gateways share)
whose output hook sends every packet of those uids through `confine`:

- replies on connections made to it (the gateway's calls: `ct state established`);
- TCP to the generators' per-rollout endpoints (`rollout4`/`rollout6`: address . port),
  added by whichever gateway passes a rollout to the app, from the inference URL a
  generator's service token sent it; never from a user's input;
- what the operator allows (`GATEWAY_TASKAPP_ALLOW_TO`: CIDRs, a CIDR's one port, or `public`: any address
  that is not private, loopback, link-local, reserved or the machine's own, and DNS to the
  resolvers of /etc/resolv.conf);
- its own listening sockets, where the host has cgroup v2 (cgroups.py): its new TCP
  connections to the machine's own addresses are marked with its uid and accepted, and the
  input hook then lets them in only to a socket of its own cgroup (chain `own_<uid>`);
- nothing else: TCP is reset (connection refused), the rest rejected.

The uid joins `taskapps` before the process starts and leaves it once it is gone. The
gateway that runs the managed Task Apps writes the chains at start and removes the table
at a clean stop; the node's other gateways only add endpoints (and the sets they need).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from rlnode_services.taskapp_gateway.cgroups import OwnCgroups

log = logging.getLogger("taskapp_gateway.firewall")

OPEN_SETTING = "GATEWAY_TASKAPP_NETWORK=open"
ENDPOINT_REFRESH_S = 30.0  # a gateway adds an endpoint again after this (the table may be new)
NFT_TIMEOUT_S = 10.0  # an nft call that takes longer fails (a rollout must not hang on it)
NONPUBLIC_V4 = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/3",
)
NONPUBLIC_V6 = ("::/127", "::ffff:0:0/96", "64:ff9b::/96", "fc00::/7", "fe80::/10", "ff00::/8")


class NetworkMode(StrEnum):
    ISOLATED = "isolated"  # the rules above; a managed Task App does not start without them
    OPEN = "open"  # no rules: every port of the machine is the Task App's to try


class IsolationUnavailable(RuntimeError):
    """The rules cannot be installed here; the message says why and what accepts the risk."""


def table_name(node_identity: str) -> str:
    """One table per node: its gateways share a database, so its URL names the node."""
    return "rlnode_" + hashlib.blake2b(node_identity.encode(), digest_size=6).hexdigest()


def uids_confined_elsewhere(own_table: str, nft: str | None = None) -> set[int]:
    """The Task App uids the tables of this machine's other nodes confine (their gateways
    running, or SIGKILLed and their tables left behind): a uid of theirs given to an app
    here would go through their rules too, which hold none of this node's rollout
    endpoints. Empty where nft cannot be asked (no nft, not root: no rules to meet)."""
    binary = nft or shutil.which("nft")
    if binary is None:
        return set()
    try:
        listed = subprocess.run(
            [binary, "-j", "list", "sets", "inet"],
            capture_output=True,
            timeout=NFT_TIMEOUT_S,
            check=True,
        ).stdout
        entries = json.loads(listed).get("nftables", [])
    except (OSError, subprocess.SubprocessError, ValueError):
        return set()
    uids: set[int] = set()
    for entry in entries:
        found = entry.get("set") if isinstance(entry, dict) else None
        if (
            isinstance(found, dict)
            and found.get("name") == "taskapps"
            and str(found.get("table", "")).startswith("rlnode_")
            and found.get("table") != own_table
        ):
            uids.update(e for e in found.get("elem", []) if isinstance(e, int))
    return uids


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
PORT_ENTRY = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<v4>[^:\[\]]+)):(?P<port>\d{1,5})$")


def parse_allowances(
    entries: list[str],
) -> tuple[bool, list[Network], list[tuple[Network, int]]]:
    """(`public` given, the CIDRs, the CIDRs with one port: "127.0.0.1:8080",
    "10.0.0.0/8:443", "[::1]:8080"); an entry that is none of these says so."""
    public: bool = False
    networks: list[Network] = []
    ports: list[tuple[Network, int]] = []
    for entry in entries:
        if entry == "public":
            public = True
            continue
        match = PORT_ENTRY.match(entry)
        try:
            if match:
                port = int(match["port"])
                if not 0 < port < 65536:
                    raise ValueError
                ports.append((ipaddress.ip_network(match["v6"] or match["v4"], strict=False), port))
            else:
                networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(
                f"GATEWAY_TASKAPP_ALLOW_TO entry {entry!r} is neither 'public', a CIDR "
                "(203.0.113.7/32, 2001:db8::/48) nor one with a port (127.0.0.1:8080, "
                "[::1]:8080)"
            ) from None
    return public, networks, ports


def resolvers(
    path: Path = Path("/etc/resolv.conf"),
) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    found = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for match in re.finditer(r"^\s*nameserver\s+(\S+)", text, re.MULTILINE):
        try:
            found.append(ipaddress.ip_address(match.group(1).split("%")[0]))
        except ValueError:
            continue
    return found


def _elements(values) -> str:
    return "{ " + ", ".join(str(v) for v in values) + " }"


class TaskAppFirewall:
    def __init__(
        self,
        table: str,
        allow_to: list[str],
        nft: str | None = None,
        cgroups: OwnCgroups | None = None,
    ) -> None:
        self.table = table
        # None: the apps cannot reach their own ports (no cgroup v2 here)
        self.cgroups = cgroups
        self.public, self.networks, self.ports = parse_allowances(allow_to)
        self.nft = nft or shutil.which("nft") or "/usr/sbin/nft"
        self._endpoints: dict[tuple[str, int], float] = {}  # -> when this gateway added it
        # One addition per endpoint at a time: a group's rollouts all name the same one.
        self._adding: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._lock = asyncio.Lock()

    # -- what the rules are --------------------------------------------------------------

    def _sets(self) -> list[str]:
        """The sets every gateway of the node may need (`add` leaves existing ones as they are)."""
        t = f"inet {self.table}"
        return [
            f"add table {t}",
            f"add set {t} taskapps {{ typeof meta skuid ; }}",
            f"add set {t} rollout4 {{ typeof ip daddr . tcp dport ; }}",
            f"add set {t} rollout6 {{ typeof ip6 daddr . tcp dport ; }}",
        ]

    def ruleset(self) -> str:
        """The whole table as the gateway that runs the managed Task Apps writes it."""
        t = f"inet {self.table}"
        v4 = [n for n in self.networks if n.version == 4]
        v6 = [n for n in self.networks if n.version == 6]
        lines = [
            *self._sets(),
            f"add set {t} allow4 {{ type ipv4_addr ; flags interval ; }}",
            f"add set {t} allow6 {{ type ipv6_addr ; flags interval ; }}",
            f"add chain {t} output {{ type filter hook output priority 0 ; policy accept ; }}",
            f"add chain {t} input {{ type filter hook input priority 0 ; policy accept ; }}",
            f"add chain {t} confine",
            f"add map {t} owners {{ type mark : verdict ; }}",
            f"add map {t} marks {{ type uid : mark ; }}",  # nft sets no mark from a uid
            f"flush chain {t} output",
            f"flush chain {t} input",
            f"flush chain {t} confine",
            f"flush map {t} owners",
            f"flush map {t} marks",
            f"flush set {t} taskapps",  # its Task Apps died with the gateway that ran them
            f"flush set {t} allow4",
            f"flush set {t} allow6",
        ]
        if v4:
            lines.append(f"add element {t} allow4 {_elements(v4)}")
        if v6:
            lines.append(f"add element {t} allow6 {_elements(v6)}")
        rule = f"add rule {t} confine"
        lines += [
            # Packets without a socket (the kernel's own replies) have no uid: not matched.
            f"add rule {t} output meta skuid @taskapps jump confine",
            f"{rule} ct state established,related accept",
            f"{rule} ip daddr . tcp dport @rollout4 accept",
            f"{rule} ip6 daddr . tcp dport @rollout6 accept",
            f"{rule} ip daddr @allow4 accept",
            f"{rule} ip6 daddr @allow6 accept",
        ]
        for network, port in self.ports:  # one service of a host (an environment server)
            family = "ip" if network.version == 4 else "ip6"
            lines.append(f"{rule} {family} daddr {network} tcp dport {port} accept")
        if self.cgroups is not None:
            # Out, marked with the uid; in, only to a socket of that uid's cgroup (own_<uid>).
            lines += [
                f"{rule} fib daddr type local meta l4proto tcp ct state new "
                "ct mark set meta skuid map @marks accept",
                f"add rule {t} input iif lo ct state new ct mark vmap @owners",
            ]
        if self.public:
            dns = resolvers()
            dns4 = [a for a in dns if a.version == 4]
            dns6 = [a for a in dns if a.version == 6]
            if dns4:
                lines.append(
                    f"{rule} ip daddr {_elements(dns4)} meta l4proto {{ tcp, udp }} th dport 53 accept"
                )
            if dns6:
                lines.append(
                    f"{rule} ip6 daddr {_elements(dns6)} meta l4proto {{ tcp, udp }} th dport 53 accept"
                )
            lines += [
                f"{rule} fib daddr type != local ip daddr != {_elements(NONPUBLIC_V4)} accept",
                f"{rule} fib daddr type != local ip6 daddr != {_elements(NONPUBLIC_V6)} accept",
            ]
        lines += [
            f"{rule} meta l4proto tcp counter reject with tcp reset",
            f"{rule} counter reject with icmpx admin-prohibited",
        ]
        return "\n".join(lines) + "\n"

    # -- applying them -------------------------------------------------------------------

    async def _run(self, script: str, check_only: bool = False) -> None:
        argv = [self.nft, *(["-c"] if check_only else []), "-f", "-"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as e:
            raise IsolationUnavailable(
                f"cannot run nft ({self.nft}: {e.strerror}): install nftables "
                "(Debian: apt-get install nftables)"
            ) from None
        try:
            _, err = await asyncio.wait_for(proc.communicate(script.encode()), NFT_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise IsolationUnavailable(f"nft did not answer within {NFT_TIMEOUT_S:g}s") from None
        if proc.returncode != 0:
            raise IsolationUnavailable(
                f"nft refused the rules: {err.decode(errors='replace').strip()}"
            )

    async def check(self) -> None:
        """Whether the rules can be installed here (root, nft, the kernel's nf_tables):
        IsolationUnavailable saying why otherwise. Installs nothing."""
        if os.geteuid() != 0:
            raise IsolationUnavailable(
                "the gateway does not run as root, so its managed Task Apps cannot have users "
                "and per-user firewall rules of their own"
            )
        await self._run(self.ruleset(), check_only=True)

    async def install(self) -> None:
        async with self._lock:
            await self._run(self.ruleset())
            self._endpoints.clear()

    async def remove(self) -> None:
        async with self._lock:
            proc = await asyncio.create_subprocess_exec(
                self.nft,
                "delete",
                "table",
                "inet",
                self.table,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await proc.wait()
            self._endpoints.clear()
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.remove_all)

    def cgroup(self, uid: int) -> Path | None:
        """The cgroup `uid`'s Task App runs in (None: no cgroup of its own here)."""
        return self.cgroups.path(uid) if self.cgroups is not None else None

    async def confine(self, uid: int) -> None:
        """From now on, what `uid` sends goes through the rules."""
        t = f"inet {self.table}"
        script = [*self._sets()]
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.create, uid)  # nft resolves it when loaded
            own = f"own_{uid}"
            script += [
                f"add chain {t} {own}",
                f"flush chain {t} {own}",
                f"add rule {t} {own} {self.cgroups.nft_match(uid)} accept",
                f"add rule {t} {own} counter reject with tcp reset",
                f"add element {t} marks {{ {uid} : {uid} }}",
                f"add element {t} owners {{ {uid} : jump {own} }}",
            ]
        script.append(f"add element {t} taskapps {{ {uid} }}")
        async with self._lock:
            await self._run("\n".join(script))

    async def release(self, uid: int) -> None:
        t = f"inet {self.table}"
        steps = [f"delete element {t} taskapps {{ {uid} }}"]
        if self.cgroups is not None:
            steps += [
                f"delete element {t} marks {{ {uid} }}",
                f"delete element {t} owners {{ {uid} }}",
                f"delete chain {t} own_{uid}",
            ]
        async with self._lock:
            for step in steps:  # each on its own: one that is gone already stops none
                try:
                    await self._run("\n".join([*self._sets(), step]))
                except IsolationUnavailable as e:
                    log.debug("releasing uid %d: %s", uid, e)
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.remove, uid)

    async def allow_endpoint(self, inference_url: str) -> None:
        """Let Task Apps reach the generator endpoint `inference_url` names (host and port)."""
        parts = urlsplit(inference_url)
        if parts.hostname is None:
            return
        port = parts.port or (443 if parts.scheme == "https" else 80)
        now = time.monotonic()
        key = (parts.hostname, port)
        seen = self._endpoints.get(key)
        if seen is not None and now - seen < ENDPOINT_REFRESH_S:
            return
        if key in self._adding:  # another rollout is adding it: its outcome is ours
            return await asyncio.shield(self._adding[key])
        adding = self._adding[key] = asyncio.get_running_loop().create_future()
        try:
            await self._add_endpoint(parts.hostname, port)
            self._endpoints[key] = now
            adding.set_result(None)
        except BaseException as e:
            adding.set_exception(e)
            adding.exception()  # retrieved: the waiters, if any, get it raised
            raise
        finally:
            del self._adding[key]

    async def _add_endpoint(self, host: str, port: int) -> None:
        started = time.monotonic()
        elements = []
        for address in await _addresses(host, port):
            set_name = "rollout4" if address.version == 4 else "rollout6"
            elements.append(f"add element inet {self.table} {set_name} {{ {address} . {port} }}")
        async with self._lock:
            await self._run("\n".join([*self._sets(), *elements]))
        log.info(
            "managed Task Apps may reach %s:%d (%s; %.0f ms)",
            host,
            port,
            self.table,
            1000 * (time.monotonic() - started),
        )


async def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({ipaddress.ip_address(info[4][0]) for info in infos}, key=str)


def refusal(why: str) -> str:
    return (
        f"managed Task Apps cannot be isolated on this node ({why}), so they do not start: run "
        "the gateway as root with nftables installed, or accept the risk with "
        f"{OPEN_SETTING} (each Task App then reaches every port of the machine: the broker, "
        "the vault, other orgs' Task Apps)"
    )


class TaskAppNetwork:
    """The network mode of a gateway's managed Task Apps, and whether it holds here."""

    def __init__(
        self, mode: NetworkMode, firewall: TaskAppFirewall | None, own_users: bool
    ) -> None:
        self.mode = mode
        self.firewall = firewall if mode is NetworkMode.ISOLATED else None
        self.unavailable: str | None = None
        if self.firewall is not None and not own_users:
            self.unavailable = refusal(
                "they run as the gateway's own user (GATEWAY_SANDBOX_USER=off, or the gateway "
                "is not root), and per-user rules would confine the gateway too"
            )

    async def start(self, writes_rules: bool) -> None:
        """The gateway that runs the managed Task Apps writes the rules; the others check
        that they could add endpoints."""
        if self.firewall is None or self.unavailable:
            return
        try:
            await (self.firewall.install() if writes_rules else self.firewall.check())
        except IsolationUnavailable as e:
            self.unavailable = refusal(str(e))
            log.error("%s", self.unavailable)

    async def stop(self, writes_rules: bool) -> None:
        if self.firewall is not None and writes_rules and not self.unavailable:
            await self.firewall.remove()

    def require(self) -> None:
        if self.unavailable:
            raise IsolationUnavailable(self.unavailable)

    async def confine(self, uid: int | None) -> None:
        """Before a managed Task App of `uid` starts."""
        if self.firewall is None:
            return
        self.require()
        assert uid is not None, "own users are checked at start"
        await self.firewall.confine(uid)

    async def release(self, uid: int | None) -> None:
        if self.firewall is not None and uid is not None and not self.unavailable:
            await self.firewall.release(uid)

    def cgroup(self, uid: int | None) -> Path | None:
        """Where a managed Task App of `uid` runs, for the rules to know its sockets."""
        if self.firewall is None or uid is None or self.unavailable:
            return None
        return self.firewall.cgroup(uid)

    async def allow_endpoint(self, inference_url: str) -> None:
        if self.firewall is not None:
            self.require()
            await self.firewall.allow_endpoint(inference_url)

    def describe(self) -> dict[str, object]:
        """For /health and `rlnode doctor`."""
        described: dict[str, object] = {"mode": self.mode.value, "ready": not self.unavailable}
        if self.firewall is not None:
            described["table"] = f"inet {self.firewall.table}"
            described["own_ports"] = self.firewall.cgroups is not None
            described["allow_to"] = [
                *(["public"] if self.firewall.public else []),
                *map(str, self.firewall.networks),
                *(f"{n}:{p}" if n.version == 4 else f"[{n}]:{p}" for n, p in self.firewall.ports),
            ]
        if self.unavailable:
            described["detail"] = self.unavailable
        elif self.mode is NetworkMode.OPEN:
            described["detail"] = (
                f"{OPEN_SETTING}: managed Task Apps reach every port of the machine (the "
                "broker, the vault, other orgs' Task Apps); only for nodes whose every "
                "registrant is trusted"
            )
        return described
