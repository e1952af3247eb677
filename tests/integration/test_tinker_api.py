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
from rlnode.node import chaos
from rlnode.node.chaos import Supervision
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
        data_dir=directory / "node",
        env={
            "tinker-api": {"TINKER_API_BASE_MODELS": models},
            # A test that fails leaves its session's runs open: the others still start theirs.
            "learner": {"LEARNER_MAX_TINKER_RUNS": "16"},
        },
    )
    with LocalNode(options) as running:
        supervision = Supervision(running)  # as `rlnode up` does: what dies starts again
        supervision.start()
        try:
            yield running, directory
        finally:
            supervision.stop()


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
    # A checkpoint of adapters of another rank cannot be loaded into it: refused, not broken.
    other = service.create_lora_training_client(base_model=BASE, rank=4).result(timeout=120)
    path = other.save_state("rank-four").result(timeout=120).path
    with pytest.raises(tinker.BadRequestError, match="LoRA rank 4"):
        training.load_state(path).result(timeout=120)
    assert training.forward([sft_datum(SEQUENCE)], "cross_entropy").result(timeout=120)
    service.close("success")


def test_a_call_sent_again_gets_its_first_future(node, alice) -> None:
    """The SDK sends a call again (same seq_id, a new idempotency key) when it did not hear
    the answer in time, as it did in CI under load: the resend gets the first call's future,
    even once that call is done (a named checkpoint then exists, a model too); another call
    on a seq_id in use is refused, naming it."""
    import httpx

    running, _directory = node
    service = service_client(node, alice)
    training = service.create_lora_training_client(base_model=BASE, rank=2).result(timeout=120)
    api = running.url("tinker-api") + "/api/v1"

    def post(route: str, body: dict, key: str = "") -> dict:
        headers = {"X-API-Key": alice, "X-Idempotency-Key": key or unique_id("key")}
        answer = httpx.post(f"{api}/{route}", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def result(request_id: str) -> dict:
        answer = {"type": "try_again"}
        while answer.get("type") == "try_again":  # the server long-polls: no busy loop
            answer = post("retrieve_future", {"request_id": request_id})
        return answer

    save = {"model_id": training.model_id, "path": "resent", "seq_id": 1}
    first = post("save_weights", save)["request_id"]
    assert result(first)["path"].endswith("/weights/resent")
    assert post("save_weights", save)["request_id"] == first  # not a 409: it exists
    other = post("optim_step", {**save, "adam_params": {"learning_rate": 1e-3}})["request_id"]
    assert "seq_id 1 of model" in result(other)["error"]
    assert "used already by another call" in result(other)["error"]

    session_id = training.model_id.split(":train:")[0]
    create = {"session_id": session_id, "model_seq_id": 99, "base_model": BASE}
    created = post("create_model", {**create, "lora_config": {"rank": 2}})["request_id"]
    assert post("create_model", {**create, "lora_config": {"rank": 2}})["request_id"] == created
    assert result(created)["type"] == "create_model"
    service.close("success")


def test_a_key_that_is_not_an_org_tinker_key_is_refused(node) -> None:
    import httpx

    running, _directory = node
    url = running.url("tinker-api") + "/api/v1/create_session"
    for key, status in (("tml-nonsense", 401), ("", 401), ("rln1.x.y", 401)):
        answer = httpx.post(url, json={}, headers={"X-API-Key": key} if key else {})
        assert answer.status_code == status, answer.text
        assert answer.json()["detail"]


def test_a_sequence_learned_is_sampled_back_with_the_trainers_logprobs(node, alice) -> None:
    """The end-to-end check: overfit one sequence with cross_entropy, save the weights for
    the sampler, sample the sequence back greedily from its first tokens, and find the
    sampler's logprobs of it within 0.1 of the trainer's, token for token. (Adapters on the
    tiny model make every next token of the sequence the most likely one in 25 steps; its
    loss stays near 30 because its frozen tied embeddings bound its logits.)"""
    from tinker import types

    service = service_client(node, alice)
    training = service.create_lora_training_client(base_model=BASE, rank=8).result(timeout=120)
    datum = sft_datum(SEQUENCE)
    for _ in range(25):
        passed = training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2))
    final = passed.result(timeout=300).metrics["loss:sum"]
    sampler = training.save_weights_and_get_sampling_client().result(timeout=300)
    prefix = 3
    sampled = sampler.sample(
        types.ModelInput.from_ints(SEQUENCE[:prefix]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=len(SEQUENCE) - prefix, temperature=0.0),
        include_prompt_logprobs=True,
    ).result(timeout=300)
    (sequence,) = sampled.sequences
    assert sequence.tokens == SEQUENCE[prefix:], (final, sequence.tokens)
    trainer = training.forward([datum], "cross_entropy").result(timeout=120)
    trained = trainer.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(sequence.logprobs) == len(trained[prefix - 1 :])
    for sampler_lp, trainer_lp in zip(sequence.logprobs, trained[prefix - 1 :], strict=True):
        assert abs(sampler_lp - trainer_lp) < 0.1
    assert sampled.prompt_logprobs[0] is None
    assert sampled.prompt_logprobs[1:] == pytest.approx(trained[: prefix - 1], abs=0.1)
    service.close("success")


def test_sampling_sessions_of_the_base_model_and_of_named_weights(node, alice, mallory) -> None:
    import tinker
    from tinker import types

    service = service_client(node, alice)
    base = service.create_sampling_client(base_model=BASE).result(timeout=60)
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    prompt = types.ModelInput.from_ints(SEQUENCE[:3])
    first = base.sample(prompt, num_samples=2, sampling_params=params).result(timeout=300)
    again = base.sample(prompt, num_samples=2, sampling_params=params).result(timeout=300)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]  # seeded
    assert len({s.sequence_id for s in first.sequences}) == 2
    training = service.create_lora_training_client(base_model=BASE, rank=2).result(timeout=120)
    path = training.save_weights_for_sampler("kept").result(timeout=300).path
    assert path == f"tinker://{training.model_id}/sampler_weights/kept"
    named = service.create_sampling_client(model_path=path).result(timeout=60)
    assert named.get_base_model() == BASE
    out = named.sample(prompt, num_samples=1, sampling_params=params).result(timeout=300)
    assert len(out.sequences[0].tokens) == len(out.sequences[0].logprobs) > 0
    with pytest.raises(Exception, match=r"not served here"):
        service.create_sampling_client(base_model="/etc").result(timeout=60)
    stranger = service_client(node, mallory)
    with pytest.raises((tinker.TinkerError, ValueError), match=r"404|no checkpoint"):
        stranger.create_sampling_client(model_path=path).result(timeout=60)
    service.close("success")
    stranger.close("success")


def _train(training, datum, steps: int, lr: float = 2e-3) -> list:
    """Queue `steps` passes and optimizer steps (the SDK pipelines them); their futures."""
    from tinker import types

    futures = []
    for _ in range(steps):
        futures.append(training.forward_backward([datum], "cross_entropy"))
        futures.append(training.optim_step(types.AdamParams(learning_rate=lr)))
    return futures


def test_a_learner_killed_mid_run_loses_no_call_and_applies_none_twice(node, alice) -> None:
    """SIGKILL the learner with calls in flight: supervision starts it again, the run
    resumes from its last checkpoint and the calls after it are run again; every pending
    future completes, the optimizer has taken each step once, and the weights are those of
    the same calls made without a kill."""
    running, _directory = node
    service = service_client(node, alice)
    datum = sft_datum(SEQUENCE)
    clean = service.create_lora_training_client(base_model=BASE, rank=4).result(timeout=120)
    for future in _train(clean, datum, 5):
        future.result(timeout=120)
    expected = clean.forward([datum], "cross_entropy").result(timeout=120)

    killed = service.create_lora_training_client(base_model=BASE, rank=4).result(timeout=120)
    for future in _train(killed, datum, 2):
        future.result(timeout=120)
    pending = _train(killed, datum, 3)
    pid = chaos.kill(running, "learner", {})
    results = [future.result(timeout=300) for future in pending]
    steps = [r.metrics["step"] for r in results[1::2]]
    assert steps == [3.0, 4.0, 5.0], steps  # each step once, in order
    assert running.processes["learner"].proc.pid != pid  # started again
    after = killed.forward([datum], "cross_entropy").result(timeout=120)
    assert after.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(
        expected.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4
    )
    service.close("success")


def test_two_orgs_train_at_once_and_each_sees_only_its_own(node, alice, mallory) -> None:
    clients = {key: service_client(node, key) for key in (alice, mallory)}
    runs = {
        key: client.create_lora_training_client(base_model=BASE, rank=2).result(timeout=120)
        for key, client in clients.items()
    }
    datum = sft_datum(SEQUENCE)
    in_flight = {key: _train(run, datum, 2) for key, run in runs.items()}  # interleaved
    for futures in in_flight.values():
        assert [f.result(timeout=300).metrics["step"] for f in futures[1::2]] == [1.0, 2.0]
    for key, run in runs.items():
        path = run.save_state("mine").result(timeout=120).path
        listed = rest_client(node, key).list_training_runs(limit=100).result(timeout=60)
        ids = {r.training_run_id for r in listed.training_runs}
        assert run.model_id in ids
        others = {r.model_id for k, r in runs.items() if k != key}
        assert not ids & others
        assert path in {
            c.tinker_path
            for c in rest_client(node, key).list_user_checkpoints().result(timeout=60).checkpoints
        }
    for client in clients.values():
        client.close("success")
