"""Attacks over HTTP: routes called without a token, listings that would show other orgs,
batched inference poisoned with bad token ids, a revoked token used again after it expired,
and data files other users of the machine could read."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
from datetime import timedelta

import httpx
import pytest

from rlnode.messages import utc_now
from rlnode.sdk.vault import VaultClient
from rlnode.service.auth import AuthError, TokenVerifier
from rlnode.testing import unique_id
from tests.security.conftest import AttackedNode

# Routes that answer without a token, and why (docs/security.md says the same).
PUBLIC = {
    "/health",  # liveness for supervisors and load balancers
    "/openapi.json",  # the API's shape, which the public repository holds anyway
    "/v1/verify-key",  # the vault's public key: verifiers need it before they can check anything
    "/v1/revocations",  # ids of revoked tokens: not credentials
    "/api/v1/healthz",  # the tinker SDK's liveness route: {"status": "ok"}, nothing else
}
# Capability URLs: the unguessable rollout id is the credential (the Task App calling back
# has no rlnode token). An unknown id gets 404.
CAPABILITY = re.compile(r"^/rollouts/\{rollout_id\}/")


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x1", path)


def test_every_route_of_every_service_needs_a_token(attacked: AttackedNode) -> None:
    checked = 0
    for name, process in attacked.node.processes.items():
        with httpx.Client(base_url=process.url, timeout=30) as http:
            spec = http.get("/openapi.json").json()
            for path, methods in spec["paths"].items():
                for method in methods:
                    # A well-formed body, so that only the credential is missing.
                    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
                    response = http.request(method.upper(), _concrete(path), json=body)
                    if path in PUBLIC:
                        continue
                    expected = 404 if CAPABILITY.match(path) else 401
                    assert response.status_code == expected, (name, method, path, response.text)
                    checked += 1
            for ui in ("/docs", "/redoc"):
                assert http.get(ui).status_code == 404, (name, ui)
    assert checked >= 30  # every service's routes, not a handful


def test_job_listings_show_the_callers_org_only(attacked: AttackedNode) -> None:
    learner = attacked.url("learner")
    with httpx.Client(base_url=learner, timeout=30) as http:
        assert http.get("/v1/jobs").status_code == 401
        mine = http.get("/v1/jobs", headers=_bearer(attacked.attacker.token))
        assert mine.status_code == 200
        assert all(job["org_id"] == attacked.attacker.org_id for job in mine.json())
        theirs = http.get("/v1/jobs", headers=_bearer(attacked.victim.token)).json()
        assert attacked.victim_job in {job["job_id"] for job in theirs}
        # A service token without node:ops is no operator.
        generator_token = attacked.node.service_token(["rollouts:run"], "rollout-generator")
        assert http.get("/v1/jobs", headers=_bearer(generator_token)).status_code == 403
        operator = attacked.node.service_token(["node:ops"], "operator")
        every = http.get("/v1/jobs", headers=_bearer(operator)).json()
        assert attacked.victim_job in {job["job_id"] for job in every}
    with httpx.Client(base_url=attacked.url("checkpoint-server"), timeout=30) as http:
        assert http.get("/v1/checkpoint-server").status_code == 401
        org_view = http.get("/v1/checkpoint-server", headers=_bearer(attacked.attacker.token))
        assert org_view.status_code == 403


async def test_bad_token_ids_get_400_and_the_requests_batched_with_them_succeed(
    attacked: AttackedNode,
) -> None:
    url = attacked.url("checkpoint-server")
    model = f"{attacked.victim_job}@latest"
    headers = _bearer(attacked.victim.token)
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as http:
        await http.post(
            "/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 1}
        )  # loaded, so that the requests below meet in one batch

        def complete(prompt: list[int]):
            body = {"model": model, "prompt": prompt, "max_tokens": 8}
            return http.post("/v1/completions", json=body)

        good, too_high, negative, huge = await asyncio.gather(
            complete([1, 2, 3]), complete([1, 10**6]), complete([-1, 2]), complete([2**62])
        )
    assert good.status_code == 200, good.text
    for bad in (too_high, negative, huge):
        assert bad.status_code == 400, bad.text
        assert "outside this model's vocabulary" in bad.json()["error"]["message"]


def test_a_revoked_token_stays_refused_after_it_expires(tmp_path, monkeypatch) -> None:
    import rlnode_services.credential_vault.vault as vault_module
    from rlnode.service.db import make_engine
    from rlnode_services.credential_vault.crypto import KeyWrapper
    from rlnode_services.credential_vault.settings import VaultSettings

    vault = vault_module.Vault(
        make_engine(f"sqlite:///{tmp_path / 'vault.sqlite3'}"),
        KeyWrapper(os.urandom(32)),
        VaultSettings(admin_token="a" * 32),
    )
    vault.initialise()
    vault.create_org("org-a", None)
    admin = vault_module.Actor(vault_module.ADMIN_ACTOR)
    issued = vault.issue_token("org", "short", "org-a", {"jobs:read"}, 60, admin)
    vault.revoke_token(issued.record.token_id, "org-a", admin)
    # 75 s on: expired 15 s ago, so inside verifiers' leeway; the vault must still list it
    # as revoked, or every service would take it again.
    later = utc_now() + timedelta(seconds=75)
    monkeypatch.setattr(vault_module, "utc_now", lambda: later)
    revoked = set(vault.revoked_token_ids())
    verifier = TokenVerifier(
        vault.signing_key.verify_key, is_revoked=revoked.__contains__, clock=later.timestamp
    )
    with pytest.raises(AuthError, match="revoked"):
        verifier.verify(issued.token)


def test_data_files_are_readable_by_the_node_alone(attacked: AttackedNode) -> None:
    loose = []
    for root, dirs, files in os.walk(attacked.node.data_dir):
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            if mode & 0o077 and not stat.S_ISLNK(os.lstat(path).st_mode):
                loose.append(f"{oct(mode)} {path}")
    root_mode = stat.S_IMODE(os.stat(attacked.node.data_dir).st_mode)
    assert root_mode & 0o077 == 0, oct(root_mode)
    assert not loose, "\n".join(loose[:20])


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_job_events_over_http_are_the_callers_orgs_only(attacked: AttackedNode) -> None:
    url = f"{attacked.url('checkpoint-server')}/v1/jobs/{attacked.victim_job}/events"
    async with httpx.AsyncClient(timeout=120) as http:
        refused = await http.get(url, headers=_bearer(attacked.attacker.token))
        assert refused.status_code == 404
        events = []
        async with http.stream("GET", url, headers=_bearer(attacked.victim.token)) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "job.accepted" and kinds[-1] == "job.completed", kinds
    assert {e["org_id"] for e in events} == {attacked.victim.org_id}


def test_another_orgs_checkpoint_files_and_merged_weights_are_a_404(attacked: AttackedNode) -> None:
    """The download routes, the merged LoRA weights among them, resolve in the caller's org
    only: another org's job is as absent as one that never ran."""
    job = attacked.victim_job
    with httpx.Client(base_url=attacked.url("checkpoint-server"), timeout=60) as http:
        for path in (
            f"/v1/checkpoints/{job}/latest/files",
            f"/v1/checkpoints/{job}/latest/files/trainer_state.json",
            f"/v1/checkpoints/{job}/latest/merged/model.safetensors",
        ):
            theirs = http.get(path, headers=_bearer(attacked.attacker.token))
            assert theirs.status_code == 404, (path, theirs.text)
            assert "no checkpoints of job" in theirs.json()["error"]["message"]
        # The owner reaches them; the victim's job trained whole weights: nothing to merge.
        own = http.get(
            f"/v1/checkpoints/{job}/latest/merged/model.safetensors",
            headers=_bearer(attacked.victim.token),
        )
        assert own.status_code == 400 and "holds whole weights" in own.text


async def test_the_dashboards_routes_are_the_callers_orgs_only(attacked: AttackedNode) -> None:
    """What the dashboard adds, tried with the attacker's org token: the victim's job cannot
    be cancelled, its rollouts read or its events followed; the org stream carries the
    caller's events alone; a token without jobs:write starts nothing; the page's own files
    are the only files served without a token."""
    base = attacked.url("checkpoint-server")
    job = attacked.victim_job
    attacker, victim = _bearer(attacked.attacker.token), _bearer(attacked.victim.token)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for method, path in (
            ("POST", f"/v1/jobs/{job}/cancel"),
            ("GET", f"/v1/jobs/{job}/rollouts"),
            ("GET", f"/v1/jobs/{job}/rollouts?text=Copy"),
        ):
            theirs = await http.request(method, path, headers=attacker, json={})
            assert theirs.status_code == 404, (path, theirs.text)
        own = await http.get(f"/v1/jobs/{job}/rollouts", headers=victim)
        assert own.status_code == 200 and own.json(), "the victim reads its own samples"
        assert {e["status"] for e in own.json()} <= {"ok", "failed"}

        # The org stream from now on: a victim event while both follow reaches the victim's.
        async def follow(headers: dict[str, str], seen: list[dict]) -> None:
            async with http.stream("GET", "/v1/events", headers=headers) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        seen.append(json.loads(line.removeprefix("data: ")))

        mine: list[dict] = []
        theirs_seen: list[dict] = []
        followers = [
            asyncio.create_task(follow(attacker, mine)),
            asyncio.create_task(follow(victim, theirs_seen)),
        ]
        await asyncio.sleep(3)  # both subscribed
        async with attacked.node.jobs(attacked.victim) as jobs:
            await jobs.cancel(f"{job}-absent")  # the learner refuses it: a victim event
        for _ in range(120):
            if theirs_seen:
                break
            await asyncio.sleep(0.5)
        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        assert theirs_seen and {e["org_id"] for e in theirs_seen} == {attacked.victim.org_id}
        assert all(e["org_id"] == attacked.attacker.org_id for e in mine), mine

        # Starting needs jobs:write; a config that does not parse publishes nothing either.
        with VaultClient(attacked.url("credential-vault"), attacked.attacker.token) as vault:
            read_only = vault.create_token(unique_id("reader"), scopes=["jobs:read"])["token"]
        with_read_only = _bearer(read_only)
        refused = await http.post(
            "/v1/jobs", headers=with_read_only, json={"config": "[model]\nsource = 'x'"}
        )
        assert refused.status_code == 403, refused.text
        bad = await http.post("/v1/jobs", headers=attacker, json={"config": "[model"})
        assert bad.status_code == 422 and "cannot be read as toml" in bad.json()["detail"]

        # The node page lists the caller's Task Apps alone.
        node = (await http.get("/v1/node", headers=attacker)).json()
        assert {app["org_id"] for app in node["task_apps"]} == {attacked.attacker.org_id}

        # The page's files need no token and are the only files served that way.
        assert (await http.get("/dashboard/")).status_code == 200
        for path in ("/dashboard/..%2F..%2Fsettings.py", "/dashboard/vendor/..%2Fapp.js"):
            assert (await http.get(path)).status_code == 404, path
