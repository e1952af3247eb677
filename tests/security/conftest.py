"""One node for the attacks: two orgs, A (the attacker, with an org token, a Kafka client and
Task Apps of its own) and B (the victim, with a secret, a managed Task App and a finished
job whose checkpoints are served)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlnode.examples import example_job
from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions, Org
from rlnode.sdk.checkpoints import CheckpointClient
from rlnode.service.registry import VAULT
from rlnode.testing import unique_id, wait_until

VICTIM_KEY = "tk-victim-" + "5" * 24


@dataclass
class AttackedNode:
    node: LocalNode
    attacker: Org
    victim: Org
    victim_job: str  # finished, with checkpoints at steps 1 and 2
    model: Path
    directory: Path

    def url(self, service: str) -> str:
        return self.node.url(service)


# Package scope: let go once tests/security is done (one worker runs the package: tests/conftest.py).
@pytest.fixture(scope="package")
def attacked(tmp_path_factory) -> Iterator[AttackedNode]:
    import asyncio

    directory = tmp_path_factory.mktemp("attacked")
    # A broker of its own, as a node has: nothing of other tests' on its topics.
    # Job tokens live their longest (an hour, not 10 minutes): the session's later files
    # replay the victim's, and run on a pytest worker beside others' files, well after it.
    vault = {"VAULT_JOB_TOKEN_TTL_S": "3600"}
    with LocalNode(NodeOptions(data_dir=directory / "node", env={VAULT.name: vault})) as node:
        attacker = node.create_org(unique_id("attacker"), {"ENVIRONMENT_API_KEY": "tk-attacker"})
        victim = node.create_org(unique_id("victim"), {"ENVIRONMENT_API_KEY": VICTIM_KEY})
        assert node.register_example_task_app(victim, "copy", "copy_task")["ok"]
        # The attacker's jobs are refused for what they ask, never for lack of a Task App.
        assert node.register_example_task_app(attacker, "copy", "copy_task")["ok"]
        model = init_tiny_model(directory / "tiny", seed=0)
        job = example_job(
            "copy_task", model, steps=2, group_size=4, prompts_per_step=2, checkpoint_every=1
        )

        async def run_victim_job() -> str:
            async with node.jobs(victim) as jobs:
                job_id = await jobs.start(job)
                final = await jobs.wait(job_id, idle_timeout_s=300)
                assert final.type.value == "job.completed", final
                return job_id

        victim_job = asyncio.run(run_victim_job())
        # The checkpoint-server indexes from the events: the attacks start once it serves both.
        with CheckpointClient(node.url("checkpoint-server"), victim.token) as server:
            wait_until(
                lambda: len(server.checkpoints(victim_job)) == 2,
                60,
                f"the checkpoint-server serving {victim_job}'s two checkpoints",
            )
        yield AttackedNode(node, attacker, victim, victim_job, model, directory)
