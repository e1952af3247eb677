"""The node's own Apache Kafka broker: a combined KRaft broker and controller (`kafka.Kafka`)
as a supervised child process, its log under a data directory (durable: a broker started
again on the same directory has every topic, record, offset, user and ACL).

Its jars come from Maven Central through `make setup` (deploy/kafka/pom.xml, into
<venv>/kafka/libs); Java 17 or later runs them. Clients reach it over one listener, SASL_SSL
with SCRAM-SHA-512 (rlnode.bus.principals); the controller listener takes only the brokers'
own certificate (mTLS). Authorization is Kafka's StandardAuthorizer, deny-by-default: what a
user may do is the ACLs rlnode.bus.acls grants. Several brokers with one cluster id and one
voter list are a cluster (`Voter`s: tests/multihost, compose)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rlnode.bus.children import ChildProcess, free_port
from rlnode.bus.pki import Identity
from rlnode.bus.principals import BROKER_CERT_NAME, MECHANISM, KafkaUser
from rlnode.bus.settings import DEFAULT_MAX_MESSAGE_BYTES
from rlnode.service.files import write_private

KAFKA_LIBS_ENV = "RLNODE_KAFKA_LIBS"
JAVA_ENV = "RLNODE_JAVA"
# Kafka's own variable for the JVM's heap, honoured as kafka-server-start.sh does.
HEAP_ENV = "KAFKA_HEAP_OPTS"
DEFAULT_HEAP = "-Xms128m -Xmx768m"
# What kafka-run-class.sh gives a broker's JVM, less what only a long-lived production broker
# needs (GC logs, JMX); Kafka's own variable replaces them, as in that script. The tests
# give their short-lived brokers C1 alone (-XX:TieredStopAtLevel=1): about half the CPU a
# start costs (4-5 s against 8-9 s), at a throughput no test needs.
PERFORMANCE_ENV = "KAFKA_JVM_PERFORMANCE_OPTS"
JVM_OPTIONS = (
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
STARTED = "Kafka Server started"
LOG4J2 = """\
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
# Every configuration dump at start-up: thousands of lines a start, said again in the files.
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class BrokerBinaryMissing(RuntimeError):
    pass


class BrokerStartError(RuntimeError):
    pass


def find_kafka_libs() -> Path:
    """The directory of Kafka's jars: RLNODE_KAFKA_LIBS, else the venv's (make setup)."""
    explicit = os.environ.get(KAFKA_LIBS_ENV)
    directory = Path(explicit) if explicit else Path(sys.prefix) / "kafka" / "libs"
    if not any(directory.glob("kafka_2.13-*.jar")):
        where = f"{KAFKA_LIBS_ENV}={explicit}" if explicit else str(directory)
        raise BrokerBinaryMissing(
            f"no Apache Kafka jars in {where}: run `make setup` (it copies them from Maven "
            f"Central with deploy/kafka/pom.xml), set {KAFKA_LIBS_ENV} to a directory of "
            "Kafka's jars, or point KAFKA_BOOTSTRAP_SERVERS at a running Kafka"
        )
    return directory


def find_java() -> str:
    """Java 17 or later: RLNODE_JAVA, JAVA_HOME's, or the one on PATH."""
    explicit = os.environ.get(JAVA_ENV)
    if explicit:
        return explicit
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").exists():
        return str(Path(home, "bin", "java"))
    found = shutil.which("java")
    if found is None:
        raise BrokerBinaryMissing(
            "Apache Kafka needs Java 17 or later and none is on PATH: `make setup` installs "
            f"Debian's openjdk-17-jre-headless as root; or set JAVA_HOME or {JAVA_ENV}"
        )
    return found


def new_cluster_id() -> str:
    """A KRaft cluster id: a UUID in URL-safe base64, as `kafka-storage random-uuid` prints."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class Voter:
    """A controller of the cluster's quorum: its node id and where its controller listens."""

    node_id: int
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.node_id}@{bracketed(self.host)}:{self.port}"


def kraft_properties(
    node_id: int,
    voters: str,
    listeners: str,
    advertised: str,
    inter_broker: str,
) -> dict[str, str]:
    """A combined broker and controller (KRaft): its id, the cluster's voters, its listeners
    (the controllers' named CONTROLLER) and what clients are told. The node's broker and
    compose's share them."""
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "listeners": listeners,
        "advertised.listeners": advertised,
        "inter.broker.listener.name": inter_broker,
        "controller.listener.names": "CONTROLLER",
    }


def cluster_properties(replication: int, max_message_bytes: int) -> dict[str, str]:
    """A broker's settings that do not depend on where it runs: replication as the cluster's
    size allows (min.insync.replicas 2 from three brokers on), topics only made by rlnode,
    records as large as the bus takes. The node's broker and compose's share them."""
    min_insync = str(min(2, replication))
    return {
        "num.partitions": "3",
        "default.replication.factor": str(replication),
        "min.insync.replicas": min_insync,
        "offsets.topic.replication.factor": str(replication),
        "offsets.topic.num.partitions": "12",
        "transaction.state.log.replication.factor": str(replication),
        "transaction.state.log.min.isr": min_insync,
        "share.coordinator.state.topic.replication.factor": str(replication),
        "share.coordinator.state.topic.min.isr": min_insync,
        "unclean.leader.election.enable": "false",
        # rlnode makes its topics (with their size and retention); a typo makes none.
        "auto.create.topics.enable": "false",
        # The services join their groups as they start; nobody is worth waiting for.
        "group.initial.rebalance.delay.ms": "0",
        "message.max.bytes": str(max_message_bytes),
        "replica.fetch.max.bytes": str(max_message_bytes + 1024 * 1024),
    }


def secured_properties(
    admin: str,
    admin_password: str,
    keystore: str,
    truststore: str,
    sasl_listeners: tuple[str, ...] = ("broker",),
) -> dict[str, str]:
    """SASL_SSL (SCRAM-SHA-512) for clients and brokers on `sasl_listeners` (the brokers log
    in to each other as the admin), mTLS with the brokers' own certificate for the
    controllers, and ACLs deny-by-default. `keystore`: the broker's certificate and key
    (PEM), `truststore`: the node's CA. The node's broker and compose's share them."""
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{admin}" password="{admin_password}";'
    )
    return {
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        **{
            f"listener.name.{name}.{MECHANISM.lower()}.sasl.jaas.config": jaas
            for name in sasl_listeners
        },
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": keystore,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": truststore,
        "listener.name.controller.ssl.client.auth": "required",
        # A certificate's principal is its common name (not the whole distinguished name).
        "listener.name.controller.ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{admin};User:{BROKER_CERT_NAME}",
    }


class LocalBroker(ChildProcess):
    """`with LocalBroker(directory, identity, admin) as b: b.bootstrap_servers` — a Kafka
    broker and controller for as long as the block runs, its state under `directory`.

    `identity`: the broker's certificate (common name BROKER_CERT_NAME, good for `host` and
    `controller_host`), its key and the node's CA. `admin`: the super user the brokers log
    in to each other with; made in the metadata log when the directory is formatted. With
    neither, an open broker (PLAINTEXT, no ACLs): the tests' shared one, like a Kafka of a
    user's own without security, never a node's.
    `voters` and `replication` make it one broker of a cluster (all of them formatted with
    the same `cluster_id`); alone by default. Its output goes to `log_path`."""

    def __init__(
        self,
        directory: Path,
        identity: Identity | None = None,
        admin: KafkaUser | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        controller_host: str = "127.0.0.1",
        controller_port: int | None = None,
        node_id: int = 1,
        voters: tuple[Voter, ...] = (),
        cluster_id: str | None = None,
        replication: int = 1,
        advertised: str | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 90.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        overrides: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        if (identity is None) != (admin is None):
            raise ValueError("a secured broker needs both its identity and the admin user")
        self.identity = identity
        self.admin = admin
        self.open = identity is None
        self.host = host
        self.port = port or free_port(host)
        self.controller_host = controller_host
        self.controller_port = controller_port or free_port(controller_host)
        self.node_id = node_id
        self.voters = voters or (Voter(node_id, controller_host, self.controller_port),)
        self.cluster_id = cluster_id
        self.replication = replication
        self.advertised = advertised  # host:port clients are told, when not host:port
        self.log_path = log_path or directory / "broker.log"
        self.start_timeout_s = start_timeout_s
        self.max_message_bytes = max_message_bytes
        self.overrides = overrides or {}
        # How long the last start took (seconds), and the formatting within it, if it had one.
        self.start_seconds: float | None = None
        self.format_seconds: float | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{bracketed(self.host)}:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def formatted(self) -> bool:
        return (self.data_dir / "meta.properties").exists()

    def properties(self) -> dict[str, str]:
        """server.properties: one listener for clients and brokers, one for the controllers,
        replication as the cluster's size allows; secured (below) unless `open`."""
        return {
            **kraft_properties(
                self.node_id,
                voters=",".join(str(v) for v in self.voters),
                listeners=(
                    f"BROKER://{self.bootstrap_servers},"
                    f"CONTROLLER://{bracketed(self.controller_host)}:{self.controller_port}"
                ),
                advertised=f"BROKER://{self.advertised or self.bootstrap_servers}",
                inter_broker="BROKER",
            ),
            "log.dirs": str(self.data_dir),
            **cluster_properties(self.replication, self.max_message_bytes),
            **(self._open() if self.open else self._secured()),
            **self.overrides,
        }

    def _open(self) -> dict[str, str]:
        return {"listener.security.protocol.map": "BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT"}

    def _secured(self) -> dict[str, str]:
        assert self.identity is not None and self.admin is not None
        return {
            "listener.security.protocol.map": "BROKER:SASL_SSL,CONTROLLER:SSL",
            **secured_properties(
                self.admin.name,
                self.admin.password,
                keystore=str(self.directory / "broker.pem"),
                truststore=str(self.identity.ca),
            ),
        }

    def _write_config(self) -> Path:
        # 0700 and 0600 throughout: the config holds the admin's password, the PEM its key.
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        if self.identity is not None:
            pem = self.directory / "broker.pem"
            write_private(pem, self.identity.pem_bundle())
        write_private(self.directory / "log4j2.properties", LOG4J2.encode())
        config = self.directory / "server.properties"
        lines = [f"{key}={_escaped(value)}" for key, value in self.properties().items()]
        write_private(config, ("\n".join(lines) + "\n").encode())
        return config

    def _java(self, main: str, *args: str) -> list[str]:
        heap = os.environ.get(HEAP_ENV, DEFAULT_HEAP).split()
        performance = (
            os.environ[PERFORMANCE_ENV].split() if PERFORMANCE_ENV in os.environ else JVM_OPTIONS
        )
        classpath = str(find_kafka_libs() / "*")
        log4j = f"-Dlog4j2.configurationFile={self.directory / 'log4j2.properties'}"
        return [find_java(), *heap, *performance, log4j, "-cp", classpath, main, *args]

    def format(self) -> None:
        """Format the log directory for the cluster, with the admin's SCRAM credentials in
        the metadata log (the brokers need them before any of them is up to add them)."""
        if self.cluster_id is None:
            self.cluster_id = new_cluster_id()
        users = []
        if self.admin is not None:
            admin = f"{MECHANISM}=[name={self.admin.name},password={self.admin.password}]"
            users = [f"--add-scram={admin}"]
        # Each value joined to its option: an id (or password) starting with "-" is read as
        # an option otherwise (a base64 cluster id does, one time in 64).
        argv = self._java(
            "kafka.tools.StorageTool",
            "format",
            f"--config={self.directory / 'server.properties'}",
            f"--cluster-id={self.cluster_id}",
            *users,
            "--ignore-formatted",
        )
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, umask=0o077)
        if done.returncode != 0:
            raise BrokerStartError(
                f"formatting Kafka's log directory {self.data_dir} failed: "
                f"{(done.stderr or done.stdout)[-2000:]}"
            )

    def start(self) -> LocalBroker:
        if self.running:
            return self
        started = time.monotonic()
        self._write_config()
        if not self.formatted:
            self.format()
            self.format_seconds = time.monotonic() - started
        assert self.log_path is not None
        since = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._spawn(self._java("kafka.Kafka", str(self.directory / "server.properties")), "")
        try:
            self._wait_started(since)
        except BrokerStartError as e:
            tail = self._log_tail()
            self.stop()
            raise BrokerStartError(f"{e}; broker log ({self.log_path}):\n{tail}") from None
        self.start_seconds = time.monotonic() - started
        return self

    def _wait_started(self, since: int) -> None:
        """Until the broker logs that it started (its listeners are up then), it exits, or
        the start timeout passes."""
        deadline = time.monotonic() + self.start_timeout_s
        assert self.log_path is not None
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as log:
                log.seek(since)
                if STARTED.encode() in log.read():
                    return
            if self._proc is not None and self._proc.poll() is not None:
                raise BrokerStartError(f"Kafka exited with code {self._proc.returncode}")
            time.sleep(0.1)
        raise BrokerStartError(f"Kafka did not start within {self.start_timeout_s:.0f}s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM: Kafka's controlled shutdown (moves its leaders away in a cluster)."""
        self._terminate(timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash: what a chaos test does to it."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _escaped(value: str) -> str:
    """A value as java.util.Properties reads it back (backslashes are escapes there)."""
    return value.replace("\\", "\\\\")
