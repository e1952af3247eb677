"""The node `rlnode up` runs on this machine, for a second shell: where its broker and
services answer, read from its data directory (`node.json`, which the supervisor keeps)
whenever the variables that say so are unset. A variable that is set always wins; with no
node up, the defaults stay the registry's (127.0.0.1 and the default ports)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlnode.bus.principals import ADMIN, UserStore
from rlnode.bus.settings import KafkaSettings
from rlnode.service.registry import ServiceSpec
from rlnode.service.settings import NodeSettings


def pid_alive(pid: int | None) -> bool:
    """Whether `pid` runs (an exited child its parent has not reaped yet does not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def running_node(data_dir: Path | None = None) -> dict[str, Any] | None:
    """The state of the node up under `data_dir` (RLNODE_DATA_DIR's by default), or None."""
    data_dir = data_dir or NodeSettings().data_dir
    try:
        state = json.loads((data_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and pid_alive(state.get("pid")) else None


def discovered_url(spec: ServiceSpec) -> str | None:
    state = running_node()
    service = (state or {}).get("services", {}).get(spec.name)
    return service.get("url") if isinstance(service, dict) else None


def kafka_settings() -> KafkaSettings:
    """KafkaSettings from KAFKA_*; with KAFKA_BOOTSTRAP_SERVERS unset and a node up here, its
    broker, as the node's admin where this user may read its credentials (the node is
    theirs)."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return KafkaSettings()
    state = running_node()
    if state is None or not state.get("bootstrap"):
        return KafkaSettings()
    if state.get("kafka_ca"):
        try:
            admin = UserStore.of_node(Path(state["data_dir"])).existing(ADMIN)
        except RuntimeError:  # not this user's node: KAFKA_* must say who they are
            admin = None
        if admin is not None:
            return admin.client_settings(state["bootstrap"], Path(state["kafka_ca"]))
    return KafkaSettings(bootstrap_servers=state["bootstrap"])


def admin_token() -> str | None:
    """The node's admin token, where this user may read it (the node is theirs)."""
    state = running_node()
    if state is None:
        return None
    try:
        return (Path(state["data_dir"]) / "secrets" / "vault-admin.token").read_text().strip()
    except OSError:
        return None
