"""A node over three hosts, each a network namespace of its own (tests/multihost/hosts.py):
host A runs the control and training roles (broker, vault, gateway with the managed Task
App, learner, checkpoint-server), hosts B and C run a rollout-generator each. Every host
has its own tmpfs over the weights directory, so B and C cannot read the learner's weight
versions from shared memory: they fetch them over HTTP. Mid-job B's generator is SIGKILLed
(B's supervisor starts it again) and C's link is taken down for good. The job completes and
its chain of checkpoints trained every work item exactly once.

Each host is brought up as an operator would: `rlnode up --role ... --host <its address>`,
the others with `--join` and the control host's join file. Only the test hosts' addresses
are used between hosts (each service listens on its host's address, not loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from rlnode import testing
from rlnode.bus.settings import KafkaSettings
from rlnode.examples import example_job, task_app_path
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node.chaos import trained_once
from rlnode.node.roles import JoinInfo, join_path
from rlnode.sdk.gateway import GatewayClient
from rlnode.sdk.jobs import JobsClient
from rlnode.sdk.vault import VaultClient
from rlnode.testing import unique_id
from tests.multihost import hosts

pytestmark = pytest.mark.skipif(
    (why := hosts.available()) is not None, reason=f"no test hosts here: {why}"
)

STEPS, PROMPTS, GROUP = 24, 2, 4
GENERATOR = "rollout-generator/gen0"


class HostProcess:
    """`rlnode up` on a test host, in the foreground of its namespace."""

    def __init__(self, host: hosts.Host, data_dir: Path, argv: list[str], weights: Path):
        self.host = host
        self.data_dir = data_dir
        data_dir.mkdir(parents=True)
        self.log = data_dir.parent / f"{host.name}-up.log"
        env = os.environ | {
            "RLNODE_DATA_DIR": str(data_dir),
            "RLNODE_WEIGHTS_DIR": str(weights),
            # Quick failover for the test: a silent generator leaves its group in 6 s.
            "KAFKA_SESSION_TIMEOUT_MS": "6000",
            "KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
        }
        env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # host A runs its own broker
        command = [sys.executable, "-m", "rlnode.cli", "up", "--host", host.address, *argv]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                host.command(command, private_dirs=(weights,)),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def state(self) -> dict | None:
        path = self.data_dir / "node.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_up(self, timeout_s: float) -> dict:
        def up() -> dict | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"rlnode up on {self.host.name} exited: {self.tail()}")
            return self.state()

        try:
            return testing.wait_until(up, timeout_s, f"host {self.host.name} up")
        except TimeoutError as e:
            raise AssertionError(f"{e}: {self.tail()}") from None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it stops its services in order
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture(scope="module")
def network() -> Iterator[hosts.TestNetwork]:
    with hosts.TestNetwork() as net:
        yield net


def learner_job(join: JoinInfo, token: str, job_id: str) -> dict:
    try:
        response = httpx.get(
            join.learner_url + "/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=5
        )
        return next((j for j in response.json() if j["job_id"] == job_id), {})
    except (httpx.HTTPError, ValueError):
        return {}


@pytest.mark.timeout(900)
def test_a_job_over_three_hosts_survives_a_killed_generator_and_a_pulled_cable(
    network: hosts.TestNetwork, tmp_path: Path
) -> None:
    a, b, c = (network.add_host(name) for name in ("a", "b", "c"))
    weights = tmp_path / "weights"  # a tmpfs of its own on each host
    weights.mkdir()
    model = init_tiny_model(tmp_path / "tiny", seed=0)  # every host reads the model's files
    with ExitStack() as stack:
        control = HostProcess(a, tmp_path / "a", ["--role", "control,training"], weights)
        stack.callback(control.stop)
        control.wait_up(180)
        join_file = join_path(control.data_dir)
        join = JoinInfo.read(join_file)
        assert all(a.address in url for url in (join.bootstrap, join.vault_url, join.learner_url))
        inference = []
        for host in (b, c):
            process = HostProcess(
                host,
                tmp_path / host.name,
                ["--role", "inference", "--join", str(join_file)],
                weights,
            )
            stack.callback(process.stop)
            inference.append(process)
        states = [p.wait_up(180) for p in inference]
        for host, state in zip((b, c), states, strict=True):
            assert state["services"][GENERATOR]["url"].startswith(f"http://{host.address}:")

        # The user, from this machine: an org, its key, the managed Task App, a job.
        admin_token = (control.data_dir / "secrets" / "vault-admin.token").read_text().strip()
        org_id = unique_id("org")
        with VaultClient(join.vault_url, admin_token) as admin:
            token = admin.create_org(org_id)["token"]["token"]
        with VaultClient(join.vault_url, token) as vault:
            vault.set_secret("ENVIRONMENT_API_KEY", unique_id("key"))
        with GatewayClient(join.gateway_urls[0], token) as gateway:
            gateway.register("copy", command=[sys.executable, str(task_app_path("copy_task"))])
            assert gateway.verify("copy")["ok"]
        config = example_job(
            "copy_task",
            model,
            steps=STEPS,
            prompts_per_step=PROMPTS,
            group_size=GROUP,
            checkpoint_every=2,
            max_async=1,
        )
        kafka = KafkaSettings(bootstrap_servers=join.bootstrap)

        async def start() -> str:
            async with JobsClient(org_id, token, kafka, "multihost", join.vault_url) as jobs:
                return await jobs.start(config, unique_id("mh"))

        job_id = asyncio.run(start())

        def at_step(step: int):
            return lambda: learner_job(join, token, job_id).get("step", 0) >= step

        testing.wait_until(at_step(3), 300, f"{job_id} at step 3")
        # B's generator SIGKILLed: B's supervisor starts it again.
        killed = inference[0].wait_up(10)["services"][GENERATOR]["pid"]
        os.kill(killed, signal.SIGKILL)
        testing.wait_until(at_step(8), 300, f"{job_id} at step 8 after B's generator was killed")
        # C's cable pulled mid-job, for good: its work goes to B once C leaves the group.
        c.link(up=False)
        done = testing.wait_until(
            lambda: (
                (j := learner_job(join, token, job_id)).get("status") in ("completed", "failed")
                and j
            ),
            600,
            f"{job_id} ended",
        )
        assert done["status"] == "completed", (done, control.tail())
        restarted = inference[0].wait_up(10)["services"][GENERATOR]
        assert restarted["restarts"] == 1 and restarted["pid"] != killed

        async def events() -> list:
            async with JobsClient(org_id, token, kafka, "multihost-watch", join.vault_url) as jobs:
                return [e async for e in jobs.events(job_id, follow=False)]

        loaded = [e.data for e in asyncio.run(events()) if e.type == JobEventType.WEIGHTS_LOADED]
        by_host = {host.address: [d for d in loaded if d.generator.endswith(f"@{host.address}")]
                   for host in (b, c)}  # fmt: skip
        assert by_host[b.address] and by_host[c.address], loaded
        # Neither generator could see the learner's shared memory: every version came over HTTP.
        assert {d.transport for d in loaded} == {"http"}, loaded

    checkpoints = control.data_dir / "checkpoints" / org_id / job_id / "checkpoints"
    assert trained_once(checkpoints, job_id, STEPS, PROMPTS, GROUP) == (0, 0)
    assert done["step"] == STEPS
