"""`rlnode up | status | down` as an operator uses them: a supervised node on its own
embedded broker; a service killed with SIGKILL comes back; down stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlnode.testing import free_port_block, processes_with, run_rlnode


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:g}s")


@pytest.mark.timeout(600)
def test_up_restarts_a_killed_service_and_down_stops_everything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env |= {
        "RLNODE_DATA_DIR": str(tmp_path),
        "KAFKA_SESSION_TIMEOUT_MS": "6000",
        "KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
    }
    base = free_port_block()
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen(
        [sys.executable, "-m", "rlnode.cli", "up", "--gpus", "0", "--port-base", str(base)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: run_rlnode(env, "status").returncode == 0, 180, "the node is healthy")
        status = run_rlnode(env, "status").stdout
        for service in (
            "credential-vault",
            "taskapp-gateway",
            "rollout-generator/gen0",
            "learner",
            "checkpoint-server",
        ):
            assert service in status
        assert f"127.0.0.1:{base + 30}" in status  # fixed ports from the base
        # A second node on the same data directory is refused.
        again = run_rlnode(env, "up", "--gpus", "0", "--port-base", str(base))
        assert again.returncode == 1 and "a node is up already" in again.stderr

        state = json.loads((tmp_path / "node.json").read_text())
        killed = state["services"]["learner"]["pid"]
        os.kill(killed, signal.SIGKILL)

        def learner_back() -> dict | None:
            services = json.loads((tmp_path / "node.json").read_text())["services"]
            learner = services["learner"]
            healthy = run_rlnode(env, "status").returncode == 0
            return (
                learner
                if healthy and learner["pid"] != killed and learner["restarts"] == 1
                else None
            )

        wait_for(learner_back, 120, "the learner is back")
        said = (tmp_path / "up.log").read_text()
        assert "learner exited with code -9; starting it again" in said
        assert "learner started again" in said

        stopped = run_rlnode(env, "down")
        assert stopped.returncode == 0, stopped.stderr
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()
    said = (tmp_path / "up.log").read_text()
    assert "stopped cleanly" in said, said[-2000:]
    assert not (tmp_path / "node.json").exists()
    assert processes_with(str(tmp_path)) == []
    assert run_rlnode(env, "status").returncode == 1
