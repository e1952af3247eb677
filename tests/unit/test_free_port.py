"""A node asks for a free port per service before any of them binds: the kernel, asked again,
may offer a port it offered a moment ago (nothing holds it yet), and two services of one node
were given the same one."""

from __future__ import annotations

import socket

import pytest

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
    monkeypatch.setenv("RLNODE_FREE_PORTS", "23000-23499")
    ports = [free_port() for _ in range(300)]
    assert all(23000 <= p <= 23499 for p in ports) and len(set(ports)) == len(ports)
    with socket.socket() as held, socket.socket() as other:
        held.bind(("127.0.0.1", 23500))  # something holds one of the two ports
        other.bind(("127.0.0.1", 23501))
        other.close()
        monkeypatch.setenv("RLNODE_FREE_PORTS", "23500-23501")
        assert free_port() == 23501
        with pytest.raises(OSError, match="RLNODE_FREE_PORTS=23500-23501"):
            free_port()  # the other one is handed out already


def test_a_malformed_range_says_what_it_expects(monkeypatch) -> None:
    monkeypatch.setenv("RLNODE_FREE_PORTS", "20000")
    with pytest.raises(ValueError, match="expected LOW-HIGH"):
        free_port()
    monkeypatch.setenv("RLNODE_FREE_PORTS", "30000-20000")
    with pytest.raises(ValueError, match="LOW < HIGH"):
        free_port()
