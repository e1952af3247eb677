"""A node asks for a free port per service before any of them binds: the kernel, asked again,
may offer a port it offered a moment ago (nothing holds it yet), and two services of one node
were given the same one."""

from __future__ import annotations

import socket

from rlnode.bus.children import free_port


def test_ports_handed_out_are_not_handed_out_again_before_they_are_bound() -> None:
    # 2,000 asks of ~14,000 ports: the kernel repeats some ~140 times over.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_a_handed_out_port_is_free_to_bind() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
