"""Test hosts on one machine (tests/multihost/, bench/multihost.py): a Linux network namespace per host, joined by veth pairs to a
bridge, each with addresses of its own in a test subnet and, where asked, its own tmpfs over
a directory (what one host writes there the others do not see). This process stays in the
root namespace with an address on the bridge: the user's machine.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; `available()` says why not."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlnode import testing
from rlnode.bus.localbroker import HEAP_ENV, PERFORMANCE_ENV
from rlnode.bus.settings import KafkaSettings
from rlnode.examples import task_app_path
from rlnode.messages import JobConfig, JobEvent
from rlnode.node.roles import JoinInfo, join_path
from rlnode.sdk.gateway import GatewayClient
from rlnode.sdk.jobs import JobsClient
from rlnode.sdk.vault import VaultClient
from rlnode.testing import unique_id, waiting_for

ENDED = ("completed", "failed", "cancelled", "rejected")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None if test hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"rlprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    bridge_end: str  # the veth end on the bridge (in the root namespace)

    def command(self, argv: list[str], private_dirs: tuple[Path, ...] = ()) -> list[str]:
        """`argv` run on this host: in its namespace, with a fresh tmpfs over each of
        `private_dirs` (in a mount namespace of its own: nobody else sees what it writes)."""
        mounts = " && ".join(
            f'mount -t tmpfs -o mode=0700 tmpfs "${i + 1}"' for i in range(len(private_dirs))
        )
        script = (mounts + " && " if mounts else "") + f'shift {len(private_dirs)} && exec "$@"'
        return [
            "ip", "netns", "exec", self.namespace, "sh", "-c", script, "host",
            *map(str, private_dirs), *argv,
        ]  # fmt: skip

    def link(self, up: bool) -> None:
        """Its network cable plugged in or pulled (the host's own end of the pair)."""
        _ip("-n", self.namespace, "link", "set", "eth0", "up" if up else "down")


class TestNetwork:
    """`with TestNetwork() as net: a = net.add_host("a")` — hosts on a /24 of 10.x.y.0, a
    subnet picked from this process's pid so that two runs on one machine do not meet."""

    def __init__(self) -> None:
        tag = os.getpid() % 50000
        self.prefix = f"10.{200 + tag // 250 % 50}.{tag % 250}"
        self.tag = f"rl{tag}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self.address = f"{self.prefix}.254"  # this process's, on the bridge

    def __enter__(self) -> TestNetwork:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(name, f"{self.tag}-{name}", f"{self.prefix}.{index}", f"{self.tag}v{index}")
        self.hosts.append(host)
        _ip("netns", "add", host.namespace)
        _ip("link", "add", host.bridge_end, "type", "veth", "peer", "name", "eth0", "netns",
            host.namespace)  # fmt: skip
        _ip("link", "set", host.bridge_end, "master", self.bridge, "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.namespace, "link", "set", "eth0", "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", host.bridge_end], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __exit__(self, *_exc) -> None:
        self.close()


def stop_on_host(proc: subprocess.Popen) -> None:
    """SIGTERM a host's process, a minute for it to stop in order, then SIGKILL whatever is
    left of its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class HostProcess:
    """`rlnode up` on a test host, in the foreground of its namespace."""

    def __init__(
        self,
        host: Host,
        data_dir: Path,
        argv: list[str],
        weights: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)  # the control host's may hold its plans
        self.log = data_dir.parent / f"{host.name}-up.log"
        # The control host runs its broker, unless `env` names a cluster.
        inherited = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
        environment = (
            inherited
            | {
                "RLNODE_DATA_DIR": str(data_dir),
                "RLNODE_WEIGHTS_DIR": str(weights),
                # What a generator downloads goes to this host's own tmpfs too.
                "GENERATOR_WEIGHTS_DIR": str(weights / "fetched"),
                # Quick failover for the test: a silent generator leaves its group in 6 s.
                "KAFKA_SESSION_TIMEOUT_MS": "6000",
                "KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
            }
            | (env or {})
        )
        command = [sys.executable, "-m", "rlnode.cli", "up", "--host", host.address, *argv]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                host.command(command, private_dirs=(weights,)),
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def state(self) -> dict | None:
        path = self.data_dir / "node.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_up(self, timeout_s: float) -> dict:
        def up() -> dict | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"rlnode up on {self.host.name} exited: {self.tail()}")
            return self.state()

        try:
            return testing.wait_until(up, timeout_s, f"host {self.host.name} up")
        except TimeoutError as e:
            raise AssertionError(f"{e}: {self.tail()}") from None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def exits(self, service: str) -> str:
        """Why `service` exited on this host: the supervisor's lines about it, and the
        errors in its own log (a test's tmp_path is gone once CI reports the failure)."""
        said = [line for line in self.tail(1 << 20).splitlines() if service in line]
        errors = []  # "rollout-generator/gen0" logs to rollout-generator-gen0.log
        for path in sorted((self.data_dir / "logs").glob(f"{service.replace('/', '-')}*.log")):
            lines = path.read_text(errors="replace").splitlines()
            errors += [f"{path.name}: {line[:300]}" for line in lines if _is_error(line)]
        return "\n".join([*said, "its log's errors (the last 40):", *errors[-40:]])

    def stop(self) -> None:
        stop_on_host(self.proc)  # it stops its services in order


def _is_error(line: str) -> bool:
    return " ERROR " in line or " CRITICAL " in line or line.startswith(("Traceback", "  File "))


@dataclass(frozen=True)
class ThisMachine:
    """A host that is this machine at one of its loopback addresses (127.0.0.2, ...): three
    brokers of a cluster on one machine (bench/chaos.py --cluster), no namespace needed."""

    name: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        return argv


class BrokerHost:
    """`rlnode broker --cluster FILE` on a test host: one broker of a planned cluster,
    started again by its `rlnode broker` whenever it exits."""

    READY = re.compile(r"Apache Kafka ready on \S+ \(pid (\d+)\)")

    def __init__(self, host: Host | ThisMachine, data_dir: Path, plan: Path) -> None:
        self.host = host
        data_dir.mkdir(parents=True)
        self.data_dir = data_dir
        self.log = data_dir.parent / f"{host.name}-broker.log"
        command = [sys.executable, "-m", "rlnode.cli", "broker", "--cluster", str(plan)]
        # Not a client's KAFKA_* (the broker file says everything), but the JVM's own.
        environment = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("KAFKA_") or k in (HEAP_ENV, PERFORMANCE_ENV)
        }
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                host.command(command),
                env=environment | {"RLNODE_DATA_DIR": str(data_dir)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def starts(self) -> list[int]:
        """The pid of each start of its broker so far."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [int(pid) for pid in self.READY.findall(text)]

    def wait_started(self, times: int, timeout_s: float) -> int:
        """Until its broker has started `times` times; the pid of the last start."""

        def started() -> int | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"rlnode broker on {self.host.name} exited: {self.tail()}")
            pids = self.starts()
            return pids[-1] if len(pids) >= times else None

        try:
            return testing.wait_until(started, timeout_s, f"broker on {self.host.name}")
        except TimeoutError as e:
            raise AssertionError(f"{e}: {self.tail()}") from None

    def tail(self, chars: int = 3000) -> str:
        broker_log = self.data_dir / "logs" / "broker.log"
        said = self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""
        if broker_log.exists():
            said += f"\n-- {broker_log}:\n" + broker_log.read_text(errors="replace")[-chars:]
        return said

    def stop(self) -> None:
        stop_on_host(self.proc)  # a controlled shutdown of its broker


def plan_cluster(control_data_dir: Path, hosts: list[Host]) -> tuple[list[Path], dict[str, str]]:
    """`rlnode kafka-cluster <the hosts' addresses> --json` on the control host, as its
    operator: a broker file per host, and the KAFKA_* its node talks to the cluster with."""
    planned = operator_json(control_data_dir, "kafka-cluster", *(h.address for h in hosts))
    return [Path(p) for p in planned["brokers"]], planned["env"]


def operator_json(control_data_dir: Path, command: str, *args: str) -> dict:
    """`rlnode COMMAND ARGS --json` on the control host as its operator (the node's data
    dir, none of this shell's KAFKA_*): what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    done = subprocess.run(
        [sys.executable, "-m", "rlnode.cli", command, *args, "--json"],
        env=env | {"RLNODE_DATA_DIR": str(control_data_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rlnode {command} failed: {done.stderr or done.stdout}")
    return json.loads(done.stdout)


@dataclass
class User:
    """A user of a node that spans test hosts, from this machine: an org with its key, its
    Task Apps, its jobs, through the public clients and the addresses in the join file."""

    join: JoinInfo
    org_id: str
    token: str
    kafka: KafkaSettings  # the org's own login (rlnode kafka-credentials), over TLS

    @classmethod
    def create(cls, control: HostProcess) -> User:
        join = JoinInfo.read(join_path(control.data_dir))
        admin_token = (control.data_dir / "secrets" / "vault-admin.token").read_text().strip()
        org_id = unique_id("org")
        with VaultClient(join.vault_url, admin_token) as admin:
            token = admin.create_org(org_id)["token"]["token"]
        with VaultClient(join.vault_url, token) as vault:
            vault.set_secret("ENVIRONMENT_API_KEY", unique_id("key"))
        kafka = KafkaSettings(bootstrap_servers=join.bootstrap)
        if join.kafka:  # the node's own broker: the operator issues the org its login
            kafka = kafka_credentials(control.data_dir, org_id)
        return cls(join, org_id, token, kafka)

    def register_example_task_app(self, name: str, example: str) -> dict:
        with GatewayClient(self.join.gateway_urls[0], self.token) as gateway:
            gateway.register(name, command=[sys.executable, str(task_app_path(example))])
            return gateway.verify(name)

    def jobs(self, client: str) -> JobsClient:
        return JobsClient(self.org_id, self.token, self.kafka, client, self.join.vault_url)

    def start(self, config: JobConfig) -> str:
        async def start() -> str:
            async with self.jobs("testhosts") as jobs:
                return await jobs.start(config, unique_id("job"))

        return asyncio.run(start())

    def events(self, job_id: str, within_s: float = 120.0) -> list[JobEvent]:
        """The job's events through its last, as a user watching it reads them. Not what
        the topic holds when the learner says the job ended: its last steps' events can be
        on their way to the brokers then (a 3-host run saw steps 17-24 stored 1 s later)."""

        async def events() -> list[JobEvent]:
            seen: list[JobEvent] = []
            progress = lambda: [f"{e.type.value}: {e.message}" for e in seen[-8:]]  # noqa: E731
            async with (
                self.jobs("testhosts-watch") as jobs,
                waiting_for(f"end of job {job_id}", within_s, progress),
            ):
                async for event in jobs.events(job_id):
                    seen.append(event)
            return seen

        return asyncio.run(events())

    def learner_job(self, job_id: str) -> dict:
        """The job as the learner records it ({} while it does not answer)."""
        try:
            response = httpx.get(
                self.join.learner_url + "/v1/jobs",
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=5,
            )
            return next((j for j in response.json() if j["job_id"] == job_id), {})
        except (httpx.HTTPError, ValueError):
            return {}

    def wait_for_end(self, job_id: str, timeout_s: float) -> dict:
        return testing.wait_until(
            lambda: (j := self.learner_job(job_id)).get("status") in ENDED and j,
            timeout_s,
            f"{job_id} ended",
        )


def kafka_credentials(control_data_dir: Path, org_id: str) -> KafkaSettings:
    """`rlnode kafka-credentials ORG --json` on the control host, as its operator: the org's
    login."""
    return KafkaSettings.from_exports(
        operator_json(control_data_dir, "kafka-credentials", org_id)["env"]
    )


async def kafka_client_outcome(settings: KafkaSettings, **overrides) -> str:
    """What a Kafka client with `settings` (and aiokafka `overrides`) gets from the broker:
    'topics: N' or the error's name."""
    from aiokafka.admin import AIOKafkaAdminClient

    from rlnode.bus.clients import connection

    client = AIOKafkaAdminClient(**(connection(settings) | overrides), request_timeout_ms=5000)
    try:
        await asyncio.wait_for(client.start(), 15)
        return f"topics: {len(await client.list_topics())}"
    except Exception as e:
        return f"refused: {type(e).__name__}"
    finally:
        await client.close()
