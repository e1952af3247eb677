"""`rlnode org|token|secrets` against a real vault process, as a user types them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from nacl.public import PrivateKey

from rlnode.bus.localbroker import free_port
from tests.conftest import fresh_database
from tests.integration.vault_fixtures import RunningVault

RLNODE = [sys.executable, "-m", "rlnode.cli"]


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vault-cli")
    with fresh_database("sqlite", directory) as url:
        running = RunningVault(url, directory).start()
        yield running
        running.stop()


def _run(
    vault: RunningVault, *args: str, stdin: str | None = None, **env: str
) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RLNODE_")}
    return subprocess.run(
        [*RLNODE, *args],
        input=stdin,
        env={**base, "RLNODE_VAULT_URL": vault.url, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_org_token_and_secrets_commands(vault: RunningVault) -> None:
    created = _run(
        vault, "org", "create", "cli-org", "--name", "CLI Org", RLNODE_ADMIN_TOKEN=vault.admin_token
    )
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("rln1.") and "created org cli-org" in created.stderr

    stdin_set = _run(
        vault, "secrets", "set", "ENVIRONMENT_API_KEY", stdin="sk-from-stdin\n", RLNODE_TOKEN=token
    )
    assert stdin_set.returncode == 0, stdin_set.stderr
    assert "stored ENVIRONMENT_API_KEY for org cli-org" in stdin_set.stdout
    env_set = _run(
        vault,
        "secrets",
        "set",
        "OTHER_KEY",
        "--from-env",
        "MY_KEY",
        RLNODE_TOKEN=token,
        MY_KEY="sk-from-env",
    )
    assert env_set.returncode == 0, env_set.stderr
    for result in (created, stdin_set, env_set):
        assert "sk-from" not in result.stdout + result.stderr

    listed = _run(vault, "secrets", "list", RLNODE_TOKEN=token)
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [
        "ENVIRONMENT_API_KEY",
        "OTHER_KEY",
    ]
    assert "sk-from" not in listed.stdout

    # What was stored is what was typed (without the newline echo added).
    service = _run(
        vault,
        "token",
        "create",
        "taskapp-gateway",
        "--service",
        "--scope",
        "secrets:unseal",
        RLNODE_ADMIN_TOKEN=vault.admin_token,
    )
    assert service.returncode == 0, service.stderr
    with vault.client(service.stdout.strip()) as gateway:
        assert (
            gateway.unseal_for("cli-org", "ENVIRONMENT_API_KEY", PrivateKey.generate())
            == b"sk-from-stdin"
        )
        assert gateway.unseal_for("cli-org", "OTHER_KEY", PrivateKey.generate()) == b"sk-from-env"

    rotated = _run(vault, "org", "rotate-key", RLNODE_TOKEN=token)
    assert rotated.returncode == 0 and "re-sealed 2 secret(s)" in rotated.stdout

    reader = _run(
        vault, "token", "create", "dashboard", "--scope", "secrets:read", RLNODE_TOKEN=token
    )
    assert reader.returncode == 0 and "(secrets:read)" in reader.stderr
    refused = _run(vault, "secrets", "rm", "OTHER_KEY", RLNODE_TOKEN=reader.stdout.strip())
    assert (
        refused.returncode == 1 and "lacks the scope(s) secrets:write (HTTP 403)" in refused.stderr
    )

    removed = _run(vault, "secrets", "rm", "OTHER_KEY", RLNODE_TOKEN=token)
    assert removed.returncode == 0 and "deleted OTHER_KEY" in removed.stdout
    assert "OTHER_KEY" not in _run(vault, "secrets", "list", RLNODE_TOKEN=token).stdout


def test_cli_failures_say_what_to_do(vault: RunningVault) -> None:
    no_token = _run(vault, "secrets", "list")
    assert no_token.returncode == 1 and "RLNODE_TOKEN is not set" in no_token.stderr
    no_admin = _run(vault, "org", "create", "x")
    assert no_admin.returncode == 1 and "RLNODE_ADMIN_TOKEN is not set" in no_admin.stderr
    empty = _run(vault, "secrets", "set", "K", stdin="", RLNODE_TOKEN="rln1.e30.x")
    assert empty.returncode == 1 and "empty value" in empty.stderr
    missing_env = _run(
        vault, "secrets", "set", "K", "--from-env", "NOPE_NOT_SET", RLNODE_TOKEN="rln1.e30.x"
    )
    assert missing_env.returncode == 1 and "NOPE_NOT_SET is not set" in missing_env.stderr
    orgless = _run(vault, "secrets", "list", RLNODE_TOKEN="rln1.e30.x")
    assert orgless.returncode == 1 and "this token names no org" in orgless.stderr
    down = _run(
        vault,
        "secrets",
        "list",
        "--org",
        "acme",
        RLNODE_TOKEN="rln1.e30.x",
        RLNODE_VAULT_URL=f"http://127.0.0.1:{free_port()}",
    )
    assert down.returncode == 1 and "cannot reach the vault" in down.stderr
    duplicate = _run(vault, "org", "create", "dup-org", RLNODE_ADMIN_TOKEN=vault.admin_token)
    again = _run(vault, "org", "create", "dup-org", RLNODE_ADMIN_TOKEN=vault.admin_token)
    assert (
        duplicate.returncode == 0
        and again.returncode == 1
        and "exists already (HTTP 409)" in again.stderr
    )


def test_master_key_command_prints_a_usable_key(vault: RunningVault) -> None:
    import base64

    result = _run(vault, "vault", "master-key")
    assert result.returncode == 0
    assert len(base64.b64decode(result.stdout.strip())) == 32
