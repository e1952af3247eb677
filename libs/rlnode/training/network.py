"""Which network interface the training ranks' collectives use. Gloo (and NCCL's bootstrap)
listen on one interface, named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; without them gloo
takes the address the machine's hostname resolves to, which in a network namespace or on a
host whose name maps to 127.0.1.1 is not one the other hosts can reach. So a rank that trains
with other hosts names the interface that holds its address toward them, derived here from
that address (IPv4, Linux) unless the operator named one."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger("rlnode.training.network")

INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
RENDEZVOUS_PORT = 29400  # torchrun's usual c10d port: where rank hosts join the learner
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') as (host, port); a ValueError names what is wrong.
    Port 0 is a listener's "any free port"."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{endpoint!r} is not address:port (e.g. 10.0.0.1:29400)")
    return host.strip("[]"), int(port)


def source_address(peer: str, port: int = 9) -> str:
    """The local address this host reaches `peer` from (the routing table's choice; no
    packet is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, port))
        return str(s.getsockname()[0])


def _ipv4_of(name: str, request: int) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), request, struct.pack("256s", name[:15].encode()))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface that holds `address` (or, failing that, whose network contains it, as
    lo's 127.0.0.0/8 contains 127.0.0.2); None when none does or it is not IPv4."""
    try:
        wanted = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    if wanted.is_unspecified:
        return None
    containing = None
    for _index, name in socket.if_nameindex():
        own = _ipv4_of(name, _SIOCGIFADDR)
        mask = _ipv4_of(name, _SIOCGIFNETMASK)
        if own is None or mask is None:
            continue
        if ipaddress.ip_address(own) == wanted:
            return name
        if containing is None and wanted in ipaddress.ip_network(f"{own}/{mask}", strict=False):
            containing = name
    return containing


def use_interface(name: str | None, address: str) -> str | None:
    """Point gloo and NCCL at `name`, or at the interface holding `address`, unless the
    environment names one already (the operator's word wins). Returns the interface used
    (None: gloo's hostname default, with a warning saying how to set it)."""
    present = {v: os.environ[v] for v in INTERFACE_VARIABLES if os.environ.get(v)}
    if present and not name:
        return next(iter(present.values()))
    chosen = name or interface_of(address)
    if chosen is None:
        log.warning(
            "no network interface holds %s: the training ranks use the address this host's "
            "name resolves to; set the interface (LEARNER_SOCKET_IFNAME, or --ifname of "
            "rlnode trainer-ranks) if the other hosts cannot reach that",
            address,
        )
        return None
    for variable in INTERFACE_VARIABLES:
        os.environ[variable] = chosen
    return chosen
