"""A Kafka cluster of the node's own over several hosts: one combined broker and controller
per host (`rlnode broker --cluster`), planned on the control host (`rlnode kafka-cluster`).

The control host holds the node's CA and its Kafka admin (kafka_access.py). Planning a
cluster gives it one cluster id and voter list, and writes a file per broker
(`<data dir>/secrets/kafka/cluster/broker-<n>.json`, 0600) with that broker's certificate
and key (for its host's address), the CA's certificate and the admin's login: the brokers log
in to each other as the admin (SCRAM over TLS) and every broker's log is formatted with the
admin's credentials. The operator copies each file to its host; nothing else leaves the
control host (not the CA's key). The node then talks to the cluster as KAFKA_* say
(`cluster_env`): the admin makes each service's user and ACLs through it, as for any
cluster of a user's own.

Unlike the single node's broker, whose controller listener is on loopback, a cluster's
controllers must reach each other: each listens on its host's address, and takes only the
brokers' own certificate (mTLS), never a client's login."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rlnode.bus.localbroker import LocalBroker, Voter, bracketed, new_cluster_id
from rlnode.bus.pki import Issued, write_identity
from rlnode.bus.principals import ADMIN, BROKER_CERT_NAME, KafkaUser
from rlnode.node.kafka_access import ca_certificate, kafka_secrets, node_ca, users
from rlnode.service.files import private_dir, write_private

DEFAULT_PORT = 9092
DEFAULT_CONTROLLER_PORT = 9093
PLAN_VERSION = 1


class ClusterPlanError(ValueError):
    pass


@dataclass(frozen=True)
class BrokerPlan:
    """One broker of a planned cluster, as its file on its host says."""

    cluster_id: str
    node_id: int
    host: str
    port: int
    controller_port: int
    voters: list[str]  # "id@host:port", every controller of the cluster
    bootstrap: str  # every broker's client address, comma-separated
    admin: str
    admin_password: str
    ca_pem: str
    cert_pem: str
    key_pem: str
    version: int = PLAN_VERSION

    @classmethod
    def read(cls, path: Path) -> BrokerPlan:
        try:
            fields = json.loads(path.read_text())
            if fields.get("version") != PLAN_VERSION:
                raise ValueError(f"version {fields.get('version')!r}, not {PLAN_VERSION}")
            return cls(**fields)
        except OSError as e:
            raise ClusterPlanError(f"cannot read the broker file {path}: {e}") from None
        except (ValueError, TypeError) as e:
            raise ClusterPlanError(
                f"{path} is not a broker file rlnode wrote ({e}): plan the cluster again on "
                "the control host (rlnode kafka-cluster) and copy the host's file here"
            ) from None

    def write(self, path: Path) -> None:
        write_private(path, json.dumps(asdict(self), indent=2).encode())

    def broker(self, data_dir: Path) -> LocalBroker:
        """This host's broker (not started): its log under <data dir>/broker, its key and
        certificate written under the data dir's secrets."""
        identity = write_identity(
            kafka_secrets(data_dir) / "broker",
            BROKER_CERT_NAME,
            Issued(self.cert_pem.encode(), self.key_pem.encode()),
            self.ca_pem.encode(),
        )
        voters = tuple(_voter(v) for v in self.voters)
        return LocalBroker(
            data_dir / "broker",
            identity,
            KafkaUser(self.admin, self.admin_password),
            host=self.host,
            port=self.port,
            controller_host=self.host,
            controller_port=self.controller_port,
            node_id=self.node_id,
            voters=voters,
            cluster_id=self.cluster_id,
            replication=min(3, len(voters)),
            log_path=data_dir / "logs" / "broker.log",
        )


def _voter(text: str) -> Voter:
    node_id, _, address = text.partition("@")
    host, _, port = address.rpartition(":")
    return Voter(int(node_id), host.strip("[]"), int(port))


def plan_directory(data_dir: Path) -> Path:
    return kafka_secrets(data_dir) / "cluster"


def plan_cluster(
    data_dir: Path,
    hosts: list[str],
    port: int = DEFAULT_PORT,
    controller_port: int = DEFAULT_CONTROLLER_PORT,
) -> list[Path]:
    """A new cluster over `hosts` (node ids 1..n in that order): a broker file per host,
    under plan_directory. Planning again makes a new cluster (a new id): brokers formatted
    for the old one refuse to start with the new files."""
    if len(hosts) < 3 or len(set(hosts)) != len(hosts):
        raise ClusterPlanError(
            f"hosts {hosts}: give three or more distinct addresses (a quorum of controllers "
            "and replication 3 with min.insync.replicas 2 need three)"
        )
    if port == controller_port:
        raise ClusterPlanError("the client and controller ports must differ")
    ca = node_ca(data_dir)
    admin = users(data_dir).user(ADMIN)
    cluster_id = new_cluster_id()
    voters = [str(Voter(i, host, controller_port)) for i, host in enumerate(hosts, start=1)]
    bootstrap = ",".join(f"{bracketed(host)}:{port}" for host in hosts)
    directory = private_dir(plan_directory(data_dir))
    written = []
    for node_id, host in enumerate(hosts, start=1):
        issued = ca.issue(BROKER_CERT_NAME, (host,))
        plan = BrokerPlan(
            cluster_id=cluster_id,
            node_id=node_id,
            host=host,
            port=port,
            controller_port=controller_port,
            voters=voters,
            bootstrap=bootstrap,
            admin=admin.name,
            admin_password=admin.password,
            ca_pem=ca.cert_pem.decode(),
            cert_pem=issued.cert_pem.decode(),
            key_pem=issued.key_pem.decode(),
        )
        path = directory / f"broker-{node_id}.json"
        plan.write(path)
        written.append(path)
    return written


def cluster_env(data_dir: Path, plan: BrokerPlan) -> dict[str, str]:
    """The KAFKA_* a node on the control host talks to the cluster with: as its admin, over
    TLS checked with the node's CA, topics made with three replicas."""
    admin = users(data_dir).user(plan.admin)
    settings = admin.client_settings(plan.bootstrap, ca_certificate(data_dir))
    return settings.connection_env() | {
        "KAFKA_REPLICATION_FACTOR": str(min(3, len(plan.voters))),
    }
