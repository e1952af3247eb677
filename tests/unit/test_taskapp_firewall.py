"""The nftables rules that confine managed Task Apps (firewall.py): what they say, that the
kernel takes them, and what a gateway does where they cannot be installed."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from rlnode.service.db import make_engine
from rlnode_services.taskapp_gateway.cgroups import OwnCgroups, cgroup2_mount
from rlnode_services.taskapp_gateway.firewall import (
    OPEN_SETTING,
    IsolationUnavailable,
    NetworkMode,
    TaskAppFirewall,
    TaskAppNetwork,
    parse_allowances,
    resolvers,
    table_name,
)
from rlnode_services.taskapp_gateway.gateway import Gateway, GatewayError
from rlnode_services.taskapp_gateway.keys import KeyProvider
from rlnode_services.taskapp_gateway.schemas import RegisterTaskApp
from rlnode_services.taskapp_gateway.settings import GatewaySettings

NFT = shutil.which("nft")
can_install = pytest.mark.skipif(
    os.geteuid() != 0 or NFT is None, reason="needs root and nft (make setup installs nftables)"
)


def test_allowances_are_public_or_cidrs_and_a_bad_one_is_named() -> None:
    public, networks, ports = parse_allowances(
        ["public", "10.1.0.0/16", "2001:db8::/48", "127.0.0.1:8080", "[::1]:8081"]
    )
    assert public and [str(n) for n in networks] == ["10.1.0.0/16", "2001:db8::/48"]
    assert [(str(n), p) for n, p in ports] == [("127.0.0.1/32", 8080), ("::1/128", 8081)]
    for wrong in ("internet", "127.0.0.1:99999", "localhost:80"):
        with pytest.raises(ValueError, match=f"'{wrong}' is neither 'public', a CIDR"):
            parse_allowances([wrong])
    with pytest.raises(ValueError, match="GATEWAY_TASKAPP_ALLOW_TO"):
        GatewaySettings(taskapp_allow_to=["nope"])


def test_by_default_a_task_app_gets_replies_and_rollout_endpoints_and_is_refused_the_rest() -> None:
    rules = TaskAppFirewall("rlnode_t", []).ruleset()
    confine = [line for line in rules.splitlines() if " confine " in line and "add rule" in line]
    assert [line.split(" confine ", 1)[1] for line in confine] == [
        "ct state established,related accept",
        "ip daddr . tcp dport @rollout4 accept",
        "ip6 daddr . tcp dport @rollout6 accept",
        "ip daddr @allow4 accept",
        "ip6 daddr @allow6 accept",
        "meta l4proto tcp counter reject with tcp reset",
        "counter reject with icmpx admin-prohibited",
    ]
    assert "add rule inet rlnode_t output meta skuid @taskapps jump confine" in rules
    assert "fib" not in rules  # no public addresses unless the operator says so


def test_public_allows_what_is_not_private_nor_the_machine_and_dns_to_its_resolvers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("search example\nnameserver 10.0.0.53\nnameserver fd00::53\n")
    assert [str(a) for a in resolvers(conf)] == ["10.0.0.53", "fd00::53"]
    monkeypatch.setattr(
        "rlnode_services.taskapp_gateway.firewall.resolvers", lambda: resolvers(conf)
    )
    rules = TaskAppFirewall("rlnode_t", ["public", "192.168.7.0/24"]).ruleset()
    assert "add element inet rlnode_t allow4 { 192.168.7.0/24 }" in rules
    assert "ip daddr { 10.0.0.53 } meta l4proto { tcp, udp } th dport 53 accept" in rules
    public = [line for line in rules.splitlines() if "fib daddr type != local" in line]
    assert len(public) == 2 and "127.0.0.0/8" in public[0] and "fe80::/10" in public[1]


def test_one_table_per_node_named_from_what_its_gateways_share() -> None:
    one, other = table_name("sqlite:////a/gateway.db"), table_name("sqlite:////b/gateway.db")
    assert one != other and one == table_name("sqlite:////a/gateway.db")
    assert one.startswith("rlnode_") and len(one) <= 31


@can_install
async def test_the_kernel_takes_the_rules_and_they_go_with_the_gateway() -> None:
    firewall = TaskAppFirewall(table_name(f"unit-{os.getpid()}"), ["public", "10.9.0.0/16"])
    await firewall.check()
    await firewall.install()
    try:
        await firewall.confine(4_000_123)
        # A group's rollouts name the same endpoint at once: one addition serves them all.
        url = "http://127.0.0.1:8731/rollouts/abc"
        await asyncio.gather(*(firewall.allow_endpoint(url) for _ in range(8)))
        await firewall.allow_endpoint("http://localhost:8732/rollouts/abc")
        listed = await _list(firewall.table)
        assert "4000123" in listed and "127.0.0.1 . 8731" in listed
        assert "127.0.0.1 . 8732" in listed or "::1 . 8732" in listed
        await firewall.release(4_000_123)
        assert "4000123" not in await _list(firewall.table)
    finally:
        await firewall.remove()
    assert firewall.table not in await _list_tables()


async def test_without_nft_isolation_is_refused_saying_what_to_install() -> None:
    firewall = TaskAppFirewall("rlnode_t", [], nft="/nonexistent/nft")
    network = TaskAppNetwork(NetworkMode.ISOLATED, firewall, own_users=True)
    await network.start(writes_rules=True)
    with pytest.raises(IsolationUnavailable) as refused:
        network.require()
    if os.geteuid() == 0:  # as root the missing binary is the reason given
        assert "apt-get install nftables" in str(refused.value)
    assert OPEN_SETTING in str(refused.value)
    with pytest.raises(IsolationUnavailable):
        await network.confine(4_000_124)  # no Task App starts


def test_without_users_of_their_own_isolation_is_refused_naming_the_setting() -> None:
    network = TaskAppNetwork(NetworkMode.ISOLATED, TaskAppFirewall("rlnode_t", []), own_users=False)
    with pytest.raises(IsolationUnavailable, match=OPEN_SETTING):
        network.require()
    assert network.describe()["ready"] is False
    assert TaskAppNetwork(NetworkMode.OPEN, None, own_users=False).describe()["ready"] is True


async def test_a_gateway_that_cannot_isolate_refuses_to_start_managed_task_apps(
    tmp_path: Path,
) -> None:
    settings = GatewaySettings(
        sandbox_user="off", sandbox_dir=tmp_path / "homes", allow_urls_to=["loopback"]
    )
    engine = make_engine(f"sqlite:///{tmp_path / 'gateway.sqlite3'}")
    gateway = Gateway(engine, settings, KeyProvider("http://127.0.0.1:9", None, 0), tmp_path)
    await gateway.start()
    try:
        with pytest.raises(GatewayError) as refused:
            await gateway.register(
                "org-a", RegisterTaskApp(name="app", command=[sys.executable, "-c", "pass"])
            )
        assert refused.value.status == 409 and OPEN_SETTING in refused.value.message
        assert gateway.list("org-a") == []
        # External Task Apps are not its to confine.
        await gateway.register("org-a", RegisterTaskApp(name="ext", url="http://127.0.0.1:9/"))
    finally:
        await gateway.aclose()


async def _list(table: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        "nft", "list", "table", "inet", table, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return out.decode()


async def _list_tables() -> str:
    proc = await asyncio.create_subprocess_exec(
        "nft", "list", "tables", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return out.decode()


def test_one_port_of_a_host_is_allowed_and_not_the_rest_of_it() -> None:
    rules = TaskAppFirewall("rlnode_t", ["127.0.0.1:8080", "[::1]:8081"]).ruleset()
    assert "add rule inet rlnode_t confine ip daddr 127.0.0.1/32 tcp dport 8080 accept" in rules
    assert "add rule inet rlnode_t confine ip6 daddr ::1/128 tcp dport 8081 accept" in rules
    assert "add element inet rlnode_t allow4" not in rules  # no whole address allowed


def test_with_cgroups_an_app_reaches_its_own_sockets_and_no_one_elses(tmp_path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    )
    assert cgroup2_mount(mounts) == Path("/sys/fs/cgroup/unified")
    assert cgroup2_mount(tmp_path / "absent") is None
    cgroups = OwnCgroups(Path("/sys/fs/cgroup/unified"), "rlnode_t")
    assert cgroups.nft_match(10001) == (
        'socket cgroupv2 level 3 "unified/rlnode-taskapps/rlnode_t/uid-10001"'
    )
    rules = TaskAppFirewall("rlnode_t", [], cgroups=cgroups).ruleset()
    # Out: a new connection to the machine's own addresses carries the uid; in: only to a
    # socket of that uid's cgroup (own_<uid>, added with the app).
    assert (
        "confine fib daddr type local meta l4proto tcp ct state new "
        "ct mark set meta skuid map @marks accept"
    ) in rules
    assert "add rule inet rlnode_t input iif lo ct state new ct mark vmap @owners" in rules
    # Without cgroups, nothing of the machine's own is let through.
    assert "fib daddr type local" not in TaskAppFirewall("rlnode_t", []).ruleset()


@can_install
def test_a_new_task_app_gets_no_uid_another_node_confines_or_a_process_owns(
    tmp_path: Path,
) -> None:
    """Two nodes on one machine whose orgs name their apps alike: the second gateway's
    preferred uid is the first's. A uid another node's table confines (its gateway alive or
    SIGKILLed, the table left) would take that node's rules, which hold none of this node's
    rollout endpoints; one that owns a process would have it killed with this app's."""
    import subprocess

    from sqlmodel import Session, select

    from rlnode_services.taskapp_gateway.sandbox import preferred_uid
    from rlnode_services.taskapp_gateway.store import SandboxRecord

    base = 3_000_000
    confined = preferred_uid(base, "org-a", "app", 0)
    running = preferred_uid(base, "org-a", "app", 1)
    other = table_name(f"other-node-{os.getpid()}")
    script = f"add table inet {other}\nadd set inet {other} taskapps {{ typeof meta skuid ; }}\n"
    script += f"add element inet {other} taskapps {{ {confined} }}\n"
    subprocess.run(["nft", "-f", "-"], input=script.encode(), check=True)
    sleeper = subprocess.Popen(["sleep", "60"], user=running, group=running)
    settings = GatewaySettings(
        sandbox_uid_base=base,
        sandbox_dir=tmp_path / "homes",
        taskapp_network="open",
        allow_urls_to=["loopback"],
    )
    engine = make_engine(f"sqlite:///{tmp_path / 'gateway.sqlite3'}")

    async def register() -> None:
        gateway = Gateway(engine, settings, KeyProvider("http://127.0.0.1:9", None, 0), tmp_path)
        await gateway.start()
        try:
            await gateway.register(
                "org-a", RegisterTaskApp(name="app", command=[sys.executable, "-c", "pass"])
            )
        finally:
            await gateway.aclose()

    try:
        asyncio.run(register())
        with Session(engine) as s:
            (uid,) = s.exec(select(SandboxRecord.uid)).all()
        assert uid == preferred_uid(base, "org-a", "app", 2)
    finally:
        sleeper.kill()
        subprocess.run(["nft", "delete", "table", "inet", other], check=True)
