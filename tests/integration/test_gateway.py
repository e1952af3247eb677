"""The taskapp-gateway with real processes: a vault, the gateway, managed example Task Apps
it starts and restarts, misbehaving Task Apps, and a policy behind a real OpenAI-compatible
endpoint."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rlnode.bus.localbroker import free_port
from rlnode.examples import task_app_path
from rlnode.node.processes import ServiceProcess
from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.service.registry import LEARNER, SERVICES_BY_NAME
from rlnode.testing import ThreadedServer, readable_directory, wait_until
from rlnode_services.learner.probe import task_app_probe
from rlnode_services.learner.settings import LearnerSettings
from tests.integration.fakes import misbehaving_taskapps, scripted_policy
from tests.integration.vault_fixtures import RunningVault

ROOT = Path(__file__).resolve().parents[2]
COPY_TASK = str(task_app_path("copy_task"))
GUESS_NUMBER = str(task_app_path("guess_number"))


@dataclass
class Node:
    vault: RunningVault
    gateway: ServiceProcess
    key: str
    org_a: str
    token_a: str
    org_b: str
    token_b: str
    generator_token: str
    generator_token_b: str
    policy_url: str
    policy_calls: object
    bad_url: str
    data_dir: Path
    gateway_env: dict[str, str]

    def client(self, token: str | None = None) -> GatewayClient:
        return GatewayClient(self.gateway.url, token or self.token_a)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gateway")
    vault = RunningVault(f"sqlite:///{directory / 'vault.sqlite3'}", directory / "vault").start()
    key = "tk-" + secrets.token_hex(16)
    org_a, token_a = vault.new_org()
    org_b, token_b = vault.new_org()
    with vault.client(token_a) as a, vault.client(token_b) as b:
        a.set_secret("ENVIRONMENT_API_KEY", key)
        b.set_secret("ENVIRONMENT_API_KEY", "org-b-key-" + secrets.token_hex(8))
    gateway_data = directory / "gateway-data"
    gateway_env = {
        "GATEWAY_VAULT_URL": vault.url,
        "GATEWAY_SERVICE_TOKEN": vault.service_token(["secrets:unseal"]),
        "DATABASE_URL": f"sqlite:///{directory / 'gateway.sqlite3'}",
        "RLNODE_DATA_DIR": str(gateway_data),
        "GATEWAY_HEALTH_INTERVAL_S": "0.5",
        "GATEWAY_RESTART_BACKOFF_S": "0.2",
        "GATEWAY_CONNECT_RETRIES": "2",
        "GATEWAY_ALLOW_URLS_TO": '["loopback"]',  # the Task Apps here run on loopback
    }
    gateway = ServiceProcess(
        SERVICES_BY_NAME["taskapp-gateway"], free_port(), directory / "gateway.log", gateway_env
    ).start()
    policy_app, calls = scripted_policy()
    with ThreadedServer(policy_app) as policy, ThreadedServer(misbehaving_taskapps(key)) as bad:
        gateway.wait_healthy()
        yield Node(
            vault=vault,
            gateway=gateway,
            key=key,
            org_a=org_a,
            token_a=token_a,
            org_b=org_b,
            token_b=token_b,
            generator_token=vault.service_token(["rollouts:run"], service="rollout-generator"),
            generator_token_b=vault.service_token(
                ["rollouts:run"], org_id=org_b, service="rollout-generator"
            ),
            policy_url=policy.url,
            policy_calls=calls,
            bad_url=bad.url,
            data_dir=directory,
            gateway_env=gateway_env,
        )
        assert gateway.stop() == 0, gateway.log_tail()
    vault.stop()


def rollout_request(
    node: Node, seed: int = 0, config: dict | None = None, model: str = "tiny"
) -> dict:
    return {
        "run_id": f"run-{uuid.uuid4().hex[:10]}",
        "env": {"env_name": "task", "seed": seed, "config": config or {}},
        "policy": {
            "policy_id": "policy-v0",
            "config": {
                "inference_url": node.policy_url,
                "model": model,
                "max_tokens": 16,
                "temperature": 1.0,
                "top_p": 1.0,
            },
        },
        "mode": "rl",
    }


def run(
    node: Node,
    task_app: str,
    request: dict | None = None,
    timeout_s: float | None = None,
    token: str | None = None,
    org: str | None = None,
) -> dict:
    with node.client(token or node.generator_token) as gateway:
        return gateway.rollout(
            org or node.org_a,
            task_app,
            request or rollout_request(node),
            job_id="job-1",
            timeout_s=timeout_s,
        )


# -- managed Task Apps ------------------------------------------------------------------


def test_managed_task_app_verifies_runs_and_survives_kill_9(node: Node) -> None:
    with node.client() as gateway:
        registered = gateway.register("copy", command=[sys.executable, COPY_TASK])
        assert registered["kind"] == "managed" and registered["managed"]["state"] in (
            "starting",
            "healthy",
        )
        report = gateway.verify("copy")
        assert report["ok"], report

    first = run(node, "copy", rollout_request(node, seed=3))
    assert first["status"] == "ok", first
    assert first["result"]["reward"] == 1.0  # the scripted policy copies perfectly
    assert first["response"]["trajectories"][0]["steps"][0]["obs"]["messages"][0][
        "content"
    ].startswith("Copy: ")

    with node.client() as gateway:
        before = gateway.get("copy")["managed"]
    os.kill(before["pid"], signal.SIGKILL)
    # The next rollouts succeed: the gateway waits for the restart rather than failing them.
    outcomes = [run(node, "copy", rollout_request(node, seed=s)) for s in range(3)]
    assert [o["status"] for o in outcomes] == ["ok", "ok", "ok"], outcomes
    with node.client() as gateway:
        after = gateway.get("copy")["managed"]
    assert after["pid"] != before["pid"] and after["restarts"] >= 1 and after["state"] == "healthy"
    assert after["last_exit_code"] == -signal.SIGKILL


def test_a_second_gateway_runs_rollouts_on_the_managed_task_apps_of_the_first(
    node: Node,
) -> None:
    """Gateways scale out: one runs the managed Task Apps, the others run rollouts on them at
    the address it records in the shared database (and follow it when it moves)."""
    with node.client() as gateway:
        gateway.register("shared-copy", command=[sys.executable, COPY_TASK])
        assert gateway.verify("shared-copy")["ok"]
        pid = gateway.get("shared-copy")["managed"]["pid"]
    second = ServiceProcess(
        SERVICES_BY_NAME["taskapp-gateway"],
        free_port(),
        node.data_dir / "gateway-2.log",
        node.gateway_env | {"GATEWAY_RUNS_MANAGED": "false"},
    ).start()
    try:
        second.wait_healthy()
        with GatewayClient(second.url, node.generator_token) as router:
            requests = [rollout_request(node, seed) for seed in range(4)]
            outcomes = router.rollouts(node.org_a, "shared-copy", requests, job_id="job-1")
            assert [o["status"] for o in outcomes] == ["ok"] * 4, outcomes
            assert {o["result"]["reward"] for o in outcomes} == {1.0}
        with GatewayClient(second.url, node.token_a) as router:
            assert router.verify("shared-copy")["ok"]
            assert router.get("shared-copy")["kind"] == "managed"
            for call in (
                lambda: router.register("mine", command=[sys.executable, COPY_TASK]),
                lambda: router.remove("shared-copy"),
                lambda: router.logs("shared-copy"),
            ):
                with pytest.raises(GatewayError) as refused:
                    call()
                assert refused.value.status == 409
                assert "does not run managed Task Apps" in str(refused.value)
            # External ones register anywhere: the registry is the database.
            router.register("outside", url=f"{node.bad_url}/ok")
        assert run(node, "outside")["status"] == "ok"
        # The Task App dies; the first gateway starts it on another port, the second follows.
        os.kill(pid, signal.SIGKILL)
        with GatewayClient(second.url, node.generator_token) as router:

            def answered() -> bool:
                outcome = router.rollouts(node.org_a, "shared-copy", requests[:1])[0]
                return outcome["status"] == "ok"

            wait_until(answered, 30, "the second gateway reaching the restarted Task App")
        with node.client() as gateway:
            assert gateway.get("shared-copy")["managed"]["pid"] != pid
            gateway.remove("shared-copy")
            gateway.remove("outside")
        with GatewayClient(second.url, node.generator_token) as router:

            def unknown() -> bool:  # once its cached registration expires (2 s)
                try:
                    router.rollouts(node.org_a, "shared-copy", requests[:1])
                except GatewayError as e:
                    return e.status == 404
                return False

            wait_until(unknown, 10, "the removed Task App unknown to the second gateway")
    finally:
        assert second.stop() == 0, second.log_tail()


def test_multi_turn_example_completes_an_episode(node: Node) -> None:
    with node.client() as gateway:
        gateway.register("guess", command=[sys.executable, GUESS_NUMBER])
    calls_before = node.policy_calls["guesser"]
    outcome = run(
        node,
        "guess",
        rollout_request(node, seed=11, config={"high": 100, "max_turns": 8}, model="guesser"),
    )
    assert outcome["status"] == "ok", outcome
    steps = outcome["response"]["trajectories"][0]["steps"]
    assert len(steps) > 1 and steps[-1]["info"]["solved"] is True
    assert node.policy_calls["guesser"] - calls_before == len(steps)  # one inference call per turn
    assert 0 < outcome["result"]["reward"] <= 1.0


def test_unregister_stops_the_process(node: Node) -> None:
    with node.client() as gateway:
        gateway.register("short-lived", command=[sys.executable, COPY_TASK])
        assert gateway.verify("short-lived")["ok"]
        pid = gateway.get("short-lived")["managed"]["pid"]
        gateway.remove("short-lived")
        with pytest.raises(GatewayError) as info:
            gateway.get("short-lived")
        assert info.value.status == 404
    wait_until(lambda: not _alive(pid), 15, f"pid {pid} gone", interval_s=0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; /proc says so.
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False


def test_a_task_app_that_prints_its_key_has_it_blanked_out(node: Node) -> None:
    leaky = readable_directory() / "leaky_taskapp.py"
    leaky.write_text(
        "import os, runpy, sys\n"
        "print('my key is', os.environ['ENVIRONMENT_API_KEY'], flush=True)\n"
        f"sys.argv = [{COPY_TASK!r}]\n"
        f"runpy.run_path({COPY_TASK!r}, run_name='__main__')\n"
    )
    with node.client() as gateway:
        gateway.register("leaky", command=[sys.executable, str(leaky)])
        assert gateway.verify("leaky")["ok"]
        output = wait_until(
            lambda: (text := gateway.logs("leaky")) and "my key is" in text and text,
            30,
            "the Task App's line in its log",
            interval_s=0.1,
        )
    assert "my key is [REDACTED]" in output and node.key not in output


@pytest.mark.skipif(os.geteuid() != 0, reason="Task Apps get users of their own under root only")
def test_code_its_user_cannot_read_is_reported_before_it_starts(node: Node, tmp_path) -> None:
    hidden = tmp_path / "private_taskapp.py"  # pytest's directories are 0700
    hidden.write_text(Path(COPY_TASK).read_text())
    with node.client() as gateway:
        gateway.register("hidden", command=[sys.executable, str(hidden)])
        report = gateway.verify("hidden")
    assert not report["ok"]
    assert "who cannot read" in report["healthy"]["detail"], report
    assert str(hidden) in report["healthy"]["detail"]


def test_a_command_that_cannot_start_is_reported(node: Node) -> None:
    with node.client() as gateway:
        gateway.register(
            "broken", command=[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
        )
        report = gateway.verify("broken")
    assert not report["ok"]
    assert "could not be started: exited with code 3" in report["healthy"]["detail"]
    outcome = run(node, "broken")
    assert outcome["status"] == "failed" and outcome["error"]["kind"] == "task_app_unreachable"
    assert "exited with code 3" in outcome["error"]["message"]


# -- external Task Apps that misbehave ----------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "kind", "timeout_s", "says"),
    [
        ("garbage", "task_app_invalid_response", None, "did not answer JSON"),
        ("shape", "task_app_invalid_response", None, "trajectories"),
        ("noreward", "task_app_invalid_response", None, "no reward"),
        ("hang", "timeout", 1.0, "within 1s"),
        ("crash", "task_app_error", None, "(500)"),
        ("synth400", "task_app_auth_refused", None, "refused the key (400)"),
    ],
)
def test_misbehaving_task_apps_give_classified_errors(
    node: Node, mode: str, kind: str, timeout_s, says: str
) -> None:
    with node.client() as gateway:
        gateway.register(f"bad-{mode}", url=f"{node.bad_url}/{mode}")
    outcome = run(node, f"bad-{mode}", timeout_s=timeout_s)
    assert outcome["status"] == "failed", outcome
    assert outcome["error"]["kind"] == kind
    assert says in outcome["error"]["message"]
    assert node.key not in str(outcome)
    assert httpx.get(f"{node.gateway.url}/health").json()["status"] == "ok"


def test_a_group_call_answers_each_rollout_in_order_each_failing_alone(node: Node) -> None:
    with node.client() as gateway:
        gateway.register("odd", url=f"{node.bad_url}/oddseeds")
    requests = [rollout_request(node, seed) for seed in range(5)]
    with node.client(node.generator_token) as gateway:
        outcomes = gateway.rollouts(node.org_a, "odd", requests, job_id="job-1")
        full = gateway.rollouts(node.org_a, "odd", requests[:1], with_response=True)
    assert [o["run_id"] for o in outcomes] == [r["run_id"] for r in requests]
    assert [o["status"] for o in outcomes] == ["ok", "failed", "ok", "failed", "ok"]
    assert {o["error"]["kind"] for o in outcomes if o["error"]} == {"task_app_error"}
    assert outcomes[0]["result"]["reward"] == 0.5 and outcomes[0]["response"] is None
    assert full[0]["response"]["run_id"] == requests[0]["run_id"]  # only when asked
    with node.client(node.generator_token) as gateway, pytest.raises(GatewayError) as empty:
        gateway.rollouts(node.org_a, "odd", [])
    assert empty.value.status == 422 and "requests" in str(empty.value)


def test_unreachable_task_app_is_retried_then_classified(node: Node) -> None:
    with node.client() as gateway:
        gateway.register("gone", url=f"http://127.0.0.1:{free_port()}")
    outcome = run(node, "gone")
    assert outcome["error"]["kind"] == "task_app_unreachable"
    assert "after 3 attempts" in outcome["error"]["message"]


def test_a_re_registered_task_app_is_used_at_once(node: Node) -> None:
    """The gateway keeps registrations in memory for rollouts; its own changes apply at once."""
    with node.client() as gateway:
        gateway.register("moving", url=f"http://127.0.0.1:{free_port()}")
    assert run(node, "moving")["error"]["kind"] == "task_app_unreachable"
    with node.client() as gateway:
        gateway.remove("moving")
    with pytest.raises(GatewayError) as gone:
        run(node, "moving")
    assert gone.value.status == 404 and "no Task App named 'moving'" in str(gone.value)
    with node.client() as gateway:
        gateway.register("moving", url=f"{node.bad_url}/crash")
    outcome = run(node, "moving")
    assert outcome["error"]["kind"] == "task_app_error" and "(500)" in outcome["error"]["message"]


def test_external_app_that_accepts_any_key_fails_verification(node: Node) -> None:
    with node.client() as gateway:
        gateway.register("lax", url=f"{node.bad_url}/nokeycheck")
        report = gateway.verify("lax")
        gateway.register("strict", url=f"{node.bad_url}/crash")
        strict = gateway.verify("strict")
    assert report["healthy"]["ok"] and report["accepts_key"]["ok"]
    assert not report["refuses_wrong_key"]["ok"] and not report["ok"]
    assert "must refuse" in report["refuses_wrong_key"]["detail"]
    assert strict["ok"]  # checks the key on every route, including a synth-style 400


# -- isolation and the key ------------------------------------------------------------


def test_another_org_cannot_see_or_call_it(node: Node) -> None:
    with node.client() as gateway:
        gateway.register("private", url=f"{node.bad_url}/ok")
    base = node.gateway.url
    for method, path in [
        ("GET", f"/v1/orgs/{node.org_a}/taskapps"),
        ("GET", f"/v1/orgs/{node.org_a}/taskapps/private"),
        ("POST", f"/v1/orgs/{node.org_a}/taskapps/private/verify"),
        ("GET", f"/v1/orgs/{node.org_a}/taskapps/private/logs"),
        ("DELETE", f"/v1/orgs/{node.org_a}/taskapps/private"),
    ]:
        response = httpx.request(
            method, base + path, headers={"Authorization": f"Bearer {node.token_b}"}
        )
        assert response.status_code == 403, (method, path, response.text)
    one = {"org_id": node.org_a, "task_app": "private", "request": rollout_request(node)}
    group = {"org_id": node.org_a, "task_app": "private", "requests": [rollout_request(node)]}
    for path, body in (("/v1/rollouts", one), ("/v1/rollout-groups", group)):
        for token in (
            node.generator_token_b,
            node.token_b,
            node.token_a,
        ):  # B's service; org tokens
            response = httpx.post(
                base + path, json=body, headers={"Authorization": f"Bearer {token}"}
            )
            assert response.status_code == 403, response.text
        response = httpx.post(base + path, json=body)
        assert response.status_code == 401
    with node.client(node.token_b) as gateway_b:
        assert [a["name"] for a in gateway_b.list()] == []
        with pytest.raises(GatewayError) as info:
            gateway_b.get("private")
        assert info.value.status == 404  # in its own org, it simply does not exist
    assert run(node, "private")["status"] == "ok"  # and A's still works


def test_the_learners_probe_gets_a_verdict_for_its_orgs_only(node: Node) -> None:
    """A paused job asks the gateway whether its Task App answers again, with the learner's
    service token (taskapps:read): a verdict, never what the Task App sent. A token of
    another org, one without the scope, and a forged one are refused."""
    with node.client() as gateway:
        gateway.register("probed", url=f"{node.bad_url}/crash")  # answers; its rollouts fail
        gateway.register("probed-gone", url=f"http://127.0.0.1:{free_port()}")

    def probe(token: str | None, name: str = "probed") -> tuple[bool, str]:
        settings = LearnerSettings(gateway_url=node.gateway.url, service_token=token)
        return asyncio.run(task_app_probe(settings, node.org_a, name)())

    learner = node.vault.service_token([str(s) for s in LEARNER.token_scopes], service="learner")
    assert probe(learner) == (True, "passes the gateway's verification")
    ok, said = probe(learner, "probed-gone")
    assert not ok and said.startswith("healthy: cannot connect") and node.key not in said
    learner_b = node.vault.service_token(["taskapps:read"], org_id=node.org_b, service="learner")
    for token, status, says in [
        (learner_b, 403, f"cannot act on org {node.org_a!r}"),
        (node.generator_token, 403, "lacks the scope(s) taskapps:read"),
        ("rln1.forged.token", 401, "gateway"),
    ]:
        ok, said = probe(token)
        assert not ok and f"(HTTP {status})" in said and says in said, said
    assert probe(None) == (
        False,
        "the learner has no service token (LEARNER_SERVICE_TOKEN) to ask with",
    )


def test_registration_errors_are_clear(node: Node) -> None:
    with node.client() as gateway:
        for kwargs, says in [
            ({"url": "http://x", "command": ["x"]}, "either url"),
            ({}, "either url"),
            ({"url": "ftp://x"}, "http:// or https://"),
            (
                {"command": ["x"], "env": {"ENVIRONMENT_API_KEY": "plain"}},
                "may not set ENVIRONMENT_API_KEY",
            ),
        ]:
            with pytest.raises(GatewayError) as info:
                gateway.register("bad-registration", **kwargs)
            assert info.value.status == 422 and says in info.value.message, info.value.message
            assert "plain" not in info.value.message
        gateway.register("twice", url=f"{node.bad_url}/ok")
        with pytest.raises(GatewayError) as info:
            gateway.register("twice", url=f"{node.bad_url}/ok")
        assert info.value.status == 409
        gateway.register("no-secret", url=f"{node.bad_url}/ok", secret="MISSING_SECRET")
        report = gateway.verify("no-secret")
    assert not report["ok"] and "MISSING_SECRET" in report["healthy"]["detail"]


def _cli(node: Node, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLNODE_")}
    env |= {"RLNODE_GATEWAY_URL": node.gateway.url, "RLNODE_TOKEN": node.token_a}
    return subprocess.run(
        [sys.executable, "-m", "rlnode.cli", "taskapp", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_taskapp_cli(node: Node) -> None:
    registered = _cli(
        node,
        "register",
        "cli-copy",
        "--command",
        "python -m rlnode.examples.taskapps.copy_task",
        "--cwd",
        str(ROOT),
    )
    assert registered.returncode == 0, registered.stderr
    assert "registered managed Task App cli-copy" in registered.stdout
    verified = _cli(node, "verify", "cli-copy")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verified: a job can use it" in verified.stdout
    listed = _cli(node, "list")
    line = next(line for line in listed.stdout.splitlines() if line.startswith("cli-copy"))
    assert "managed" in line and "healthy" in line
    lax = _cli(node, "register", "cli-lax", "--url", f"{node.bad_url}/nokeycheck")
    assert lax.returncode == 0
    failed = _cli(node, "verify", "cli-lax")
    assert failed.returncode == 1 and "FAIL refuses_wrong_key" in failed.stdout
    bad_env = _cli(node, "register", "x", "--command", "true", "--env", "NOEQUALS")
    assert bad_env.returncode == 1 and "NAME=VALUE" in bad_env.stderr
    removed = _cli(node, "rm", "cli-copy")
    assert removed.returncode == 0 and "removed cli-copy" in removed.stdout
    missing = _cli(node, "rm", "cli-copy")
    assert missing.returncode == 1 and "no Task App named 'cli-copy' (HTTP 404)" in missing.stderr


def test_the_key_is_never_in_the_gateways_database_or_logs(node: Node) -> None:
    # Runs last in this module: after registrations, verifies, rollouts, a kill -9 and errors.
    assert run(node, "copy")["status"] == "ok"
    secret = node.key.encode()
    scanned = 0
    for path in node.data_dir.rglob("*"):
        if path.is_file() and "vault" not in path.name and path.parent.name != "vault":
            assert secret not in path.read_bytes(), f"the key is in {path}"
            scanned += 1
    assert scanned >= 3  # gateway database (+ WAL), gateway log, Task App logs
    assert (node.data_dir / "gateway.sqlite3").is_file() and (
        node.data_dir / "gateway.log"
    ).is_file()
