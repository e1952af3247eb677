"""A job request that arrives while the vault or the gateway is down (restarting, say) is
not judged: the learner's intake raises `Retryable`, so the subscription hands it the same
request again once they answer, instead of rejecting the job for an outage (the chaos
benchmark once saw two jobs rejected "cannot reach the vault" while it restarted)."""

from __future__ import annotations

import pytest

from rlnode.bus import Retryable
from rlnode.bus.localbroker import free_port
from rlnode.examples import example_job
from rlnode_services.learner.intake import JobIntake
from rlnode_services.learner.settings import LearnerSettings


@pytest.mark.parametrize("down", ["vault", "gateway"])
def test_a_dependency_that_does_not_answer_is_not_a_verdict(monkeypatch, tmp_path, down) -> None:
    from rlnode.sdk.vault import VaultClient

    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("LEARNER_SERVICE_TOKEN", "a-token")
    monkeypatch.setenv("LEARNER_VAULT_URL", nobody if down == "vault" else "http://127.0.0.1:1")
    monkeypatch.setenv("LEARNER_GATEWAY_URL", nobody)
    if down == "gateway":  # the vault answers: the secret is there
        monkeypatch.setattr(VaultClient, "get_secret_info", lambda *_a, **_k: {"name": "k"})
    settings = LearnerSettings()
    intake = JobIntake(settings, verifier=None, engine=None)  # type: ignore[arg-type]
    config = example_job("copy_task", tmp_path / "model")
    with pytest.raises(Retryable, match="cannot reach the"):
        intake._check_dependencies("org-a", config)
