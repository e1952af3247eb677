"""The learner's weight versions over HTTP (`GET /v1/weights/{org}/{job}/{version}`), from
the attacker's side: while the victim's job runs and publishes versions, a generator's
service token downloads them, and nothing else does: no token, org tokens (the victim's
own included), a service token of another org or without `weights:read`, another job's
or an unpublished version, ids that climb out of the store."""

from __future__ import annotations

import http.client
from urllib.parse import urlparse

import blake3
import httpx

from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.service.registry import GENERATOR
from rlnode.testing import unique_id
from tests.security.conftest import AttackedNode


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _raw_get(base_url: str, path: str, token: str) -> int:
    """A GET with the request target sent as written (httpx would resolve `..` first)."""
    url = urlparse(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("GET", path, headers=_bearer(token))
        return connection.getresponse().status
    finally:
        connection.close()


async def test_only_a_service_token_with_weights_read_downloads_a_jobs_weights(
    attacked: AttackedNode,
) -> None:
    node, victim, attacker = attacked.node, attacked.victim, attacked.attacker
    generator = node.service_token([str(s) for s in GENERATOR.token_scopes], GENERATOR.name)
    # A service token the attacker got for their own org, with the scope (as an operator
    # might mint one for a generator of theirs).
    attackers_service = node.service_token(["weights:read"], "rollout-generator")
    with node.admin() as admin:
        attackers_own = admin.create_service_token(
            "rollout-generator", ["weights:read"], attacker.org_id
        )["token"]
    no_scope = node.service_token(["rollouts:run", "records:sign"], GENERATOR.name)
    # max_async 4: the learner keeps 6 versions, so the one named stays while this runs.
    config = example_job(
        "copy_task", attacked.model, steps=1000, group_size=4, prompts_per_step=2, max_async=4
    )
    async with node.jobs(victim) as jobs:
        job = await jobs.start(config)
        try:
            published = None
            async for event in jobs.events(job, idle_timeout_s=120):
                if event.type is JobEventType.WEIGHTS_PUBLISHED:
                    published = event.data
                    break
            assert published is not None
            version = published["version"]
            path = f"/v1/weights/{victim.org_id}/{job}/{version}"
            async with httpx.AsyncClient(base_url=node.url("learner"), timeout=30) as learner:
                # The generator's token: the file as published, resumable.
                whole = await learner.get(path, headers=_bearer(generator))
                assert whole.status_code == 200, whole.text
                assert blake3.blake3(whole.content).hexdigest() == published["blake3"]
                assert whole.headers["etag"] == f'"{published["blake3"]}"'
                rest = await learner.get(path, headers=_bearer(generator) | {"Range": "bytes=100-"})
                assert rest.status_code == 206 and rest.content == whole.content[100:]
                beyond = await learner.get(
                    path, headers=_bearer(generator) | {"Range": f"bytes={len(whole.content)}-"}
                )
                assert beyond.status_code == 416

                async def status(url: str, token: str | None) -> int:
                    headers = _bearer(token) if token else {}
                    return (await learner.get(url, headers=headers)).status_code

                assert await status(path, None) == 401
                assert await status(path, victim.token) == 403  # org tokens read no weights
                assert await status(path, attacker.token) == 403
                assert await status(path, no_scope) == 403
                assert await status(path, attackers_own) == 403  # another org's
                assert await status(path, attackers_service) == 200  # node-wide: the control
                # Names this learner did not publish: 404, whoever asks.
                for other in (
                    f"/v1/weights/{attacker.org_id}/{job}/{version}",  # the job under their org
                    f"/v1/weights/{victim.org_id}/{attacked.victim_job}/1",  # a job that ended
                    f"/v1/weights/{victim.org_id}/{unique_id('job')}/{version}",
                    f"/v1/weights/{victim.org_id}/{job}/999999",
                ):
                    assert await status(other, generator) == 404, other
                assert (
                    await status(f"/v1/weights/{attacker.org_id}/{job}/{version}", attackers_own)
                    == 404
                )
            # Ids that climb out of <store>/<org>/<job>/: refused before anything is looked up.
            base = node.url("learner")
            assert _raw_get(base, path, generator) == 200  # the control: this way reaches it
            for target in (
                f"/v1/weights/{victim.org_id}/..%2F..%2F..%2Fetc%2Fpasswd/{version}",
                f"/v1/weights/{victim.org_id}/../{job}/{version}",
                f"/v1/weights/{victim.org_id}/..%2f{job}/{version}",
                f"/v1/weights/{victim.org_id}/%2e%2e/{version}",
                f"/v1/weights/{victim.org_id}/.{job}/{version}",
                f"/v1/weights/{victim.org_id}/{job}/..%2F..%2Fv000001.safetensors",
                f"/v1/weights/{victim.org_id}/{job}/-1",
                f"/v1/weights/%2Fetc/{job}/{version}",
            ):
                assert _raw_get(base, target, generator) in (404, 422), target
        finally:
            await jobs.cancel(job, "the attacks are over")
            async for _event in jobs.events(job, idle_timeout_s=120):
                pass  # until its end: the learner runs one job at a time
