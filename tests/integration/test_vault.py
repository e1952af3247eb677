"""The credential-vault from the outside: a real process on loopback, a real database
(SQLite, and PostgreSQL where it answers), real HTTP, real ciphertext."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from nacl.public import PrivateKey, PublicKey, SealedBox
from nacl.signing import SigningKey

from rlnode.sdk.vault import VaultError
from rlnode.service.auth import AuthError, TokenClaims, VaultTokenVerifier, sign_token
from rlnode.service.registry import VAULT
from rlnode.service.sealing import public_key_b64
from tests.conftest import fresh_database
from tests.integration.vault_fixtures import RecordingTransport, RunningVault


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def vault(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"vault-{request.param}")
    with fresh_database(request.param, directory) as url:
        running = RunningVault(url, directory).start()
        yield running
        assert running.stop() == 0, running.process.log_tail()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _seal_to(public_key_b64_text: str, value: bytes) -> str:
    return base64.b64encode(
        SealedBox(PublicKey(base64.b64decode(public_key_b64_text))).encrypt(value)
    ).decode()


# -- the happy path ---------------------------------------------------------------------


def test_upload_list_unseal_delete(vault: RunningVault) -> None:
    org_id, token = vault.new_org()
    with vault.client(token) as org:
        stored = org.set_secret("ENVIRONMENT_API_KEY", "sk-test-123")
        assert stored["org_id"] == org_id and stored["name"] == "ENVIRONMENT_API_KEY"
        listing = org.list_secrets()
        assert [s["name"] for s in listing] == ["ENVIRONMENT_API_KEY"]
        assert set(listing[0]) == {"org_id", "name", "key_id", "created_at", "updated_at"}

    gateway_key = PrivateKey.generate()
    with vault.client(vault.service_token(["secrets:unseal"])) as gateway:
        assert (
            gateway.unseal_for(org_id, "ENVIRONMENT_API_KEY", gateway_key, job_id="job-7")
            == b"sk-test-123"
        )

    with vault.client(token) as org:
        org.set_secret("ENVIRONMENT_API_KEY", "sk-test-456")  # replace
        org.delete_secret("ENVIRONMENT_API_KEY")
        with pytest.raises(VaultError) as info:
            org.get_secret_info("ENVIRONMENT_API_KEY")
        assert info.value.status == 404
        trail = org.audit()
    actions = [(r["action"], r["secret_name"], r["job_id"]) for r in reversed(trail)]
    assert actions == [
        ("org.create", None, None),
        ("token.issue", None, None),
        ("secret.put", "ENVIRONMENT_API_KEY", None),
        ("secret.unseal", "ENVIRONMENT_API_KEY", "job-7"),
        ("secret.put", "ENVIRONMENT_API_KEY", None),
        ("secret.delete", "ENVIRONMENT_API_KEY", None),
    ]
    unseal = next(r for r in trail if r["action"] == "secret.unseal")
    assert unseal["actor"] == "service:taskapp-gateway" and unseal["org_id"] == org_id
    assert unseal["token_id"].startswith("t_") and unseal["ts"]


def test_public_key_shape(vault: RunningVault) -> None:
    org_id, token = vault.new_org()
    with vault.client(token) as org:
        key = org.public_key()
    assert key["alg"] == "libsodium.sealedbox.v1"
    assert key["org_id"] == org_id and key["key_id"].startswith("k_")
    assert len(base64.b64decode(key["public_key"])) == 32


# -- every route refuses strangers -------------------------------------------------------


def _org_routes(org_id: str, key_id: str) -> list[tuple[str, str, dict | None]]:
    ciphertext = base64.b64encode(b"x" * 60).decode()
    return [
        ("GET", f"/v1/orgs/{org_id}", None),
        ("GET", f"/v1/orgs/{org_id}/public-key", None),
        ("POST", f"/v1/orgs/{org_id}/keys/rotate", None),
        ("POST", f"/v1/orgs/{org_id}/tokens", {"name": "intruder"}),
        ("GET", f"/v1/orgs/{org_id}/tokens", None),
        ("DELETE", f"/v1/orgs/{org_id}/tokens/t_whatever", None),
        (
            "POST",
            f"/v1/orgs/{org_id}/secrets",
            {"name": "X", "key_id": key_id, "ciphertext_b64": ciphertext},
        ),
        ("GET", f"/v1/orgs/{org_id}/secrets", None),
        ("GET", f"/v1/orgs/{org_id}/secrets/ENVIRONMENT_API_KEY", None),
        ("DELETE", f"/v1/orgs/{org_id}/secrets/ENVIRONMENT_API_KEY", None),
        (
            "POST",
            f"/v1/orgs/{org_id}/secrets/ENVIRONMENT_API_KEY/unseal-for",
            {"recipient_public_key": public_key_b64(PrivateKey.generate().public_key)},
        ),
        ("GET", f"/v1/orgs/{org_id}/audit", None),
    ]


ADMIN_ROUTES = [
    ("POST", "/v1/orgs", {"org_id": "sneaky-org"}),
    ("POST", "/v1/service-tokens", {"service": "x", "scopes": ["secrets:unseal"]}),
    ("DELETE", "/v1/service-tokens/t_whatever", None),
]


def test_no_token_and_bad_tokens_get_401_everywhere(vault: RunningVault) -> None:
    org_id, token = vault.new_org()
    with vault.client(token) as org:
        key_id = org.public_key()["key_id"]
    forged_claims = TokenClaims(
        token_id="t_forged",
        kind="org",
        subject="mallory",
        org_id=org_id,
        scopes=frozenset({"org:admin", "secrets:read", "secrets:write"}),
        issued_at=int(time.time()),
        expires_at=int(time.time()) + 3600,
        key_id="x",
    )
    forged = sign_token(SigningKey.generate(), forged_claims)  # signed by another key
    prefix, payload, signature = token.split(".")
    tampered_payload = base64.urlsafe_b64decode(payload + "==").replace(b"org:admin", b"org:admiN")
    tampered = ".".join(
        [prefix, base64.urlsafe_b64encode(tampered_payload).rstrip(b"=").decode(), signature]
    )
    with httpx.Client(base_url=vault.url) as http:
        for method, path, body in [*_org_routes(org_id, key_id), *ADMIN_ROUTES]:
            for headers in (
                {},
                _bearer("garbage"),
                _bearer(forged),
                _bearer(tampered),
                {"Authorization": token},
            ):
                response = http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"


def test_another_orgs_token_gets_403_on_every_route_and_changes_nothing(
    vault: RunningVault,
) -> None:
    victim_id, victim_token = vault.new_org()
    with vault.client(victim_token) as victim:
        victim.set_secret("ENVIRONMENT_API_KEY", "victim-value")
        key_before = victim.public_key()
    _, intruder_token = vault.new_org()
    intruder_service = vault.service_token(
        ["secrets:unseal", "secrets:read"], org_id=vault.new_org()[0]
    )
    with httpx.Client(base_url=vault.url) as http:
        for method, path, body in _org_routes(victim_id, key_before["key_id"]):
            for token in (intruder_token, intruder_service):
                response = http.request(method, path, json=body, headers=_bearer(token))
                assert response.status_code == 403, (method, path, response.text)
                assert victim_id in response.json()["detail"]
        for method, path, body in ADMIN_ROUTES:
            response = http.request(method, path, json=body, headers=_bearer(intruder_token))
            assert response.status_code == 403, (method, path, response.text)
    with vault.client(victim_token) as victim:
        assert victim.public_key()["key_id"] == key_before["key_id"]
        assert [s["name"] for s in victim.list_secrets()] == ["ENVIRONMENT_API_KEY"]
        assert {r["action"] for r in victim.audit()} == {"org.create", "token.issue", "secret.put"}


def test_scopes_are_enforced(vault: RunningVault) -> None:
    org_id, token = vault.new_org()
    with vault.client(token) as org:
        reader = org.create_token("reader", scopes=["secrets:read"])["token"]
        org.set_secret("S", "v")
    with vault.client(reader) as limited:
        assert [s["name"] for s in limited.list_secrets()] == ["S"]
        for call in (
            lambda: limited.set_secret("T", "v"),
            lambda: limited.delete_secret("S"),
            limited.audit,
            limited.rotate_key,
        ):
            with pytest.raises(VaultError) as info:
                call()
            assert info.value.status == 403 and "lacks the scope" in info.value.message
    # Only service tokens unseal; org tokens and the admin cannot.
    recipient = public_key_b64(PrivateKey.generate().public_key)
    with httpx.Client(base_url=vault.url) as http:
        for who in (token, vault.admin_token, vault.service_token(["secrets:read"])):
            response = http.post(
                f"/v1/orgs/{org_id}/secrets/S/unseal-for",
                json={"recipient_public_key": recipient},
                headers=_bearer(who),
            )
            assert response.status_code == 403, response.text


def test_revoked_tokens_stop_working_here_and_in_other_services(vault: RunningVault) -> None:
    _, token = vault.new_org()
    with vault.client(token) as org:
        issued = org.create_token("ci", scopes=["secrets:read"])
    verifier = VaultTokenVerifier(vault.url, refresh_s=0)
    assert verifier.verify(issued["token"]).subject == "ci"
    with vault.client(token) as org:
        org.revoke_token(issued["token_id"])
        assert next(t for t in org.list_tokens() if t["token_id"] == issued["token_id"])[
            "revoked_at"
        ]
    with vault.client(issued["token"]) as revoked, pytest.raises(VaultError) as info:
        revoked.list_secrets()
    assert info.value.status == 401 and "revoked" in info.value.message
    with pytest.raises(AuthError, match="revoked"):
        verifier.verify(issued["token"])
    assert issued["token_id"] in httpx.get(f"{vault.url}/v1/revocations").json()["token_ids"]


# -- bad ciphertext ---------------------------------------------------------------------


def test_tampered_misaddressed_stale_and_oversized_uploads_are_refused(vault: RunningVault) -> None:
    org_id, token = vault.new_org()
    other_id, other_token = vault.new_org()
    with vault.client(token) as org, vault.client(other_token) as other:
        key = org.public_key()
        other_key = other.public_key()
    url = f"/v1/orgs/{org_id}/secrets"
    good = _seal_to(key["public_key"], b"value")
    raw = bytearray(base64.b64decode(good))
    raw[-1] ^= 0x01
    tampered = base64.b64encode(bytes(raw)).decode()
    to_other_org = _seal_to(other_key["public_key"], b"value")

    def upload(**body) -> httpx.Response:
        document = {"name": "S", "key_id": key["key_id"], "ciphertext_b64": good} | body
        return httpx.post(vault.url + url, json=document, headers=_bearer(token))

    response = upload(ciphertext_b64=tampered)
    assert response.status_code == 400 and "does not open" in response.json()["detail"]
    response = upload(ciphertext_b64=to_other_org)
    assert response.status_code == 400 and "sealed to another key" in response.json()["detail"]
    response = upload(key_id=other_key["key_id"])
    assert response.status_code == 400 and "not a key of org" in response.json()["detail"]
    response = upload(ciphertext_b64="not base64!!")
    assert response.status_code == 400 and "base64" in response.json()["detail"]
    response = upload(ciphertext_b64=_seal_to(key["public_key"], b"v" * 8193))
    assert response.status_code == 413 and "8192" in response.json()["detail"]
    assert upload(ciphertext_b64=_seal_to(key["public_key"], b"v" * 8192)).status_code == 201
    response = upload(value="sk-plain")
    assert response.status_code == 422 and "only ciphertext" in response.json()["detail"]
    assert "sk-plain" not in response.text
    big = httpx.post(
        vault.url + url,
        content=b"{" + b" " * 70_000 + b"}",
        headers={**_bearer(token), "content-type": "application/json"},
    )
    assert big.status_code == 413

    with vault.client(token) as org:
        rotated = org.rotate_key()
    response = upload(key_id=key["key_id"])
    assert response.status_code == 409
    assert rotated["key_id"] in response.json()["detail"]
    assert other_id not in response.json()["detail"]


def test_rotation_reseals_every_secret_and_destroys_the_old_private_key(
    vault: RunningVault,
) -> None:
    org_id, token = vault.new_org()
    values = {f"S{i}": f"value-{i}-{uuid.uuid4()}" for i in range(3)}
    with vault.client(token) as org:
        for name, value in values.items():
            org.set_secret(name, value)
        old = org.public_key()
        rotated = org.rotate_key()
        assert rotated["resealed"] == 3 and rotated["key_id"] != old["key_id"]
        assert {s["key_id"] for s in org.list_secrets()} == {rotated["key_id"]}
        org.set_secret("S-new", "after rotation")  # the new key works for uploads
    me = PrivateKey.generate()
    with vault.client(vault.service_token(["secrets:unseal"], org_id=org_id)) as gateway:
        for name, value in values.items():
            assert gateway.unseal_for(org_id, name, me) == value.encode()

    from sqlalchemy import create_engine, text

    from rlnode.service.db import normalise_url

    engine = create_engine(normalise_url(vault.database_url))
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT encrypted_private_key, wrapped_data_key, retired_at FROM vault_org_keys WHERE key_id = :k"
            ),
            {"k": old["key_id"]},
        ).one()
    engine.dispose()
    assert row[0] is None and row[1] is None and row[2] is not None


def test_bad_recipient_key_is_a_clear_400(vault: RunningVault) -> None:
    org_id, token = vault.new_org()
    with vault.client(token) as org:
        org.set_secret("S", "v")
    service = vault.service_token(["secrets:unseal"])
    response = httpx.post(
        f"{vault.url}/v1/orgs/{org_id}/secrets/S/unseal-for",
        json={"recipient_public_key": base64.b64encode(b"short").decode()},
        headers=_bearer(service),
    )
    assert response.status_code == 400 and "32 bytes" in response.json()["detail"]
    missing = httpx.post(
        f"{vault.url}/v1/orgs/{org_id}/secrets/NOPE/unseal-for",
        json={"recipient_public_key": public_key_b64(PrivateKey.generate().public_key)},
        headers=_bearer(service),
    )
    assert missing.status_code == 404


def test_openapi_spec_describes_every_route(vault: RunningVault) -> None:
    spec = httpx.get(f"{vault.url}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    paths = set(spec["paths"])
    for path in (
        "/v1/orgs",
        "/v1/orgs/{org_id}/public-key",
        "/v1/orgs/{org_id}/secrets",
        "/v1/orgs/{org_id}/secrets/{name}/unseal-for",
        "/v1/orgs/{org_id}/audit",
        "/v1/orgs/{org_id}/keys/rotate",
        "/v1/verify-key",
        "/v1/revocations",
        "/health",
    ):
        assert path in paths


# -- plaintext never lands anywhere ------------------------------------------------------


def _all_rows_as_bytes(database_url: str) -> bytes:
    from sqlalchemy import create_engine, inspect, text

    from rlnode.service.db import normalise_url

    engine = create_engine(normalise_url(database_url))
    chunks = []
    with engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                for value in row:
                    chunks.append(value if isinstance(value, bytes) else str(value).encode())
    engine.dispose()
    return b"\n".join(chunks)


def _forms(secret: bytes) -> list[bytes]:
    """The secret as itself and in the encodings it could hide in."""
    return [
        secret,
        base64.b64encode(secret),
        base64.urlsafe_b64encode(secret),
        secret.hex().encode(),
        secret.decode().encode("utf-16-le"),
    ]


def test_plaintext_never_stored_logged_or_returned(vault: RunningVault) -> None:
    canary = f"sk-canary-{uuid.uuid4().hex}".encode()
    org_id, token = vault.new_org()
    recorder = RecordingTransport()
    me = PrivateKey.generate()
    with vault.client(token, transport=recorder) as org:
        org.set_secret("ENVIRONMENT_API_KEY", canary)
        org.set_secret("OTHER", canary + b"-2")
        # A careless client sending plaintext gets a 422 that does not echo it.
        with pytest.raises(VaultError):
            org._request(
                "POST",
                f"/v1/orgs/{org_id}/secrets",
                json={"name": "P", "key_id": "k", "value": canary.decode()},
            )
        with pytest.raises(VaultError):
            org._request(
                "POST",
                f"/v1/orgs/{org_id}/secrets",
                json={"name": canary.decode(), "key_id": 1, "ciphertext_b64": 2},
            )
        org.list_secrets()
        org.get_secret_info("ENVIRONMENT_API_KEY")
    service_recorder = RecordingTransport()
    with vault.client(
        vault.service_token(["secrets:unseal"]), transport=service_recorder
    ) as gateway:
        assert gateway.unseal_for(org_id, "ENVIRONMENT_API_KEY", me, job_id="scan-job") == canary
    with vault.client(token, transport=recorder) as org:
        org.rotate_key()
        org.audit()
        org.list_secrets()
    with vault.client(
        vault.service_token(["secrets:unseal"]), transport=service_recorder
    ) as gateway:
        assert gateway.unseal_for(org_id, "ENVIRONMENT_API_KEY", me, job_id="scan-job") == canary

    everything_sent_back = b"\n".join(body for *_, body in recorder.responses)
    everything_sent_back += b"\n".join(
        body for _, path, _, body in service_recorder.responses if not path.endswith("/unseal-for")
    )
    unseal_bodies = [
        body for _, path, _, body in service_recorder.responses if path.endswith("/unseal-for")
    ]
    assert len(unseal_bodies) == 2
    rows = _all_rows_as_bytes(vault.database_url)
    log = vault.log_path.read_bytes()
    database_files = b""
    if vault.database_url.startswith("sqlite:///"):
        path = vault.database_url.removeprefix("sqlite:///")
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                database_files += open(path + suffix, "rb").read()
        assert database_files, "the SQLite file should exist"
    for form in _forms(canary):
        assert form not in rows, "plaintext in a database row"
        assert form not in database_files, "plaintext in the database file"
        assert form not in log, "plaintext in the service log"
        assert form not in everything_sent_back, "plaintext in an HTTP response"
        for body in unseal_bodies:
            assert form not in body, "the re-sealed response must not carry plaintext either"
    assert b"scan-job" in rows  # the audit did record the unseal, without the value


# -- start-up and restarts -------------------------------------------------------------


def test_restart_with_the_same_master_key_keeps_everything(tmp_path) -> None:
    with fresh_database("sqlite", tmp_path) as url:
        first = RunningVault(url, tmp_path).start()
        try:
            org_id, token = first.new_org()
            with first.client(token) as org:
                org.set_secret("ENVIRONMENT_API_KEY", "survives-restarts")
            service = first.service_token(["secrets:unseal"])
        finally:
            assert first.stop() == 0
        second = RunningVault(
            url, tmp_path, master_key=first.master_key, admin_token=first.admin_token
        ).start()
        try:
            with second.client(service) as gateway:  # tokens survive: the signing key is kept
                assert (
                    gateway.unseal_for(org_id, "ENVIRONMENT_API_KEY", PrivateKey.generate())
                    == b"survives-restarts"
                )
            with second.client(token) as org:
                rotated = org.rotate_key()
            with second.client(service) as gateway:
                assert (
                    gateway.unseal_for(org_id, "ENVIRONMENT_API_KEY", PrivateKey.generate())
                    == b"survives-restarts"
                )
            assert rotated["resealed"] == 1
        finally:
            assert second.stop() == 0


def _start_fails(vault: RunningVault, **env: str | None) -> str:
    full = {**os.environ, **vault.env(), "VAULT_PORT": str(vault.port)}
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    result = subprocess.run(
        [sys.executable, "-m", VAULT.package],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def test_wrong_missing_or_exposed_master_key_stops_start_up(tmp_path) -> None:
    from rlnode_services.credential_vault.crypto import new_master_key

    with fresh_database("sqlite", tmp_path) as url:
        vault = RunningVault(url, tmp_path).start()
        assert vault.stop() == 0
        assert "does not open this vault's keys" in _start_fails(
            vault, VAULT_MASTER_KEY=new_master_key()
        )
        assert "no master key" in _start_fails(vault, VAULT_MASTER_KEY=None)
        assert "not valid base64" in _start_fails(vault, VAULT_MASTER_KEY="%%%")
        assert "32 bytes" in _start_fails(
            vault, VAULT_MASTER_KEY=base64.b64encode(b"short").decode()
        )
        key_file = tmp_path / "master.key"
        key_file.write_text(vault.master_key)
        key_file.chmod(0o644)
        assert "chmod 600" in _start_fails(
            vault, VAULT_MASTER_KEY=None, VAULT_MASTER_KEY_FILE=str(key_file)
        )
        key_file.chmod(0o600)
        assert "not both" in _start_fails(vault, VAULT_MASTER_KEY_FILE=str(key_file))
        restarted = RunningVault(url, tmp_path, master_key=vault.master_key)
        restarted.master_key = vault.master_key
        restarted.start()
        assert restarted.stop() == 0
