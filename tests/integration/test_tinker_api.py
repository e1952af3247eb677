"""The Tinker API on a node, driven by the unchanged `tinker` SDK (0.38.0) with an org's key
from `rlnode tinker key`: a LoRA run on the tiny model that learns a sequence with
cross_entropy through the learner, saves its state and is resumed from it in a new training
client; the REST views of runs and checkpoints; and another org's key, which finds none of
it."""

from __future__ import annotations

import json
import os

import pytest

from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.testing import run_rlnode, unique_id

BASE = "rlnode/tiny-chat"
SEQUENCE = [5, 17, 23, 42, 8, 99, 3, 61, 12, 7]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tinker")
    model = init_tiny_model(directory / "tiny", seed=0)
    models = json.dumps({BASE: str(model)})
    options = NodeOptions(
        data_dir=directory / "node", env={"tinker-api": {"TINKER_API_BASE_MODELS": models}}
    )
    with LocalNode(options) as running:
        yield running, directory


def tinker_key(node, org) -> str:
    """`rlnode tinker key`, as a user would run it."""
    running, directory = node
    env = {
        **os.environ,
        "RLNODE_TOKEN": org.token,
        "RLNODE_VAULT_URL": running.url("credential-vault"),
        "RLNODE_DATA_DIR": str(directory / "user"),
    }
    result = run_rlnode(env, "tinker", "key", timeout=60, cwd=directory)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("tml-") and "TINKER_API_KEY" in result.stderr
    return key


@pytest.fixture(scope="module")
def alice(node):
    running, _directory = node
    return tinker_key(node, running.create_org(unique_id("alice"), {}))


@pytest.fixture(scope="module")
def mallory(node):
    running, _directory = node
    return tinker_key(node, running.create_org(unique_id("mallory"), {}))


def service_client(node, key: str):
    import tinker

    running, _directory = node
    os.environ["TINKER_TELEMETRY"] = "0"
    return tinker.ServiceClient(base_url=running.url("tinker-api"), api_key=key)


def rest_client(node, key: str):
    import tinker

    running, _directory = node
    return tinker.RestClient(base_url=running.url("tinker-api"), api_key=key)


def sft_datum(sequence: list[int]):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(sequence[:-1]),
        loss_fn_inputs={"target_tokens": sequence[1:], "weights": [1.0] * (len(sequence) - 1)},
    )


def test_the_sdk_trains_a_lora_run_saves_it_and_resumes_it(node, alice, mallory) -> None:
    from tinker import types

    service = service_client(node, alice)
    training = service.create_lora_training_client(base_model=BASE, rank=4).result(timeout=120)
    session_id = service.holder.get_session_id()
    assert training.model_id == f"{session_id}:train:0"
    assert training.get_info().model_data.model_name == BASE
    datum = sft_datum(SEQUENCE)
    losses = []
    for _ in range(4):
        passed = training.forward_backward([datum], "cross_entropy")
        stepped = training.optim_step(types.AdamParams(learning_rate=2e-3))
        out = passed.result(timeout=120)
        assert stepped.result(timeout=120).metrics["grad_norm"] > 0
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(SEQUENCE) - 1
        losses.append(out.metrics["loss:sum"])
    # Summed over the 9 tokens (not normalised), and falling at every step.
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.95 * losses[0], losses
    state = training.save_state("four-steps").result(timeout=120).path
    assert state == f"tinker://{training.model_id}/weights/four-steps"
    before = training.forward([datum], "cross_entropy").result(timeout=120)

    resumed = service.create_training_client_from_state_with_optimizer(state).result(timeout=120)
    assert resumed.model_id == f"{session_id}:train:1"
    after = resumed.forward([datum], "cross_entropy").result(timeout=120)
    assert after.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(
        before.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4
    )

    rest = rest_client(node, alice)
    run = rest.get_training_run(training.model_id).result(timeout=60)
    assert run.base_model == BASE and run.is_lora and run.lora_rank == 4
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    listed = rest.list_checkpoints(training.model_id).result(timeout=60)
    assert [c.tinker_path for c in listed.checkpoints] == [state]

    # Another org's key: none of it exists.
    stranger = service_client(node, mallory)
    with pytest.raises(Exception, match=r"404|not found|no training run"):
        rest_client(node, mallory).get_training_run(training.model_id).result(timeout=60)
    with pytest.raises(Exception, match=r"404|no checkpoint"):
        stranger.create_training_client_from_state(state).result(timeout=60)
    service.close("success")
    stranger.close("success")


def test_a_loss_the_node_does_not_train_fails_its_future_naming_the_ones_it_does(
    node, alice
) -> None:
    import tinker

    service = service_client(node, alice)
    training = service.create_lora_training_client(base_model=BASE, rank=2).result(timeout=120)
    with pytest.raises(tinker.RequestFailedError) as refused:
        training.forward_backward([sft_datum(SEQUENCE)], "gspo").result(timeout=120)
    assert "choose one of cross_entropy, importance_sampling, ppo, cispo, dro" in str(refused.value)
    # The run goes on.
    out = training.forward_backward([sft_datum(SEQUENCE)], "cross_entropy").result(timeout=120)
    assert out.metrics["loss:sum"] > 0
    service.close("success")


def test_a_key_that_is_not_an_org_tinker_key_is_refused(node) -> None:
    import httpx

    running, _directory = node
    url = running.url("tinker-api") + "/api/v1/create_session"
    for key, status in (("tml-nonsense", 401), ("", 401), ("rln1.x.y", 401)):
        answer = httpx.post(url, json={}, headers={"X-API-Key": key} if key else {})
        assert answer.status_code == status, answer.text
        assert answer.json()["detail"]
