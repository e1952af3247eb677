"""A PostgreSQL server of the test's own is stopped and started again under a running vault,
gateway and learner. While it is down, requests answer 503 saying the database is
unreachable, /health answers "degraded" naming the database, and the services stay up; a job
request published meanwhile waits rather than being dead-lettered or rejected. Once it is
back they recover by themselves (no restart): what was there before is all there, what was
refused left nothing behind, and the job request gets its verdict."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator

import httpx
import pytest

from rlnode.bus.localbroker import free_port
from rlnode.examples import example_job
from rlnode.examples.taskapps import copy_task
from rlnode.messages import JobEvent, JobEventType, JobRequest, topics
from rlnode.models.build import init_tiny_model
from rlnode.node.processes import ServiceProcess
from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.sdk.vault import VaultError
from rlnode.service.registry import SERVICES_BY_NAME
from rlnode.taskapp.server import create_task_app
from rlnode.testing import ThreadedServer, unique_id
from tests.chaos.own_postgres import OwnPostgres, missing_tools, own_postgres
from tests.conftest import eventually
from tests.integration.vault_fixtures import RunningVault

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]
UNREACHABLE = "the database is unreachable: "


@pytest.fixture
def postgres() -> Iterator[OwnPostgres]:
    if why := missing_tools():
        pytest.skip(why)
    with own_postgres() as server:
        yield server


def health(process_url: str, path: str = "/health") -> dict:
    response = httpx.get(process_url + path, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def refused(call) -> str:
    """The message of a call that must answer 503."""
    try:
        call()
    except (VaultError, GatewayError) as e:
        assert e.status == 503, e
        return e.message
    raise AssertionError("answered while the database was down")


async def test_services_answer_503_while_the_database_is_down_and_recover_by_themselves(
    postgres, tmp_path, monkeypatch, kafka_broker, make_bus
):
    vault = RunningVault(postgres.create_database("vault"), tmp_path / "vault").start()
    services: list[ServiceProcess] = []
    key = "tk-" + secrets.token_hex(16)
    monkeypatch.setenv("ENVIRONMENT_API_KEY", key)  # the Task App served from this process
    try:
        with ThreadedServer(create_task_app(copy_task.DEFINITION)) as task_app:
            await _outage(
                postgres, tmp_path, kafka_broker, make_bus, vault, key, task_app, services
            )
    finally:
        for process in services:
            process.stop()
        vault.stop()


async def _outage(postgres, tmp_path, kafka_broker, make_bus, vault, key, task_app, services):
    org_id, org_token = vault.new_org()
    with vault.client(org_token) as org:
        org.set_secret("ENVIRONMENT_API_KEY", key)
    gateway = _start(
        services,
        "taskapp-gateway",
        tmp_path,
        DATABASE_URL=postgres.create_database("gateway"),
        GATEWAY_VAULT_URL=vault.url,
        GATEWAY_SERVICE_TOKEN=vault.service_token(["secrets:unseal"]),
        GATEWAY_ALLOW_URLS_TO='["loopback"]',
    )
    with GatewayClient(gateway.url, org_token) as apps:
        apps.register("copy", url=task_app.url)
        assert apps.verify("copy")["ok"]
    learner_spec = SERVICES_BY_NAME["learner"]
    model = init_tiny_model(tmp_path / "tiny", seed=0)
    group = unique_id("learner")
    learner = _start(
        services,
        "learner",
        tmp_path,
        DATABASE_URL=postgres.create_database("learner"),
        KAFKA_BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers,
        KAFKA_SESSION_TIMEOUT_MS="6000",
        KAFKA_HEARTBEAT_INTERVAL_MS="2000",
        LEARNER_VAULT_URL=vault.url,
        LEARNER_GATEWAY_URL=gateway.url,
        LEARNER_SERVICE_TOKEN=vault.service_token(
            list(learner_spec.token_scopes), service=learner_spec.name
        ),
        LEARNER_GROUP_ID=group,
        LEARNER_TRAJECTORY_GROUP_ID=f"{group}-trajectories",
        RLNODE_CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
        LEARNER_MODEL_DIRS=json.dumps([str(tmp_path)]),
    )
    job_id = unique_id("job")
    with vault.client(org_token) as org:
        job_token = org.create_job_token(job_id)  # minted while the vault can
        secrets_before = org.list_secrets()
    with GatewayClient(gateway.url, org_token) as apps:
        apps_before = apps.list()
    # The learner checks tokens from here on without asking the vault (for a while): a
    # request meets its own database's outage.
    assert _learner_jobs(learner, org_token).status_code == 200

    postgres.stop()
    with vault.client(org_token) as org:
        said = refused(org.list_secrets)
        assert said.startswith(UNREACHABLE) and said.endswith("; retry in a few seconds"), said
        refused(lambda: org.set_secret("LATE", "refused"))
    with GatewayClient(gateway.url, org_token) as apps:
        assert refused(apps.list).startswith(UNREACHABLE)
        assert UNREACHABLE in refused(lambda: apps.register("late", url=task_app.url))
    jobs = _learner_jobs(learner, org_token)
    assert jobs.status_code == 503 and jobs.json()["detail"].startswith(UNREACHABLE)
    for process_url in (vault.url, gateway.url, learner.url):
        report = health(process_url)  # up, and saying what is wrong
        assert report["status"] == "degraded" and report["checks"]["database"] is False, report
    user = make_bus("user")
    await user.start()
    await user.publish(
        JobRequest(
            job_id=job_id,
            org_id=org_id,
            token=job_token,
            config=example_job("copy_task", model, steps=1, prompts_per_step=1, group_size=2),
        )
    )
    await eventually(
        lambda: f"handled again in 1.0s: {UNREACHABLE}" in learner.log_tail(50_000),
        30,
        "the learner meeting the outage with the request in hand (twice)",
    )

    postgres.start()
    with vault.client(org_token) as org:
        await eventually(lambda: _answers(org.list_secrets), 30, "the vault answering again")
        assert org.list_secrets() == secrets_before  # all there; the refused write left nothing
    with GatewayClient(gateway.url, org_token) as apps:
        await eventually(lambda: _answers(apps.list), 30, "the gateway answering again")
        assert apps.list() == apps_before
    verdict = await _verdict(make_bus, job_id, 60)
    assert verdict.type is JobEventType.ACCEPTED, verdict.message
    for process_url in (vault.url, gateway.url, learner.url):
        assert health(process_url)["checks"]["database"] is True


def _start(services: list[ServiceProcess], name: str, tmp_path, **env: str) -> ServiceProcess:
    process = ServiceProcess(
        SERVICES_BY_NAME[name],
        free_port(),
        tmp_path / f"{name}.log",
        env={"RLNODE_DATA_DIR": str(tmp_path / name), **env},
    ).start()
    services.append(process)
    process.wait_healthy()
    return process


def _learner_jobs(learner: ServiceProcess, token: str) -> httpx.Response:
    return httpx.get(
        learner.url + "/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )


def _answers(call) -> bool:
    try:
        call()
    except (VaultError, GatewayError) as e:
        if e.status != 503:
            raise
        return False
    return True


async def _verdict(make_bus, job_id: str, within_s: float) -> JobEvent:
    """The first event that answers the job's start request."""
    bus = make_bus("watcher")
    verdict: asyncio.Future[JobEvent] = asyncio.get_running_loop().create_future()

    async def on_event(event: JobEvent, _delivery) -> None:
        answers = {JobEventType.ACCEPTED, JobEventType.REJECTED, JobEventType.FAILED}
        if event.job_id == job_id and event.type in answers and not verdict.done():
            verdict.set_result(event)

    bus.subscribe(topics.JOB_EVENTS, on_event, group_id=None)
    await bus.start()
    try:
        return await asyncio.wait_for(verdict, within_s)
    finally:
        await bus.stop()
