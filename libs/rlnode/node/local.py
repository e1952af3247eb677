"""A whole node on one machine: the broker (its own Apache Kafka unless one is given), the
topics, a Kafka user and ACLs per service, and every service as a child process wired to the
others with its own service token and Kafka user.

Used by the benchmarks and the end-to-end tools; `rlnode up` builds its supervision on it.
What a *user* does on top (an org, a sealed key, a Task App, a job) goes through the public
clients, as it would against any node."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlnode.bus import ensure_topics
from rlnode.bus.acls import grant, service_acls
from rlnode.bus.localbroker import LocalBroker, free_port
from rlnode.bus.principals import ADMIN, KafkaUser
from rlnode.bus.settings import KafkaSettings
from rlnode.examples import task_app_path
from rlnode.messages import JobConfig, JobEvent, topics
from rlnode.node.kafka_access import (
    broker_identity,
    ca_certificate,
    credentials_from_join,
    join_payload,
    users,
)
from rlnode.node.plan import (
    GpuPlan,
    engine_settings,
    learner_settings,
    make_plan,
    serving_settings,
)
from rlnode.node.processes import ServiceProcess, TerminationUnwinds, ensure_local_credentials
from rlnode.node.roles import JOINING_SERVICES, JoinInfo, RoleError, join_path
from rlnode.sdk.gateway import GatewayClient
from rlnode.sdk.jobs import JobsClient
from rlnode.sdk.vault import VaultClient
from rlnode.service.files import private_dir, private_file
from rlnode.service.registry import (
    CHECKPOINT_SERVER,
    GATEWAY,
    GENERATOR,
    LEARNER,
    SERVICES,
    TINKER_API,
    VAULT,
    ServiceSpec,
    port_offset,
)
from rlnode.training.network import RENDEZVOUS_PORT

log = logging.getLogger("rlnode.node.local")

LOOPBACK = "127.0.0.1"
# The services with a Kafka user of their own (and ACLs: rlnode.bus.acls).
ON_THE_BUS = tuple(sorted(topics.READERS))
# The order a node's services stop in: those that call the others first (a generator its
# gateways and the learner's weights, the tinker-api the generators), the vault that every
# service checks tokens with last. A service not named stops with the first tier.
STOP_TIERS = (
    (TINKER_API.name, GENERATOR.name, CHECKPOINT_SERVER.name),
    (LEARNER.name,),
    (GATEWAY.name,),
    (VAULT.name,),
)


@dataclass
class NodeOptions:
    data_dir: Path
    kafka_bootstrap: str | None = None  # None: start the embedded broker
    generators: int = 1
    # Gateways: the first runs the managed Task Apps; every one runs rollouts, and each
    # generator spreads its work items over all of them.
    gateways: int = 1  # at most MAX_GATEWAYS (rlnode.service.registry)
    # Extra environment per service name ("learner", "rollout-generator", ...).
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    # How soon a group hands a dead member's partitions to the others; 6 s is Kafka's
    # least (group.min.session.timeout.ms).
    session_timeout_ms: int = 6000
    services: tuple[str, ...] = tuple(spec.name for spec in SERVICES)
    # Fixed ports from here (each service at its offset in the registry: vault +0, gateway
    # +10, generators +20.., learner +30, checkpoint-server +40), so the CLI's defaults reach
    # a node `rlnode up` started; None: free ports (tests, benchmarks).
    port_base: int | None = None
    # The GPU plan; None: everything on the CPU.
    plan: GpuPlan | None = None
    # The address the services (and the embedded broker) listen on and others reach them at:
    # loopback for a node on one machine, the host's own address when it spans several.
    host: str = "127.0.0.1"
    # The control host's join file (rlnode.node.roles), for a host that runs no vault: its
    # services reach the control host's broker, vault and gateways with the tokens in it.
    join: JoinInfo | None = None
    # Hosts that lend the learner training ranks (`rlnode trainer-ranks` on each), as each
    # names itself; the learner's rendezvous listens on `host`:`rendezvous_port` for them.
    rank_hosts: tuple[str, ...] = ()
    rendezvous_port: int = RENDEZVOUS_PORT

    @property
    def rendezvous(self) -> str:
        """Where rank hosts join the learner ("" without rank hosts)."""
        return f"{self.host}:{self.rendezvous_port}" if self.rank_hosts else ""


class PortInUse(RuntimeError):
    pass


def plan_env(plan: GpuPlan | None) -> tuple[list[dict[str, str]], dict[str, str], dict[str, str]]:
    """Environment from the GPU plan: one dict per rollout-generator (engine), the learner's,
    the checkpoint-server's. CUDA_VISIBLE_DEVICES confines each process to its GPUs."""
    if plan is None or plan.cpu_only:
        return [{}], {}, {}

    def visible(gpus: list[int]) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}

    generators = [visible(gpus) | engine_settings(plan, gpus) for gpus in plan.engines]
    learner = visible(plan.learner_gpus) | learner_settings(plan)
    serving = visible(plan.training[-1:]) | serving_settings(plan)
    return generators, learner, serving


@dataclass
class Org:
    org_id: str
    token: str


def state_path(data_dir: Path) -> Path:
    """node.json under a node's data dir: what `rlnode status` and the dashboard's node page
    read, kept by `LocalNode`."""
    return data_dir / "node.json"


def node_broker(data_dir: Path, host: str = LOOPBACK, port: int | None = None) -> LocalBroker:
    """The node's Apache Kafka (not started): on `host` (its controller on loopback), its
    log under <data dir>/broker, its certificate and the admin's credentials with the node's
    other secrets (rlnode.node.kafka_access)."""
    return LocalBroker(
        data_dir / "broker",
        broker_identity(data_dir, tuple(dict.fromkeys((host, LOOPBACK)))),
        users(data_dir).user(ADMIN),
        host=host,
        port=port,
        log_path=data_dir / "logs" / "broker.log",
    )


def admin_settings(data_dir: Path, bootstrap: str, **fields) -> KafkaSettings:
    """How the node's own tools reach its broker: as its admin, over TLS."""
    admin = users(data_dir).user(ADMIN)
    return admin.client_settings(bootstrap, ca_certificate(data_dir), **fields)


class LocalNode:
    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.data_dir = options.data_dir
        self.broker: LocalBroker | None = None
        self.bootstrap = options.kafka_bootstrap or ""
        # The Kafka users of the services this host runs, and the CA their clients check the
        # brokers with (none on a broker of the user's own without SASL).
        self.kafka_users: dict[str, KafkaUser] = {}
        self.kafka_ca: Path | None = None
        # How the node itself (topics, users, ACLs, its tools) talks to Kafka: as the admin.
        self.operator: KafkaSettings | None = None
        self.processes: dict[str, ServiceProcess] = {}
        self.admin_token = ""
        self.restarts: dict[str, int] = {}
        self._due: dict[str, float] = {}  # key -> when a dead service is started again
        self._up_since: dict[str, float] = {}
        self._streak: dict[str, int] = {}  # restarts without a minute up in between
        self._holds_signals = False  # TerminationUnwinds, from start() to stop()
        self.start_seconds: float | None = None  # from start() to every service healthy

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> LocalNode:
        private_dir(self.data_dir)
        if not self._holds_signals:
            TerminationUnwinds.hold()
            self._holds_signals = True
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _start(self) -> None:
        wanted = self.options.services
        join = self.options.join
        if join is None and VAULT.name not in wanted:
            raise RoleError(
                "a host without the control role needs the control host's join file (--join)"
            )
        if join is not None:
            self.bootstrap = join.bootstrap
            if join.kafka:
                self.kafka_users = credentials_from_join(self.data_dir, join.kafka)
                self.kafka_ca = ca_certificate(self.data_dir)
        elif not self.bootstrap:
            self._start_embedded_broker()
        else:
            self._use_own_cluster()
        if VAULT.name in wanted:  # topics, users and ACLs are the control host's to make
            asyncio.run(self._prepare_bus())
        if join is None:
            credentials = ensure_local_credentials(self.data_dir)
            self.admin_token = credentials.admin_token
            vault_url = {"VAULT_URL": self._service(VAULT, {}, credentials.vault_env()).url}
        else:
            vault_url = {"VAULT_URL": join.vault_url}
        gateway_urls: list[str] = list(join.gateway_urls) if join else []
        if GATEWAY.name in wanted:
            # The embedded node's Task Apps run on this machine: loopback URLs are allowed.
            gateway = vault_url | self._token_env(GATEWAY) | {"ALLOW_URLS_TO": '["loopback"]'}
            gateway_urls.append(self._service(GATEWAY, gateway).url)
            for index in range(1, self.options.gateways):
                extra = gateway | {"RUNS_MANAGED": "false"}
                name = f"gw{index}"
                gateway_urls.append(self._service(GATEWAY, extra, instance=name, index=index).url)
        # Users, the learner and the CLI talk to the first; generators spread over all.
        gateway_url = {"GATEWAY_URL": gateway_urls[0] if gateway_urls else ""}
        generator_gateways = {"GATEWAY_URL": ",".join(gateway_urls)} if gateway_urls else {}
        generator_env, learner_env, serving_env = plan_env(self.options.plan)
        if self.options.plan is None or self.options.plan.cpu_only:
            generator_env = generator_env * self.options.generators
        learner_url = join.learner_url if join else ""
        if LEARNER.name in wanted:
            learner = vault_url | gateway_url | self._token_env(LEARNER) | self._model_dirs()
            if self.options.rank_hosts:
                learner |= {
                    "RANK_HOSTS": ",".join(self.options.rank_hosts),
                    "RENDEZVOUS": self.options.rendezvous,
                }
            learner_url = self._service(LEARNER, learner, learner_env).url
        if CHECKPOINT_SERVER.name in wanted:
            serving = vault_url | gateway_url | self._token_env(CHECKPOINT_SERVER)
            self._service(CHECKPOINT_SERVER, serving, serving_env)
        generator_urls: list[str] = []
        if GENERATOR.name in wanted:
            token = self._token_env(GENERATOR)
            # Weight versions this host cannot see in shared memory come from the learner.
            weights = {"WEIGHTS_URL": learner_url} if learner_url else {}
            for index, env in enumerate(generator_env):
                name = f"gen{index}"
                # Named by host too where several hosts run generators: gen0@10.0.0.2.
                ident = name if self.options.host == "127.0.0.1" else f"{name}@{self.options.host}"
                own = vault_url | generator_gateways | token | weights | {"GENERATOR_ID": ident}
                generator_urls.append(
                    self._service(GENERATOR, own, env, instance=name, index=index).url
                )
        if TINKER_API.name in wanted:
            # Sampling sessions are served by this host's generators.
            tinker = vault_url | self._token_env(TINKER_API)
            self._service(TINKER_API, tinker | {"GENERATOR_URLS": ",".join(generator_urls)})
        for process in self.processes.values():
            process.wait_healthy()
        if join is None and self.options.host != "127.0.0.1":  # loopback: none could join
            self.write_join_info(gateway_urls, learner_url)
        self.write_state()

    def write_join_info(self, gateway_urls: list[str], learner_url: str) -> Path:
        """join.json for the hosts that join this one (see rlnode.node.roles)."""
        tokens = {}
        for spec in (s for s in SERVICES if s.name in JOINING_SERVICES):
            tokens[spec.name] = self.service_token(list(spec.token_scopes), spec.name)
        serving = self.processes.get(CHECKPOINT_SERVER.name)
        # Its users where the node makes them (its broker, or a cluster it has the admin of).
        joining = {}
        if self.kafka_users and self.kafka_ca is not None:
            joining = join_payload(self.data_dir, JOINING_SERVICES, self.kafka_ca.read_bytes())
        info = JoinInfo(
            bootstrap=self.bootstrap,
            kafka=joining,
            vault_url=self.url(VAULT.name),
            gateway_urls=gateway_urls,
            service_tokens=tokens,
            learner_url=learner_url,
            checkpoint_server_url=serving.url if serving else "",
            rendezvous=self.options.rendezvous if LEARNER.name in self.processes else "",
        )
        return info.write(join_path(self.data_dir))

    def _start_embedded_broker(self) -> None:
        """Apache Kafka on this host's address (its controller on loopback), its log and
        credentials under the data dir; a user per service on the bus."""
        self.broker = node_broker(self.data_dir, self.options.host).start()
        self.bootstrap = self.broker.bootstrap_servers
        self.kafka_ca = ca_certificate(self.data_dir)
        self.kafka_users = {user.name: user for user in users(self.data_dir).users(ON_THE_BUS)}
        assert self.broker.admin is not None  # the node's broker is a secured one
        self.operator = self.broker.admin.client_settings(self.bootstrap, self.kafka_ca)

    def _use_own_cluster(self) -> None:
        """A cluster of the user's own (KAFKA_BOOTSTRAP_SERVERS): the node talks to it as
        KAFKA_* say; where that is a SASL user (its admin), each service gets a user of its
        own, made and granted through it, checking the brokers with KAFKA_SSL_CAFILE."""
        self.operator = KafkaSettings(bootstrap_servers=self.bootstrap)
        if self.operator.security_protocol == "SASL_SSL" and self.operator.ssl_cafile:
            store = users(self.data_dir)
            self.kafka_users = {user.name: user for user in store.users(ON_THE_BUS)}
            self.kafka_ca = self.operator.ssl_cafile

    async def _prepare_bus(self) -> None:
        """The topics, and each service's Kafka user and ACLs where the node has an admin
        (its own broker; a cluster of the user's own whose admin it was given)."""
        operator = self.kafka_settings()
        await ensure_topics(operator)
        if self.kafka_users and operator.sasl_username:
            await grant(operator, self.kafka_users.values(), service_acls())

    def kafka_env(self, service: str) -> dict[str, str]:
        """The KAFKA_* settings of `service`'s clients: its own Kafka user."""
        user = self.kafka_users.get(service)
        if user is None or self.kafka_ca is None:
            return {}
        return user.client_env(self.bootstrap, self.kafka_ca)

    @property
    def state_path(self) -> Path:
        return state_path(self.data_dir)

    def write_state(self) -> None:
        tmp = private_file(self.state_path.with_suffix(".tmp"))  # pids, URLs, log paths
        tmp.write_text(json.dumps(self.state(), indent=2))
        tmp.replace(self.state_path)

    @staticmethod
    def _model_dirs() -> dict[str, str]:
        """The embedded node loads local models from the temporary directory (where
        `rlnode model init` puts them in the README) unless the operator says otherwise."""
        if "LEARNER_MODEL_DIRS" in os.environ:
            return {}
        return {"MODEL_DIRS": json.dumps([tempfile.gettempdir()])}

    def _token_env(self, spec: ServiceSpec) -> dict[str, str]:
        """SERVICE_TOKEN: a node-wide token with the scopes the registry gives the service
        (from the join file on a host that joined another)."""
        if self.options.join is not None:
            return {"SERVICE_TOKEN": self.options.join.token_for(spec.name)}
        return {"SERVICE_TOKEN": self.service_token(list(spec.token_scopes), spec.name)}

    def _port(self, spec: ServiceSpec, index: int) -> int:
        if self.options.port_base is None:
            return free_port(self.options.host)
        port = self.options.port_base + port_offset(spec) + index
        with socket.socket() as probe:
            try:
                probe.bind((self.options.host, port))
            except OSError:
                raise PortInUse(
                    f"port {port} ({spec.name}) is in use: is a node up already (rlnode status)? "
                    "Stop it with rlnode down, or pick other ports with --port-base"
                ) from None
        return port

    def _service(
        self,
        spec: ServiceSpec,
        own: dict[str, str],
        env: dict[str, str] | None = None,
        instance: str | None = None,
        index: int = 0,
    ) -> ServiceProcess:
        """Start a service with its own settings `own` (names without its prefix) and the
        process environment `env`."""
        key = f"{spec.name}/{instance}" if instance else spec.name
        process = ServiceProcess(
            spec,
            self._port(spec, index),
            self.data_dir / "logs" / f"{key.replace('/', '-')}.log",
            host=self.options.host,
            env={
                "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
                "KAFKA_SESSION_TIMEOUT_MS": str(self.options.session_timeout_ms),
                "KAFKA_HEARTBEAT_INTERVAL_MS": str(self.options.session_timeout_ms // 3),
                "RLNODE_DATA_DIR": str(self.data_dir),
                **self.kafka_env(spec.name),
                **{f"{spec.env_prefix}{name}": value for name, value in own.items()},
                **(env or {}),
                **self.options.env.get(spec.name, {}),
            },
        ).start()
        self.processes[key] = process
        if spec is VAULT:
            process.wait_healthy()  # the others need tokens from it
        return process

    # -- supervision ----------------------------------------------------------------------

    def supervise(self, now: float | None = None) -> list[str]:
        """One round of supervision: a service that died is started again after a backoff
        (0.5 s doubling to 30 s; the streak resets after a minute up). Returns what
        happened, as log lines."""
        now = time.monotonic() if now is None else now
        said = self._supervise_broker()
        for key, process in self.processes.items():
            code = process.proc.poll() if process.proc else None
            if code is None:
                if now - self._up_since.setdefault(key, now) > 60:
                    self._streak[key] = 0
                continue
            if key not in self._due:
                delay = min(30.0, 0.5 * 2 ** self._streak.get(key, 0))
                self._due[key] = now + delay
                self._up_since.pop(key, None)
                said.append(
                    f"{key} exited with code {code}; starting it again in {delay:.1f}s "
                    f"(log {process.log_path})"
                )
            elif now >= self._due[key]:
                del self._due[key]
                self._streak[key] = self._streak.get(key, 0) + 1
                self.restarts[key] = self.restarts.get(key, 0) + 1
                process.start()
                assert process.proc is not None, "start() sets proc (or raises)"
                said.append(
                    f"{key} started again (pid {process.proc.pid}, restart {self.restarts[key]})"
                )
        if said:
            self.write_state()
        return said

    def _supervise_broker(self) -> list[str]:
        """A dead broker is started again on the same ports and log: it has everything it
        held, and the services' clients reconnect to it."""
        broker = self.broker
        if broker is None or broker.running:
            return []
        said = [f"the broker exited with code {broker.exit_code}; starting it again"]
        try:
            broker.start()
        except Exception as e:  # tried again next round
            broker.stop()
            return [*said, f"the broker could not be started again: {e}"]
        self.restarts["broker"] = self.restarts.get("broker", 0) + 1
        return [*said, f"broker started again (pid {broker.pid})"]

    def state(self) -> dict:
        """What `rlnode status` shows: each service's URL, pid, restarts and log."""
        return {
            "pid": os.getpid(),
            "data_dir": str(self.data_dir),
            "bootstrap": self.bootstrap,
            "broker_pid": self.broker.pid if self.broker else None,
            "broker_listens": self.broker.bootstrap_servers if self.broker else None,
            "broker_controller": (
                f"{self.broker.controller_host}:{self.broker.controller_port}"
                if self.broker
                else None
            ),
            "broker_restarts": self.restarts.get("broker", 0),
            # Where the node's own tools find the admin's credentials (rlnode.sdk.local_node):
            # its broker's, or a cluster's it makes the users of (its admin is the node's
            # when `rlnode kafka-cluster` planned it).
            "kafka_ca": str(self.kafka_ca) if self.kafka_ca else None,
            "plan": [
                {"role": role, "gpus": gpus, "runs": runs}
                for role, gpus, runs in (self.options.plan or make_plan(0)).rows()
            ],
            "services": {
                key: {
                    "url": p.url,
                    "health": p.health_url,
                    "pid": p.proc.pid if p.proc else None,
                    "running": bool(p.proc and p.proc.poll() is None),
                    "restarts": self.restarts.get(key, 0),
                    "log": str(p.log_path),
                }
                for key, p in self.processes.items()
            },
        }

    def stop(self) -> dict[str, int]:
        """Stop the services, then the broker; exit codes. The services stop in tiers,
        consumers of the others first (STOP_TIERS), the services of a tier at once: one after
        another a node took 14 s to stop on a loaded machine."""
        codes = {}
        tiers: list[list[str]] = [[] for _ in STOP_TIERS]
        for key, process in self.processes.items():
            tier = next((i for i, names in enumerate(STOP_TIERS) if process.spec.name in names), 0)
            tiers[tier].append(key)
        for keys in tiers:
            for key in keys:
                self.processes[key].terminate()
            for key in keys:
                codes[key] = self.processes[key].stop()
        self.processes.clear()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        self.state_path.unlink(missing_ok=True)
        if self._holds_signals:
            TerminationUnwinds.release()
            self._holds_signals = False
        return codes

    def __enter__(self) -> LocalNode:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()

    # -- wiring ---------------------------------------------------------------------------

    def kafka_settings(self, user: str = ADMIN) -> KafkaSettings:
        """Settings for a Kafka client of this node's: as the admin (the node's own tools),
        or as one of its services' users."""
        timing = {
            "session_timeout_ms": self.options.session_timeout_ms,
            "heartbeat_interval_ms": self.options.session_timeout_ms // 3,
        }
        if user == ADMIN and self.operator is not None:
            return self.operator.model_copy(update=timing)
        known = self.kafka_users.get(user)
        if known is not None and self.kafka_ca is not None:
            return known.client_settings(self.bootstrap, self.kafka_ca, **timing)
        if user != ADMIN:
            raise KeyError(f"this node has no Kafka user {user!r}")
        return KafkaSettings.model_validate({"bootstrap_servers": self.bootstrap, **timing})

    def url(self, key: str) -> str:
        return self.processes[key].url

    def admin(self) -> VaultClient:
        return VaultClient(self.url(VAULT.name), self.admin_token)

    def jobs(self, org: Org, service: str = "sdk") -> JobsClient:
        """A jobs client of `org` wired to this node's broker and vault."""
        return JobsClient(
            org.org_id, org.token, self.kafka_settings(), service, self.url(VAULT.name)
        )

    def run_job(
        self, org: Org, config: JobConfig, idle_timeout_s: float = 120.0
    ) -> tuple[str, list[JobEvent]]:
        """Run a job as `org` to its end: its id and events (JobError unless it completed)."""

        async def run() -> tuple[str, list[JobEvent]]:
            async with self.jobs(org) as jobs:
                return await jobs.run(config, idle_timeout_s=idle_timeout_s)

        return asyncio.run(run())

    def job_events(self, org: Org, job_id: str, client: str = "sdk") -> list[JobEvent]:
        """The job's events so far, read as `org` through this node's broker."""

        async def history() -> list[JobEvent]:
            async with self.jobs(org, client) as jobs:
                return await jobs.history(job_id)

        return asyncio.run(history())

    def service_token(self, scopes: list[str], service: str) -> str:
        with self.admin() as admin:
            return admin.create_service_token(service, scopes, None)["token"]

    # -- what a user does ---------------------------------------------------------------

    def create_org(self, org_id: str, secrets: dict[str, str] | None = None) -> Org:
        """An org with its admin token, and secrets sealed (on this side) and uploaded."""
        with self.admin() as admin:
            token = admin.create_org(org_id)["token"]["token"]
        with VaultClient(self.url(VAULT.name), token) as org:
            for name, value in (secrets or {}).items():
                org.set_secret(name, value)
        return Org(org_id, token)

    def register_example_task_app(self, org: Org, name: str, example: str) -> dict:
        """Register one of rlnode's example Task Apps as a managed Task App and verify it."""
        path = task_app_path(example)
        with GatewayClient(self.url(GATEWAY.name), org.token) as gateway:
            gateway.register(name, command=[sys.executable, str(path)])
            return gateway.verify(name)
