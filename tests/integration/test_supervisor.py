"""`rlnode up | status | down` as an operator uses them: a supervised node on its own
embedded broker; a service killed with SIGKILL comes back; down stops everything."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlnode.examples import job_config_path
from rlnode.testing import free_port_block, processes_with, run_rlnode, wait_until


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
        try:
            wait_until(
                lambda: run_rlnode(env, "status").returncode == 0, 180, "the node is healthy"
            )
        except TimeoutError as e:
            raise AssertionError(_what_the_node_said(e, env, tmp_path)) from None
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
        check_a_second_shell_finds_the_node(env, tmp_path)
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

        try:
            wait_until(learner_back, 120, "the learner is back")
        except TimeoutError as e:
            raise AssertionError(_what_the_node_said(e, env, tmp_path)) from None
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
            # Killed, the supervisor leaves its children (each in a session of its own):
            # they must not run on into the rest of the suite.
            for pid in processes_with(str(tmp_path)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        log.close()
    said = (tmp_path / "up.log").read_text()
    assert "stopped cleanly" in said, said[-2000:]
    assert not (tmp_path / "node.json").exists()
    assert processes_with(str(tmp_path)) == []
    assert run_rlnode(env, "status").returncode == 1


def _what_the_node_said(e: Exception, env: dict, data_dir: Path) -> str:
    """The timeout, `rlnode status`, and the tails of the supervisor's log and of every
    service's that is not healthy: to see why from a CI log alone."""
    from rlnode.node.supervisor import status as services_status

    status = run_rlnode(env, "status").stdout
    rows = services_status(data_dir) if (data_dir / "node.json").exists() else []
    logs = [data_dir / "up.log"] + [Path(r["log"]) for r in rows if not r["healthy"]]
    said = "\n".join(f"-- {p}:\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    return f"{e}; status:\n{status}\n{said}"


def test_a_killed_service_takes_the_processes_it_started_with_it(tmp_path) -> None:
    """vLLM's engine core and workers, training ranks and managed Task Apps are children of
    a service; killed (or stopped) before it could stop them, they must not live on holding
    memory and GPUs."""
    import os
    import signal

    from rlnode.node.processes import ServiceProcess
    from rlnode.service.registry import ServiceSpec

    spec = ServiceSpec("spawner", "tests.integration.spawning_service", 0, "SPAWNER_")
    pid_file = tmp_path / "child.pid"
    process = ServiceProcess(
        spec, 0, tmp_path / "spawner.log", env={"SPAWNER_PID_FILE": str(pid_file)}
    ).start()
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(process.proc.pid, signal.SIGKILL)  # the service dies without cleaning up
    process.proc.wait()
    os.kill(child, 0)  # its child is still there, orphaned ...
    process.stop()  # ... until the service is stopped (or started again)
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the orphaned child survived"
        time.sleep(0.05)


def test_a_service_that_does_not_stop_leaves_its_stacks_in_its_log(tmp_path) -> None:
    """Past its SIGTERM grace a service is killed; first its threads' and tasks' stacks go
    to its log, to say what it was waiting on."""
    from rlnode.node.processes import ServiceProcess
    from rlnode.service.registry import ServiceSpec

    spec = ServiceSpec("stuck", "tests.integration.stuck_service", 0, "STUCK_")
    process = ServiceProcess(spec, 0, tmp_path / "stuck.log").start()
    deadline = time.monotonic() + 30
    while "ready" not in process.log_tail():
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.05)
    assert process.stop(timeout_s=1) == -9
    log = process.log_tail(20_000)
    assert "most recent call first" in log  # faulthandler: every thread
    # the task it was stuck in, down the await chain to the innermost coroutine
    assert "in shutting_down" in log and "in lifespan" in log
    assert "in waiting_on_something_that_never_comes" in log


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = (
        Path(f"/proc/{pid}/stat").read_text().split()[2]
        if Path(f"/proc/{pid}/stat").exists()
        else "X"
    )
    return status != "Z"  # a zombie waiting for init to reap it is gone for our purposes


def test_a_service_whose_port_another_process_answers_on_is_not_taken_for_healthy(
    tmp_path,
) -> None:
    """A port picked free can be taken before the service binds it: the node must not take
    the process that answers there (another node's service, once, in CI) for its own."""
    import http.server
    import json as json_
    import threading

    from rlnode.node.processes import PortTaken, ServiceProcess
    from rlnode.service.registry import ServiceSpec

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json_.dumps({"status": "ok", "service": "taskapp-gateway", "pid": 1}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spec = ServiceSpec("spawner", "tests.integration.spawning_service", 0, "SPAWNER_")
    process = ServiceProcess(
        spec,
        server.server_address[1],
        tmp_path / "spawner.log",
        env={"SPAWNER_PID_FILE": str(tmp_path / "child.pid")},
    ).start()
    try:
        with pytest.raises(PortTaken, match=r"answers as pid 1 \(taskapp-gateway\)"):
            process.wait_healthy(timeout_s=30)
        assert process.proc is not None and process.proc.poll() is not None  # not left behind
    finally:
        process.stop()
        server.shutdown()


def check_a_second_shell_finds_the_node(node_env: dict[str, str], data_dir: Path) -> None:
    """A newcomer's second shell: no KAFKA_BOOTSTRAP_SERVERS, no service URLs, no admin
    token; the CLI finds them from the data directory of the node that is up (its broker on
    a random port, its services at --port-base)."""
    unset = ("KAFKA_", "RLNODE_", "VAULT_", "GATEWAY_")
    shell = {k: v for k, v in os.environ.items() if not k.startswith(unset)}
    shell["RLNODE_DATA_DIR"] = str(data_dir)
    created = run_rlnode(shell, "org", "create", "second-shell")
    assert created.returncode == 0, created.stderr
    shell["RLNODE_TOKEN"] = created.stdout.strip()
    listed = run_rlnode(shell, "taskapp", "list")
    assert listed.returncode == 0, listed.stderr
    # Through the node's broker both ways: the request goes out, the learner's verdict
    # comes back (no Task App "copy" is registered for this org).
    started = run_rlnode(shell, "job", "start", str(job_config_path("copy_task")), "--watch")
    assert started.returncode == 1, started.stdout + started.stderr
    assert "rejected" in started.stdout + started.stderr, started.stdout + started.stderr


NODE_IN_A_SCRIPT = """
import sys, time
from pathlib import Path
from rlnode.node.local import LocalNode, NodeOptions
with LocalNode(NodeOptions(data_dir=Path(sys.argv[1]), services=("credential-vault",))):
    print("up", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_a_script_killed_with_sigterm_stops_its_nodes_processes(tmp_path: Path) -> None:
    """A benchmark or script that runs `with LocalNode(...)` and is stopped with SIGTERM (or
    its terminal closes) takes the node's broker and services with it: they run in sessions
    of their own and would otherwise live on, holding ports and memory."""
    marker = str(tmp_path / "node")
    script = subprocess.Popen(
        [sys.executable, "-c", NODE_IN_A_SCRIPT, marker],
        env=os.environ | {"RLNODE_TEST_NODE": marker},  # what its processes inherit
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert script.stdout is not None
        line = script.stdout.readline()
        assert line == "up\n", line + script.stdout.read()
        started = [pid for pid in processes_with(marker) if pid != script.pid]
        assert len(started) >= 2, started  # the broker, the vault
        script.send_signal(signal.SIGTERM)
        code = script.wait(60)
        assert [pid for pid in started if _alive(pid)] == []  # none outlived it
        assert code == 128 + signal.SIGTERM  # it unwound (SystemExit), not killed outright
    finally:
        script.kill()
        for pid in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
