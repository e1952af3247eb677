"""`rlnode up|status|down|plan|demo|doctor|broker|topics|model`: the node and its parts.

rlnode up | status | down     run a node (supervised), look at it, stop it
rlnode plan --gpus N [--role R]  how a host's GPUs are split (--emit compose: its override)
rlnode demo                   bring a node up, train, ask the checkpoint, shut down
rlnode doctor                 check the node's plumbing on the embedded defaults
rlnode broker                 run the embedded broker in the foreground
rlnode kafka-cluster H1 H2 H3  plan a Kafka cluster over hosts (rlnode broker --cluster each)
rlnode kafka-cert NAME --out DIR  a client certificate of the node's Kafka CA (operators)
rlnode kafka-users             each service's Kafka user and ACLs on a cluster (compose)
rlnode kafka-cluster-id        a new Kafka cluster id (compose's KAFKA_CLUSTER_ID)
rlnode topics create          create rlnode's topics on KAFKA_BOOTSTRAP_SERVERS
rlnode model init --out DIR   build the tiny model locally
rlnode model import FILE.gguf  dequantize a GGUF once into the node's model store
rlnode model fetch NAME       import a model an installed package ships (smollm2-135m-instruct)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rlnode import __version__
from rlnode.bus import ensure_topics
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics
from rlnode.service.registry import MAX_GATEWAYS, PORT_BASE, SERVICES, port_offset
from rlnode.service.settings import NodeSettings
from rlnode.training.network import RENDEZVOUS_PORT


@contextlib.contextmanager
def _broker_for_node(data_dir: Path) -> Iterator[tuple[KafkaSettings, str]]:
    """KAFKA_* if KAFKA_BOOTSTRAP_SERVERS is set, else the node's broker for the duration."""
    from rlnode.node.local import admin_settings, node_broker

    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield KafkaSettings(), "KAFKA_BOOTSTRAP_SERVERS"
        return
    with node_broker(data_dir) as broker:
        settings = admin_settings(data_dir, broker.bootstrap_servers)
        yield settings, f"the node's Apache Kafka (pid {broker.pid})"


def _broker(args: argparse.Namespace) -> int:
    if args.cluster is not None:
        return _cluster_broker(args.cluster)
    from rlnode.node.local import admin_settings, node_broker

    node = NodeSettings()
    # Before anything is printed: whoever reads our output may signal us as soon as it can.
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    broker = node_broker(node.data_dir, port=args.port)
    try:
        broker.start()
        admin = admin_settings(node.data_dir, broker.bootstrap_servers)
        created = asyncio.run(ensure_topics(admin))
        print(
            f"Apache Kafka ready on {broker.bootstrap_servers} (its log under "
            f"{broker.directory}: what it holds stays for the next start; output in "
            f"{broker.log_path})"
        )
        print(f"created topics: {', '.join(created) or 'none (they existed)'}")
        print("use it as the node's admin (a super user: keep these to yourself):")
        for name, value in admin.connection_env().items():
            print(f"  export {name}={value}")
        print("Ctrl-C stops it.", flush=True)
        while broker.running and not stop["flag"]:
            time.sleep(0.5)
        if not broker.running:
            print("rlnode: the broker exited unexpectedly; see its log", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop()


BROKER_RESTART_S = 2.0  # between a cluster broker's exit and its next start


def _cluster_broker(plan_path: Path) -> int:
    """One broker of a planned cluster, started again whenever it exits (a crash, a kill):
    the cluster lives on with the others meanwhile, and it catches up when back."""
    from rlnode.bus.localbroker import BrokerStartError
    from rlnode.node.kafka_cluster import BrokerPlan, ClusterPlanError

    try:
        plan = BrokerPlan.read(plan_path)
    except ClusterPlanError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 2
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    broker = plan.broker(NodeSettings().data_dir)
    where = f"broker {plan.node_id} of cluster {plan.cluster_id} ({len(plan.voters)} brokers)"
    try:
        while not stop["flag"]:
            try:
                broker.start()
            except BrokerStartError as e:
                print(f"rlnode: {where} did not start: {e}", file=sys.stderr, flush=True)
                time.sleep(BROKER_RESTART_S)
                continue
            print(
                f"Apache Kafka ready on {broker.bootstrap_servers} (pid {broker.pid}), {where}; "
                f"output in {broker.log_path}",
                flush=True,
            )
            while broker.running and not stop["flag"]:
                time.sleep(0.2)
            if not stop["flag"]:
                print(
                    f"rlnode: {where} exited (code {broker.exit_code}); starting it again",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(BROKER_RESTART_S)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop()


def _kafka_cluster(args: argparse.Namespace) -> int:
    """Plan a cluster on the control host: a broker file per host, and the exports the node
    talks to it with."""
    from rlnode.node.kafka_cluster import BrokerPlan, ClusterPlanError, cluster_env, plan_cluster

    data_dir = NodeSettings().data_dir
    try:
        written = plan_cluster(data_dir, args.hosts, args.port, args.controller_port)
    except ClusterPlanError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 2
    env = cluster_env(data_dir, BrokerPlan.read(written[0]))
    if args.json:
        print(json.dumps({"brokers": [str(p) for p in written], "env": env}, indent=2))
        return 0
    print("# a broker file per host (its key, the admin's login: copy each to its host alone):")
    for host, path in zip(args.hosts, written, strict=True):
        print(f"#   {host}: {path}  ->  rlnode broker --cluster {path.name}")
    print("# then, on this host, before `rlnode up` (the node's admin: keep these to yourself):")
    for name, value in env.items():
        print(f"export {name}={value}")
    return 0


def _topics_create(args: argparse.Namespace) -> int:
    if "KAFKA_BOOTSTRAP_SERVERS" not in os.environ:
        print(
            "rlnode: KAFKA_BOOTSTRAP_SERVERS is not set; point it at your broker "
            "(or run `rlnode broker`, which creates the topics itself)",
            file=sys.stderr,
        )
        return 2
    settings = KafkaSettings()
    created = asyncio.run(ensure_topics(settings, partitions=args.partitions))
    for name in topics.ALL_TOPICS:
        print(f"{name:28} {'created' if name in created else 'exists'}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from rlnode.node import doctor

    node = NodeSettings()
    print(f"rlnode {__version__} doctor — data directory {node.data_dir}")
    with _broker_for_node(node.data_dir) as (kafka, origin):
        print(f"broker: {kafka.bootstrap_servers} ({origin})")
        results = doctor.run_checks(kafka, node)
    width = max(len(r.name) for r in results)
    for r in results:
        mark = "ok  " if r.ok else "FAIL"
        print(f"  {mark} {r.name:{width}}  {r.seconds:6.2f}s  {r.detail}")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} checks failed", file=sys.stderr)
        return 1
    print(f"all {len(results)} checks passed")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rlnode.node.demo import run_demo, run_real_model_demo

    if args.model == "smollm2":
        return run_real_model_demo(steps=args.steps or 12, data_dir=args.data_dir)
    return run_demo(steps=args.steps or 60, data_dir=args.data_dir)


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _plan(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rlnode.messages.config import TopologySpec
    from rlnode.node.plan import PlanError, make_plan, plan_table
    from rlnode.node.roles import ALL_ROLES, RoleError, parse_roles

    gpus = _visible_gpus() if args.gpus is None else args.gpus
    try:
        roles = parse_roles(args.role)
        topology = TopologySpec(
            inference_gpus=args.inference_gpus,
            training_gpus=args.training_gpus,
            tensor_parallel=args.tensor_parallel,
            reference=args.reference,
        )
        plan = make_plan(gpus, topology, roles)
    except RoleError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"rlnode: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}", file=sys.stderr)
        return 1
    except PlanError as e:
        print(f"rlnode: no plan for {gpus} GPU(s): {e}", file=sys.stderr)
        return 1
    if args.emit == "compose":
        from rlnode.node.compose import override

        if plan.cpu_only:
            print(
                "rlnode: the compose files are GPU hosts' shapes; with no GPU use rlnode up",
                file=sys.stderr,
            )
            return 1
        if not (plan.runs_inference or plan.runs_training):
            print(
                "rlnode: a control host reserves no GPU: deploy/compose/control.yaml needs "
                "no override",
                file=sys.stderr,
            )
            return 1
        role = "" if roles == ALL_ROLES else f" --role {','.join(roles)}"
        print(override(plan, f"rlnode plan{role} --gpus {gpus} --emit compose"), end="")
        return 0
    host = "" if roles == ALL_ROLES else f" of a host with role(s) {', '.join(roles)}"
    print(f"plan for {gpus} GPU(s){host}:")
    print(plan_table(plan))
    return 0


def _gateways(value: str) -> int:
    count = int(value)
    if not 1 <= count <= MAX_GATEWAYS:
        raise argparse.ArgumentTypeError(f"between 1 and {MAX_GATEWAYS} (a port each, from +10)")
    return count


def _count(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _up(args: argparse.Namespace) -> int:
    from rlnode.messages.config import TopologySpec
    from rlnode.node.roles import JoinInfo, RoleError, parse_roles
    from rlnode.node.supervisor import run_up

    gpus = _visible_gpus() if args.gpus is None else args.gpus
    topology = TopologySpec(
        inference_gpus=args.inference_gpus,
        training_gpus=args.training_gpus,
        tensor_parallel=args.tensor_parallel,
        reference=args.reference,
    )
    try:
        roles = parse_roles(args.role)
        join = JoinInfo.read(args.join) if args.join else None
    except RoleError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 2
    if "control" in roles and join is not None:
        print(
            "rlnode: the control host writes the join file; --join is for the others",
            file=sys.stderr,
        )
        return 2
    rank_hosts = tuple(h.strip() for h in args.rank_hosts.split(",") if h.strip())
    if rank_hosts and "training" not in roles:
        print(
            "rlnode: --rank-hosts lend ranks to this host's learner: it needs the training role",
            file=sys.stderr,
        )
        return 2
    return run_up(
        gpus,
        port_base=args.port_base,
        topology=topology,
        gateways=args.gateways,
        roles=roles,
        host=args.host,
        join=join,
        rank_hosts=rank_hosts,
        rendezvous_port=args.rendezvous_port,
    )


def _kafka_cert(args: argparse.Namespace) -> int:
    """A certificate of the node's CA: a broker's for compose (--address, --bundle). Operators
    only: it needs the CA's key, on the control host."""
    from rlnode.node.kafka_access import KafkaAccessError, check_name, node_ca
    from rlnode.service.files import write_private

    try:
        check_name(args.name)
        ca = node_ca(NodeSettings().data_dir, create=args.init_ca)
        addresses = tuple(args.address or ())
        identity = ca.write_identity(args.out, args.name, addresses)
    except KafkaAccessError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 2
    print(f"# {args.name}: certificate, key and the node's CA in {args.out} (0600)")
    if args.bundle:  # certificate and key in one file: a Kafka broker's PEM keystore
        bundle = args.out / f"{args.name}.bundle.pem"
        write_private(bundle, identity.pem_bundle())
        print(f"# and both in one file: {bundle}")
    print(f"# clients check the brokers with the CA: KAFKA_SSL_CAFILE={identity.ca}")
    return 0


def _kafka_users(args: argparse.Namespace) -> int:
    """Each service's Kafka user (SCRAM-SHA-512, its password from KAFKA_<USER>_PASSWORD)
    and its ACLs, made through the admin KAFKA_* log in as: compose's `kafka-access` step,
    or any cluster whose admin made its users itself."""
    from rlnode.bus.acls import grant_sync
    from rlnode.bus.errors import BusError
    from rlnode.bus.principals import KafkaUser
    from rlnode.node.compose import KAFKA_ADMIN, kafka_acls, kafka_password_variable, kafka_users

    wanted = [user for user in kafka_users() if user != KAFKA_ADMIN]
    missing = [
        kafka_password_variable(u) for u in wanted if not os.environ.get(kafka_password_variable(u))
    ]
    if "KAFKA_BOOTSTRAP_SERVERS" not in os.environ or missing:
        print(
            "rlnode: set KAFKA_BOOTSTRAP_SERVERS and the admin's KAFKA_SASL_USERNAME/PASSWORD, "
            "and a password for each Kafka user"
            + (f"; missing: {', '.join(missing)}" if missing else ""),
            file=sys.stderr,
        )
        return 2
    users = [KafkaUser(u, os.environ[kafka_password_variable(u)]) for u in wanted]
    acls = kafka_acls()
    try:
        grant_sync(KafkaSettings(), users, acls)
    except BusError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 1
    for user in users:
        print(f"{user.name:20} {sum(a.user == user.name for a in acls)} ACLs")
    return 0


def _kafka_cluster_id(_args: argparse.Namespace) -> int:
    from rlnode.bus.localbroker import new_cluster_id

    print(new_cluster_id())
    return 0


def _kafka_credentials(args: argparse.Namespace) -> int:
    """An org's Kafka login for a client of its own, made through the node's admin (the node
    up on this machine, or KAFKA_* naming a cluster's admin): operators only."""
    from rlnode.bus.errors import BusError
    from rlnode.node.kafka_access import grant_org
    from rlnode.sdk import local_node
    from rlnode.sdk.vault import VaultClient, VaultError

    admin = local_node.kafka_settings()
    if admin.security_protocol != "SASL_SSL" or admin.ssl_cafile is None:
        print(
            "rlnode: no Kafka admin login here: run this on the node's control host (as the "
            "user that runs it, while it is up), or set KAFKA_BOOTSTRAP_SERVERS, "
            "KAFKA_SECURITY_PROTOCOL=SASL_SSL, KAFKA_SASL_USERNAME/PASSWORD (a user who may "
            "make users and ACLs) and KAFKA_SSL_CAFILE",
            file=sys.stderr,
        )
        return 2
    token = os.environ.get("RLNODE_ADMIN_TOKEN") or local_node.admin_token()
    if token:  # an org the vault does not know gets no login
        from rlnode.service.registry import VAULT

        try:
            with VaultClient(local_node.discovered_url(VAULT) or VAULT.default_url, token) as vault:
                vault.public_key(args.org_id)
        except VaultError as e:
            print(f"rlnode: org {args.org_id}: {e}", file=sys.stderr)
            return 2
    data_dir = NodeSettings().data_dir
    try:
        access = asyncio.run(grant_org(admin, data_dir, args.org_id, rotate=args.rotate))
    except BusError as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 1
    settings = access.client_settings(admin.bootstrap_servers, admin.ssl_cafile)
    if args.json:
        print(
            json.dumps(
                {
                    "org_id": access.org_id,
                    "events_topic": access.events_topic,
                    "group_prefix": access.group_prefix,
                    "env": settings.connection_env(),
                },
                indent=2,
            )
        )
        return 0
    print(
        f"# org {access.org_id}'s Kafka login ({access.user.name}): it writes job requests to "
        f"{topics.JOB_REQUESTS}, reads its job events from {access.events_topic}, and joins "
        f"consumer groups named {access.group_prefix}*; nothing of another org's"
    )
    for name, value in settings.connection_env().items():
        print(f"export {name}={value}")
    print(f"export RLNODE_ORG_EVENTS_TOPIC={access.events_topic}")
    return 0


def _status(_args: argparse.Namespace) -> int:
    from rlnode.node.supervisor import status

    rows = status()
    print(f"{'SERVICE':<30} {'HEALTHY':<8} {'PID':>8} {'RESTARTS':>8}  URL")
    for r in rows:
        print(
            f"{r['service']:<30} {'yes' if r['healthy'] else 'NO':<8} {r['pid'] or '-':>8} "
            f"{r['restarts']:>8}  {r['url']}" + (f"  ({r['problem']})" if r["problem"] else "")
        )
    return 0 if all(r["healthy"] for r in rows) else 1


def _down(_args: argparse.Namespace) -> int:
    from rlnode.node.supervisor import down

    pid = down()
    print(f"node stopped (supervisor pid {pid})")
    return 0


def _topology_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=None, help="default: the GPUs torch sees")
    parser.add_argument("--inference-gpus", type=_count, default="auto")
    parser.add_argument("--training-gpus", type=_count, default="auto")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument(
        "--reference", choices=["auto", "inference", "trainer", "dedicated", "none"], default="auto"
    )


def register(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser(
        "up", help="run the node in the foreground until rlnode down or Ctrl-C"
    )
    _topology_arguments(up)
    offsets = ", ".join(f"{s.name} +{port_offset(s)}" for s in SERVICES)
    up.add_argument(
        "--port-base", type=int, default=PORT_BASE, help=f"{offsets} (default {PORT_BASE})"
    )
    up.add_argument(
        "--gateways",
        type=_gateways,
        default=1,
        help="taskapp-gateway processes (1-10, default 1): the first runs the managed Task "
        "Apps, all run rollouts, and generators spread their work over them",
    )
    up.add_argument(
        "--role",
        default="control,training,inference",
        help="what this host runs, a comma list (default all): control (broker, vault, "
        "gateways), training (learner, checkpoint-server), inference (generators)",
    )
    up.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address services listen on and other hosts reach them at (default "
        "127.0.0.1; a control host with another address writes <data dir>/join.json)",
    )
    up.add_argument(
        "--join",
        type=Path,
        default=None,
        help="the control host's join.json, for a host without the control role",
    )
    up.add_argument(
        "--rank-hosts",
        default="",
        help="hosts that lend the learner training ranks, a comma list, each as it names "
        "itself (its address toward this host): each runs rlnode trainer-ranks --join "
        "join.json (or ADDR:PORT), and every job trains on this host's ranks and theirs",
    )
    up.add_argument(
        "--rendezvous-port",
        type=int,
        default=RENDEZVOUS_PORT,
        help=f"where the learner listens for rank hosts, on --host (default {RENDEZVOUS_PORT})",
    )
    up.set_defaults(run=_up)
    cert = commands.add_parser(
        "kafka-cert",
        help="issue a certificate of the node's CA (compose's brokers: --address, --bundle)",
    )
    cert.add_argument("name", help="who it is for (its common name)")
    cert.add_argument("--out", type=Path, required=True, help="directory for the files (0600)")
    cert.add_argument(
        "--address",
        action="append",
        help="also a server certificate for this address or DNS name (repeatable; e.g. "
        "compose's Kafka broker: --address kafka)",
    )
    cert.add_argument(
        "--bundle", action="store_true", help="also NAME.bundle.pem: certificate and key"
    )
    cert.add_argument(
        "--init-ca",
        action="store_true",
        help="make the node's CA under RLNODE_DATA_DIR if it has none (production compose)",
    )
    cert.set_defaults(run=_kafka_cert)
    commands.add_parser(
        "kafka-users",
        help="each service's Kafka user (passwords from KAFKA_<USER>_PASSWORD) and ACLs, as "
        "the admin KAFKA_* log in as (compose)",
    ).set_defaults(run=_kafka_users)
    commands.add_parser(
        "kafka-cluster-id", help="a new Kafka cluster id (compose's KAFKA_CLUSTER_ID)"
    ).set_defaults(run=_kafka_cluster_id)
    credentials = commands.add_parser(
        "kafka-credentials",
        help="an org's Kafka login for its own Kafka client (operators, on the control host)",
    )
    credentials.add_argument("org_id", help="the org (as the vault knows it)")
    credentials.add_argument(
        "--rotate", action="store_true", help="a new password (the old one stops working)"
    )
    credentials.add_argument("--json", action="store_true", help="as JSON, not shell exports")
    credentials.set_defaults(run=_kafka_credentials)
    commands.add_parser("status", help="the node's services: health, pid, restarts").set_defaults(
        run=_status
    )
    commands.add_parser("down", help="stop the node rlnode up started").set_defaults(run=_down)
    plan = commands.add_parser("plan", help="how the GPUs are split between inference and training")
    _topology_arguments(plan)
    plan.add_argument(
        "--role",
        default="control,training,inference",
        help="the host's roles, a comma list (default all: one machine); an inference host "
        "gives every GPU to engines, a training host every GPU to ranks, a control host none",
    )
    plan.add_argument(
        "--emit",
        choices=["table", "compose"],
        default="table",
        help="compose: GPU overrides for compose.yaml, or for deploy/compose/<role>.yaml",
    )
    plan.set_defaults(run=_plan)
    demo = commands.add_parser(
        "demo", help="bring a node up, train the tiny model on the copy task, ask it, shut down"
    )
    demo.add_argument(
        "--steps", type=int, default=None, help="training steps (default 60; smollm2: 12)"
    )
    demo.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: the copy task on a tiny model (~3 min); smollm2: SmolLM2-135M-Instruct "
        "learning sums, before and after answers side by side (~10 min on 2 cores)",
    )
    demo.add_argument(
        "--data-dir", type=Path, default=None, help="default: $RLNODE_DATA_DIR/demo/<time>"
    )
    demo.set_defaults(run=_demo)
    doctor = commands.add_parser("doctor", help="check broker, topics, bus, database and services")
    doctor.set_defaults(run=_doctor)

    broker = commands.add_parser(
        "broker", help="run the node's Apache Kafka broker alone, in the foreground"
    )
    broker.add_argument("--port", type=int, default=9092, help="loopback port (default 9092)")
    broker.add_argument(
        "--cluster",
        type=Path,
        default=None,
        metavar="BROKER_FILE",
        help="run this host's broker of a cluster planned with rlnode kafka-cluster (started "
        "again whenever it exits)",
    )
    broker.set_defaults(run=_broker)
    cluster = commands.add_parser(
        "kafka-cluster",
        help="plan a Kafka cluster of the node's own over 3+ hosts (operators, control host)",
    )
    cluster.add_argument("hosts", nargs="+", help="each broker's host address (node ids 1..n)")
    cluster.add_argument("--port", type=int, default=9092, help="clients' port (default 9092)")
    cluster.add_argument(
        "--controller-port", type=int, default=9093, help="the controllers' port (default 9093)"
    )
    cluster.add_argument("--json", action="store_true", help="as JSON, not shell exports")
    cluster.set_defaults(run=_kafka_cluster)

    topics_cmd = commands.add_parser("topics", help="manage rlnode's topics")
    topics_sub = topics_cmd.add_subparsers(dest="topics_command", required=True, metavar="ACTION")
    create = topics_sub.add_parser("create", help="create every rlnode topic that does not exist")
    create.add_argument(
        "--partitions", type=int, default=None, help="default: KAFKA_PARTITIONS or 3"
    )
    create.set_defaults(run=_topics_create)


def _model_init(args: argparse.Namespace) -> int:
    from rlnode.models.build import init_model

    overrides = {
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "tokenizer": args.tokenizer,
    }
    try:
        out = init_model(args.out, args.preset, args.seed, **overrides)
    except ValueError as e:
        print(f"rlnode model init: {e}", file=sys.stderr)
        return 2
    about = json.loads((out / "rlnode-model.json").read_text())
    print(
        f"wrote a {about['architecture']} model ({about['parameters']:,} parameters, preset "
        f"{args.preset}, {about['tokenizer']} tokenizer) to {out}"
    )
    return 0


def _import_and_report(gguf: Path, args: argparse.Namespace) -> int:
    from rlnode.models.gguf import GgufError, import_gguf
    from rlnode.service.settings import NodeSettings

    store = args.store or NodeSettings().model_dir
    try:
        imported = import_gguf(gguf, store, args.dtype)
    except GgufError as e:
        print(f"rlnode model: {e}", file=sys.stderr)
        return 2
    about = json.loads((imported.path / "rlnode-model.json").read_text())
    done = "already imported" if imported.reused else f"imported in {imported.seconds:.0f}s"
    print(
        f"{gguf.name} ({about['architecture']}, {about['parameters']:,} parameters, "
        f"{', '.join(about['quantizations'])}) {done} as {imported.dtype}: {imported.path}\n"
        f'use it as  [model] source = "{imported.path}"',
    )
    return 0


def _model_import(args: argparse.Namespace) -> int:
    return _import_and_report(args.file, args)


def _model_fetch(args: argparse.Namespace) -> int:
    from rlnode.models.catalogue import packaged_gguf
    from rlnode.models.gguf import GgufError

    try:
        gguf = packaged_gguf(args.name)
    except GgufError as e:
        print(f"rlnode model fetch: {e}", file=sys.stderr)
        return 2
    return _import_and_report(gguf, args)


def _add_import_options(parser: argparse.ArgumentParser) -> None:
    from rlnode.models.gguf import IMPORT_DTYPES

    parser.add_argument(
        "--dtype",
        choices=IMPORT_DTYPES,
        default="float32",
        help="the weights' dtype in the HF directory (float32: exactly what the GGUF encodes)",
    )
    parser.add_argument(
        "--store", type=Path, default=None, help="the model store (default: RLNODE_MODEL_DIR)"
    )


def register_model(commands: argparse._SubParsersAction) -> None:
    from rlnode.models.build import PRESETS

    model = commands.add_parser("model", help="models")
    sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = sub.add_parser(
        "init",
        help="build a model with random weights and its tokenizer locally (HF format)",
        description="Presets: "
        + "; ".join(
            f"{name} ({s.architecture}, hidden {s.hidden}, {s.layers} layers, "
            f"{s.heads}/{s.kv_heads} heads, {s.tokenizer})"
            for name, s in PRESETS.items()
        ),
    )
    init.add_argument("--out", type=Path, required=True)
    init.add_argument(
        "--preset", choices=list(PRESETS), default="tiny", help="architecture and shape"
    )
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--hidden", type=int, default=None, help="override the preset's")
    init.add_argument("--layers", type=int, default=None, help="override the preset's")
    init.add_argument("--heads", type=int, default=None, help="override the preset's")
    init.add_argument("--kv-heads", type=int, default=None, help="override the preset's")
    init.add_argument(
        "--tokenizer", choices=["char", "bpe"], default=None, help="override the preset's"
    )
    init.set_defaults(run=_model_init)

    from rlnode.models.catalogue import PACKAGED

    importing = sub.add_parser(
        "import",
        help="dequantize a GGUF file once into an HF directory in the node's model store",
    )
    importing.add_argument("file", type=Path, help="a .gguf file")
    _add_import_options(importing)
    importing.set_defaults(run=_model_import)
    fetch = sub.add_parser(
        "fetch",
        help="import a pretrained model that an installed package ships",
        description="Models: " + "; ".join(f"{n}: {m.about}" for n, m in PACKAGED.items()),
    )
    fetch.add_argument("name", choices=list(PACKAGED))
    _add_import_options(fetch)
    fetch.set_defaults(run=_model_fetch)
