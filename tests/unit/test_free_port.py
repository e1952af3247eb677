"""A node asks for a free port per service before any of them binds: the kernel, asked again,
may offer a port it offered a moment ago (nothing holds it yet), and two services of one node
were given the same one."""

from __future__ import annotations

import socket
from collections import deque

import pytest

from rlnode.bus import children
from rlnode.bus.children import free_port


def test_ports_handed_out_are_not_handed_out_again_before_they_are_bound() -> None:
    # 2,000 asks of ~14,000 ports: the kernel repeats some ~140 times over.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_a_handed_out_port_is_free_to_bind() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_ports_come_from_the_range_the_environment_names(monkeypatch) -> None:
    """What keeps two test workers apart: each draws from a range of its own."""
    # This test's picks alone: the worker's own range holds ports it handed out before.
    monkeypatch.setattr(children, "_HANDED_OUT", deque(maxlen=children._HANDED_OUT.maxlen))
    monkeypatch.setenv("RLNODE_FREE_PORTS", "23000-23499")
    ports = [free_port() for _ in range(300)]
    assert all(23000 <= p <= 23499 for p in ports) and len(set(ports)) == len(ports)
    held, low = _two_free_ports_in_a_row()  # something holds the first of the two
    with held:
        monkeypatch.setenv("RLNODE_FREE_PORTS", f"{low}-{low + 1}")
        assert free_port() == low + 1
        with pytest.raises(OSError, match=f"RLNODE_FREE_PORTS={low}-{low + 1}"):
            free_port()  # the other one is handed out already


def _two_free_ports_in_a_row() -> tuple[socket.socket, int]:
    """A socket bound to a port the kernel picked whose next port is free too (not held:
    a test worker's services hold ports of its range, so the two are found, not fixed)."""
    for _ in range(100):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        low = held.getsockname()[1]
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", low + 1))
            except OSError:
                held.close()
                continue
        return held, low
    raise AssertionError("no two free ports in a row on loopback")


def test_a_malformed_range_says_what_it_expects(monkeypatch) -> None:
    monkeypatch.setenv("RLNODE_FREE_PORTS", "20000")
    with pytest.raises(ValueError, match="expected LOW-HIGH"):
        free_port()
    monkeypatch.setenv("RLNODE_FREE_PORTS", "30000-20000")
    with pytest.raises(ValueError, match="LOW < HIGH"):
        free_port()
