"""compose.yaml agrees with the code: every service is there, runs an entry point that
exists, and is configured only with settings its settings class knows."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from rlnode.process import SERVICES
from rlnode.settings import DatabaseSettings, KafkaSettings, NodeSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _settings_class(module: str):
    import importlib

    settings = importlib.import_module(f"{module}.settings")
    return next(
        v
        for k, v in vars(settings).items()
        if k.endswith("Settings") and v.__module__ == settings.__name__
    )


def _node_wide_names() -> set[str]:
    names = {"KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL", "RLNODE_DATA_DIR"}
    names |= {f"KAFKA_{f.upper()}" for f in KafkaSettings.model_fields}
    names |= {
        f.validation_alias
        for f in (*DatabaseSettings.model_fields.values(), *NodeSettings.model_fields.values())
    }
    return names


def test_infrastructure_is_there() -> None:
    services = COMPOSE["services"]
    assert services["kafka"]["image"].startswith("apache/kafka")
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft
    assert services["postgres"]["image"].startswith("postgres")
    assert "kafka-data:/var/lib/kafka/data" in services["kafka"]["volumes"]


@pytest.mark.parametrize("spec", SERVICES, ids=[s.name for s in SERVICES])
def test_every_service_runs_its_entry_point_with_known_settings(spec) -> None:
    service = COMPOSE["services"][spec.name]
    (command,) = service["command"]
    assert SCRIPTS[command] == f"{spec.module}.__main__:main"
    fields = set(_settings_class(spec.module).model_fields)
    for name in service["environment"]:
        if name.startswith(spec.env_prefix):
            assert name.removeprefix(spec.env_prefix).lower() in fields, (
                f"{spec.name}: unknown setting {name}"
            )
        else:
            assert name in _node_wide_names(), f"{spec.name}: {name} is nobody's setting"
    assert service["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert "healthcheck" in service


def test_gpu_reservations_follow_the_default_plan() -> None:
    def devices(name: str) -> list[str]:
        (reservation,) = COMPOSE["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        return reservation["device_ids"]

    assert devices("rollout-generator") == ["0", "1", "2", "3", "4", "5"]
    assert devices("learner") == ["6", "7"]
