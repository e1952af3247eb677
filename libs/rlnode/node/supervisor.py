"""`rlnode up | status | down`: a node that stays up. The supervisor starts the broker (unless
KAFKA_BOOTSTRAP_SERVERS names one), the topics and every service with the GPUs the plan gives
it, waits for their health checks, starts again any service that dies (with backoff, said in
its own log, never as a job event), and on SIGTERM / Ctrl-C stops everything in order.
Its state (pids, URLs, restarts) is in $RLNODE_DATA_DIR/node.json for `status` and `down`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from rlnode.bus.settings import KafkaSettings
from rlnode.messages.config import TopologySpec
from rlnode.node.health import services_health
from rlnode.node.local import LocalNode, NodeOptions, state_path
from rlnode.node.plan import make_plan, plan_table
from rlnode.node.roles import ALL_ROLES, JoinInfo, join_path, services_of
from rlnode.sdk.local_node import pid_alive
from rlnode.service.registry import PORT_BASE
from rlnode.service.settings import NodeSettings
from rlnode.training.network import RENDEZVOUS_PORT

log = logging.getLogger("rlnode.node.supervisor")


class SupervisorError(RuntimeError):
    pass


def _say(out: TextIO, text: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    out.write(f"{stamp} {text}\n")
    out.flush()


def run_up(
    gpus: int,
    port_base: int = PORT_BASE,
    data_dir: Path | None = None,
    out: TextIO = sys.stdout,
    topology: TopologySpec | None = None,
    gateways: int = 1,
    roles: tuple[str, ...] = ALL_ROLES,
    host: str = "127.0.0.1",
    join: JoinInfo | None = None,
    rank_hosts: tuple[str, ...] = (),
    rendezvous_port: int = RENDEZVOUS_PORT,
) -> int:
    data_dir = data_dir or NodeSettings().data_dir
    state = state_path(data_dir)
    if state.exists() and pid_alive(json.loads(state.read_text()).get("pid")):
        raise SupervisorError(
            f"a node is up already (pid {json.loads(state.read_text())['pid']}, {state}); "
            "rlnode status shows it, rlnode down stops it"
        )
    plan = make_plan(gpus, topology, roles)  # this host's GPUs to this host's roles
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or None
    _say(out, f"roles: {', '.join(roles)} on {host}; plan for {gpus} GPU(s):\n{plan_table(plan)}")
    node = LocalNode(
        NodeOptions(
            data_dir=data_dir,
            kafka_bootstrap=bootstrap,
            port_base=port_base,
            plan=plan,
            session_timeout_ms=KafkaSettings().session_timeout_ms,
            gateways=gateways,
            services=services_of(roles),
            host=host,
            join=join,
            rank_hosts=rank_hosts,
            rendezvous_port=rendezvous_port,
        )
    )
    stopping = False

    def stop(_signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        node.start()  # it keeps its state in node.json
        what = f"Apache Kafka (pid {node.broker.pid})" if node.broker else "Kafka"
        _say(out, f"node up: broker {node.bootstrap} ({what}), data and logs under {data_dir}")
        if node.broker is not None:
            _say(
                out,
                "Kafka over TLS with a user per service (SCRAM-SHA-512) and ACLs; your own "
                "Kafka client: rlnode kafka-credentials",
            )
        for key, service in node.state()["services"].items():
            _say(out, f"  {key:<28} {service['url']}  (pid {service['pid']})")
        if join is None:
            _say(
                out,
                f"admin token: {data_dir / 'secrets' / 'vault-admin.token'} (rlnode org "
                "create with RLNODE_ADMIN_TOKEN); stop with rlnode down or Ctrl-C",
            )
        if join_path(data_dir).exists() and join is None:
            _say(
                out,
                f"other hosts join with: rlnode up --role inference|training --host <their "
                f"address> --join {join_path(data_dir)} (copy it there; it holds tokens)",
            )
        if rank_hosts:
            joined = (
                join_path(data_dir) if join_path(data_dir).exists() else node.options.rendezvous
            )
            _say(
                out,
                f"the learner waits for rank hosts {', '.join(rank_hosts)}: on each, rlnode "
                f"trainer-ranks --join {joined} --host <its name above>",
            )
        while not stopping:
            for line in node.supervise():
                _say(out, line)
            time.sleep(0.5)
    finally:
        _say(out, "stopping: services (consumers first), then the broker")
        codes = node.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        state.unlink(missing_ok=True)
        bad = {k: c for k, c in codes.items() if c not in (0, -signal.SIGTERM)}
        _say(out, "stopped" + (f"; non-zero exits: {bad}" if bad else " cleanly"))
    return 0


def read_state(data_dir: Path | None = None) -> dict:
    data_dir = data_dir or NodeSettings().data_dir
    path = state_path(data_dir)
    if not path.exists():
        raise SupervisorError(f"no node is up under {data_dir} (start one with rlnode up)")
    state = json.loads(path.read_text())
    if not pid_alive(state.get("pid")):
        raise SupervisorError(
            f"the node under {data_dir} is gone (its supervisor, pid {state.get('pid')}, "
            "exited without cleaning up); start it again with rlnode up"
        )
    return state


def status(data_dir: Path | None = None) -> list[dict]:
    """Each service with its health as its health route says now."""
    return asyncio.run(services_health(read_state(data_dir)["services"]))


def down(data_dir: Path | None = None, timeout_s: float = 120.0) -> int:
    state = read_state(data_dir)
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise SupervisorError(f"the supervisor (pid {pid}) did not stop in {timeout_s:g}s")
        time.sleep(0.2)
    return pid
