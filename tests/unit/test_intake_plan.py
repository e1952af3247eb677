"""A job's topology is checked against the learner's own host: on a training host (`rlnode up
--role training`, LEARNER_HOST_ROLES) every GPU may go to ranks, and what the topology says
of engines is the inference hosts' to plan; on one machine, inference takes its share."""

from __future__ import annotations

import pytest

from rlnode.examples import example_job
from rlnode.node.local import plan_env
from rlnode.node.plan import make_plan
from rlnode_services.learner.intake import JobIntake
from rlnode_services.learner.settings import LearnerSettings


def intake_on(monkeypatch, roles: tuple[str, ...], gpus: int = 8) -> JobIntake:
    """The intake of a learner started as `rlnode up --role <roles>` starts it on `gpus`."""
    _generators, learner, _serving = plan_env(make_plan(gpus, roles=roles))
    for key, value in learner.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LEARNER_SERVICE_TOKEN", "a-token")
    return JobIntake(LearnerSettings(), verifier=None, engine=None)  # type: ignore[arg-type]


def job(tmp_path, **topology):
    config = example_job("copy_task", tmp_path / "model")
    return config.model_copy(update={"topology": config.topology.model_copy(update=topology)})


def test_a_training_host_gives_a_job_all_its_gpus(monkeypatch, tmp_path) -> None:
    intake = intake_on(monkeypatch, ("training",))
    assert intake.settings.host_roles == ["training"]
    # The engines are the inference hosts': their count and split are not this host's.
    verdict = intake.check_plan(job(tmp_path, training_gpus=8, inference_gpus=16))
    assert verdict.ok, verdict.reason
    too_many = intake.check_plan(job(tmp_path, training_gpus=9))
    assert not too_many.ok and "this training host" in too_many.reason
    assert "9 GPUs" in too_many.reason and "training_gpus 8" in too_many.reason


@pytest.mark.parametrize("roles", [("control", "training", "inference"), ("training", "inference")])
def test_a_host_that_also_runs_inference_keeps_gpus_for_its_engines(
    monkeypatch, tmp_path, roles
) -> None:
    intake = intake_on(monkeypatch, roles)
    refused = intake.check_plan(job(tmp_path, training_gpus=8))
    assert not refused.ok and "this node" in refused.reason, refused.reason
    assert intake.check_plan(job(tmp_path, training_gpus=2)).ok
