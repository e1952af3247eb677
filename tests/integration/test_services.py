"""Each service is a process of its own: it starts, answers /health, and stops cleanly on
SIGTERM. Bad settings stop it at once with a message that names the setting."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from rlnode.bus.localbroker import free_port
from rlnode.node.processes import ServiceProcess, ensure_local_credentials
from rlnode.service.registry import GATEWAY, SERVICES


@pytest.mark.parametrize("spec", SERVICES, ids=[s.name for s in SERVICES])
def test_service_starts_answers_health_and_stops_on_sigterm(spec, tmp_path, kafka_broker) -> None:
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap_servers}
    if spec.name == "credential-vault":
        env |= ensure_local_credentials(tmp_path).vault_env()
    service = ServiceProcess(spec, free_port(), tmp_path / f"{spec.name}.log", env=env).start()
    try:
        health = service.wait_healthy()
        if spec.name in ("taskapp-gateway", "rollout-generator", "learner"):
            # Started without a service token: it serves, and says what it lacks.
            checks = {"service_token": False}
            if spec.name != "rollout-generator":  # it keeps no database
                checks["database"] = True
            if spec.name == "taskapp-gateway":  # root with nft: its Task Apps are isolated
                checks["taskapp_network"] = health["info"]["taskapp_network"]["ready"]
            assert health["status"] == "degraded" and health["checks"] == checks
        else:
            assert health["status"] == "ok"
        assert health["service"] == spec.name
        assert health["pid"] == service.proc.pid
    finally:
        code = service.stop()
    assert code == 0, service.log_tail()
    assert "Application shutdown complete" in service.log_tail()


@pytest.mark.parametrize("spec", SERVICES[:2], ids=[s.name for s in SERVICES[:2]])
def test_bad_settings_stop_start_up_with_a_clear_message(spec) -> None:
    env = {**os.environ, f"{spec.env_prefix}PORT": "not-a-port"}
    result = subprocess.run(
        [sys.executable, "-m", spec.package], env=env, capture_output=True, timeout=60
    )
    assert result.returncode == 2
    message = result.stderr.decode()
    assert f"{spec.name}: bad settings" in message and "port" in message and "not-a-port" in message


def test_a_taken_port_is_a_failure_not_a_hang() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The gateway starts with nothing else running (uvicorn binds after start-up).
        env = {**os.environ, "GATEWAY_PORT": str(port)}
        result = subprocess.run(
            [sys.executable, "-m", GATEWAY.package], env=env, capture_output=True, timeout=60
        )
    assert result.returncode != 0
    assert b"address already in use" in result.stderr.lower()


def test_health_answers_503_naming_background_work_that_is_down() -> None:
    import httpx

    from rlnode.service.app import create_service_app
    from rlnode.service.settings import ServiceSettings
    from rlnode.testing import ThreadedServer

    down: dict[str, str] = {}
    app = create_service_app(GATEWAY, ServiceSettings(port=0))
    app.state.failures.append(lambda: dict(down))
    with ThreadedServer(app) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        down["consuming rlnode.trajectories"] = "RuntimeError: database is locked"
        failing = httpx.get(f"{server.url}/health")
        assert failing.status_code == 503
        assert failing.json()["status"] == "failing"
        assert failing.json()["failing"] == {
            "consuming rlnode.trajectories": "RuntimeError: database is locked"
        }
        down.clear()
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
