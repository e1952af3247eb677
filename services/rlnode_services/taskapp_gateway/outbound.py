"""Where an external Task App's URL may lead: a registration is a request for the gateway to
call an address, so an org could aim it at the node itself (loopback), the cloud's metadata
service (link-local) or the private network. Each address the host resolves to must be
public, or of a kind the operator allows (GATEWAY_ALLOW_URLS_TO; the embedded node allows
loopback, where its example Task Apps run). Checked when registered and again before each
call (a name may resolve elsewhere later)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Literal
from urllib.parse import urlparse

AddressKind = Literal["loopback", "link-local", "private"]


class UrlRefused(ValueError):
    pass


def kind_of(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> AddressKind | None:
    """What kind of non-public address this is (None: public)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if (
        address.is_private
        or address.is_reserved
        or address.is_multicast
        or address.is_unspecified
        or not address.is_global
    ):
        return "private"
    return None


async def check_url(url: str, allowed: frozenset[str]) -> None:
    """UrlRefused unless every address `url`'s host resolves to is public or allowed."""
    parsed = urlparse(url)
    host = parsed.hostname
    if not host:
        raise UrlRefused(f"{url!r} names no host")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UrlRefused(f"cannot resolve {host!r}: {e}") from None
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        kind = kind_of(address)
        if kind is not None and kind not in allowed:
            raise UrlRefused(
                f"{url} resolves to {address}, a {kind} address: this node does not call "
                f"{kind} addresses for Task Apps (the operator may allow it: "
                f"GATEWAY_ALLOW_URLS_TO)"
            )
