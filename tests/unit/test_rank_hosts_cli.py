"""Joining rank hosts to a learner from the command line: `rlnode up --rank-hosts` gives the
learner its rank hosts and a rendezvous on the host's address (named in the join file), and
`rlnode trainer-ranks --join` takes that join file or the learner's ADDR:PORT."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlnode.cli import main
from rlnode.cli.ranks import rendezvous_of
from rlnode.node.local import NodeOptions
from rlnode.node.roles import JoinInfo, RoleError


def join_file(tmp_path: Path, rendezvous: str) -> Path:
    info = JoinInfo(
        bootstrap="10.0.0.1:9092",
        vault_url="http://10.0.0.1:8710",
        gateway_urls=["http://10.0.0.1:8720"],
        service_tokens={},
        rendezvous=rendezvous,
    )
    return info.write(tmp_path / "join.json")


def test_trainer_ranks_joins_an_address_or_the_rendezvous_a_join_file_names(tmp_path) -> None:
    assert rendezvous_of("10.0.0.1:29400") == "10.0.0.1:29400"
    assert rendezvous_of(str(join_file(tmp_path, "10.0.0.1:29411"))) == "10.0.0.1:29411"
    with pytest.raises(RoleError, match=r"names no learner rendezvous.*--rank-hosts"):
        rendezvous_of(str(join_file(tmp_path, "")))
    with pytest.raises(RoleError, match="no join file at"):
        rendezvous_of(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="is not address:port"):
        rendezvous_of("10.0.0.1")


def test_a_learner_with_rank_hosts_listens_on_the_hosts_address(tmp_path) -> None:
    options = NodeOptions(tmp_path, host="10.0.0.1", rank_hosts=("10.0.0.2", "10.0.0.3"))
    assert options.rendezvous == "10.0.0.1:29400"
    assert NodeOptions(tmp_path, host="10.0.0.1").rendezvous == ""  # none to wait for


def test_rank_hosts_are_for_the_host_that_trains(tmp_path, capsys) -> None:
    join = str(join_file(tmp_path, ""))
    assert main(["up", "--role", "inference", "--rank-hosts", "10.0.0.2", "--join", join]) == 2
    assert "--rank-hosts lend ranks to this host's learner" in capsys.readouterr().err
    assert main(["trainer-ranks", "--join", join]) == 2
    assert "names no learner rendezvous" in capsys.readouterr().err
