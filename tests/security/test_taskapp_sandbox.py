"""A managed Task App of org A attacks the node: it looks for tokens and keys in its
environment, the node's data directory and other processes, and tries what it finds on the
vault to unseal org B's secret."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from nacl.public import PrivateKey

from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.service.sealing import public_key_b64
from rlnode.testing import readable_directory
from tests.security.conftest import AttackedNode

ATTACK = Path(__file__).with_name("attack_taskapp.py")
ALLOWED_ENV = {"PATH", "LANG", "HOME", "TMPDIR", "ENVIRONMENT_API_KEY", "PORT", "HOST"}


def shared_copy(script: Path) -> Path:
    """The script where any user may read it (a Task App runs as a user of its own)."""
    copy = readable_directory("rlnode-attack-") / script.name
    shutil.copy(script, copy)
    copy.chmod(0o644)
    return copy


def attack_report(
    gateway: GatewayClient, name: str, within_s: float = 60, marker: str = "ATTACK "
) -> dict:
    """The JSON line the attacking Task App printed after `marker`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for line in gateway.logs(name, max_bytes=1_000_000).splitlines():
            if line.startswith(marker):
                return json.loads(line.removeprefix(marker))
        time.sleep(0.5)
    raise AssertionError(f"no report in the Task App's log:\n{gateway.logs(name)}")


def test_a_managed_task_app_reaches_no_credential_of_the_node(attacked: AttackedNode) -> None:
    node = attacked.node
    env = {
        "TARGET_DATA_DIR": str(node.data_dir),
        "TARGET_VAULT_URL": node.url("credential-vault"),
        "TARGET_ORG": attacked.victim.org_id,
        "TARGET_PUBLIC_KEY": public_key_b64(PrivateKey.generate().public_key),
    }
    limits = {"memory_mb": 1024, "processes": 64, "open_files": 256}
    with GatewayClient(node.url("taskapp-gateway"), attacked.attacker.token) as gateway:
        gateway.register(
            "attack", command=[sys.executable, str(shared_copy(ATTACK))], env=env, limits=limits
        )
        assert gateway.verify("attack")["healthy"]["ok"]
        report = attack_report(gateway, "attack")
        gateway.remove("attack")
    assert report["uid"] != 0 and report["groups"] in ([], [report["uid"]]), report
    assert set(report["env_keys"]) - set(env) <= ALLOWED_ENV, report["env_keys"]
    assert report["suspicious_env"] == []
    assert report["tokens_found"] == 0
    assert report["readable_data_files"] == []
    assert report["readable_environs"] == []
    assert report["unseal_statuses"] == []
    assert report["home_mode"] == "0o700" and report["home_owner"] == report["uid"]
    assert report["limits"] == {"as": 1024 << 20, "nproc": 64, "nofile": 256}


def test_limits_over_the_node_caps_are_refused(attacked: AttackedNode) -> None:
    with GatewayClient(attacked.url("taskapp-gateway"), attacked.attacker.token) as gateway:
        try:
            gateway.register(
                "greedy", command=["python", "-c", "pass"], limits={"memory_mb": 10**7}
            )
        except GatewayError as e:
            assert e.status == 400 and "over this node's cap" in e.message
        else:
            raise AssertionError("a Task App over the node's memory cap was registered")
