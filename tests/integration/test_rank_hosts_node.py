"""A node whose learner borrows ranks from another host, wired as `rlnode up --rank-hosts`
wires it: the learner listens for rank hosts on the node's address, a rank host runs the
command `rlnode trainer-ranks` runs, and a job trains on both (world size 2) to completion."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlnode.bus.localbroker import free_port
from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.service.registry import GATEWAY, GENERATOR, LEARNER, VAULT
from rlnode.testing import unique_id

RANK_HOST = "127.0.0.2"  # its name in LEARNER_RANK_HOSTS (it runs on this machine)


@pytest.mark.timeout(600)
def test_a_job_trains_on_the_learners_rank_and_a_rank_hosts(tmp_path) -> None:
    options = NodeOptions(
        data_dir=tmp_path / "node",
        services=(VAULT.name, GATEWAY.name, GENERATOR.name, LEARNER.name),
        rank_hosts=(RANK_HOST,),
        rendezvous_port=free_port(),
        env={"learner": {"LEARNER_RANK_JOIN_TIMEOUT_S": "120"}},
    )
    model = init_tiny_model(tmp_path / "tiny", seed=0)
    with LocalNode(options) as node:
        org = node.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("tk")})
        assert node.register_example_task_app(org, "copy", "copy_task")["ok"]
        log = tmp_path / "rank-host.log"
        with open(log, "wb") as out:
            rank_host = subprocess.Popen(
                [
                    *(sys.executable, "-m", "rlnode.cli", "trainer-ranks"),
                    *("--join", options.rendezvous, "--host", RANK_HOST),
                    *("--device", "cpu", "--nproc", "1"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            config = example_job(
                "copy_task", model, steps=2, group_size=4, prompts_per_step=2, checkpoint_every=2
            )
            _job_id, events = node.run_job(org, config, idle_timeout_s=240)
            steps = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
            assert [d["step"] for d in steps] == [1, 2]
            assert all(d["world_size"] == 2 for d in steps), steps  # its rank and the host's
        except BaseException:
            print(log.read_text()[-3000:])
            raise
        finally:
            rank_host.terminate()
            rank_host.wait(30)
