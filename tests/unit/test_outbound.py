"""Which addresses an external Task App's URL may lead to."""

from __future__ import annotations

import ipaddress

import pytest

from rlnode_services.taskapp_gateway.outbound import UrlRefused, check_url, kind_of


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("10.0.0.7", "private"),
        ("192.168.1.1", "private"),
        ("172.16.0.1", "private"),
        ("100.64.0.1", "private"),
        ("0.0.0.0", "private"),
        ("fd00::1", "private"),
        ("93.184.216.34", None),
        ("2606:4700::1111", None),
    ],
)
def test_address_kinds(address: str, kind: str | None) -> None:
    assert kind_of(ipaddress.ip_address(address)) == kind


async def test_names_are_resolved_and_every_address_checked() -> None:
    with pytest.raises(UrlRefused, match="a loopback address"):
        await check_url("http://localhost:9/x", frozenset())
    await check_url("http://localhost:9/x", frozenset({"loopback"}))
    with pytest.raises(UrlRefused, match="names no host"):
        await check_url("http:///x", frozenset())
