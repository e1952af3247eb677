"""The TLS front of the embedded broker: Debian's haproxy in TCP mode, terminating TLS and
requiring a client certificate signed by the node's CA (rlnode.bus.pki) before a byte
reaches Tansu, which listens on loopback only.

Why a front and not Tansu's own options: the pinned Tansu 0.6 accepts `--cert`/`--key` and
never uses them, and its authentication option fails open (docs/decisions.md). haproxy is a
maintained terminator; no TLS code of ours sits on the path. Tansu advertises the front's
address, so every client (the node's own services too) connects through it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from rlnode.bus.children import ChildProcess, free_port
from rlnode.bus.localbroker import BrokerStartError, wait_for_port
from rlnode.bus.pki import Identity

HAPROXY_ENV_VAR = "RLNODE_HAPROXY_BIN"
# Kafka clients keep their connections and idle up to 9 minutes (connections.max.idle.ms);
# haproxy must not cut them first.
IDLE_TIMEOUT = "15m"


class FrontMissing(RuntimeError):
    pass


def find_haproxy() -> str:
    explicit = os.environ.get(HAPROXY_ENV_VAR)
    if explicit:
        return explicit
    found = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    if found is None:
        raise FrontMissing(
            "Kafka over TLS needs haproxy for its front (Debian: apt-get install haproxy; "
            f"`make setup` installs it as root), or {HAPROXY_ENV_VAR} naming one"
        )
    return found


def haproxy_config(
    listen_host: str, listen_port: int, broker: str, server_pem: Path, ca: Path
) -> str:
    bind_host = f"[{listen_host}]" if ":" in listen_host else listen_host
    return "\n".join(
        [
            "global",
            "    maxconn 8192",
            "    ssl-default-bind-options ssl-min-ver TLSv1.2 no-tls-tickets",
            "defaults",
            "    mode tcp",
            "    timeout connect 5s",
            f"    timeout client {IDLE_TIMEOUT}",
            f"    timeout server {IDLE_TIMEOUT}",
            "frontend kafka_tls",
            # verify required: a client without a certificate of the node's CA never
            # gets past the handshake.
            f"    bind {bind_host}:{listen_port} ssl crt {server_pem} ca-file {ca} verify required",
            "    default_backend tansu",
            "backend tansu",
            f"    server broker {broker}",
            "",
        ]
    )


class KafkaTlsFront(ChildProcess):
    """`with KafkaTlsFront(host, broker, identity, run_dir):` listens on host:port and
    forwards authenticated connections to `broker` (host:port, loopback)."""

    def __init__(
        self,
        host: str,
        broker: str,
        identity: Identity,
        run_dir: Path,
        port: int | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.broker = broker
        self.identity = identity
        self.run_dir = run_dir
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> KafkaTlsFront:
        if self.running:
            return self
        binary = find_haproxy()
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = self.run_dir / "front.pem"
        pem.touch(mode=0o600)
        pem.write_bytes(self.identity.pem_bundle())
        config = self.run_dir / "haproxy.cfg"
        config.write_text(haproxy_config(self.host, self.port, self.broker, pem, self.identity.ca))
        # -db: in the foreground, no daemon; its exit is ours to see and supervise.
        self._spawn([binary, "-db", "-f", str(config)], "rlnode-front-")
        try:
            wait_for_port(self.host, self.port, self.start_timeout_s, self._proc)
        except BrokerStartError as e:
            tail = self._log_tail()
            self.stop()
            raise BrokerStartError(
                f"the Kafka TLS front: {e}; its log ({self.log_path}):\n{tail}"
            ) from None
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._terminate(timeout_s)

    def __enter__(self) -> KafkaTlsFront:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()
