"""tinker-cookbook's recipes (0.6.1, unchanged) against a node's Tinker API, offline, on
SmolLM2-135M-Instruct with tiny settings: each runs its steps to "Training completed
successfully" and writes its metrics; math_rl stopped after a step resumes from its saved
state (`behavior_if_log_dir_exists=resume`) in a new session. `renderer_name=qwen3_instruct`
writes SmolLM2's ChatML token for token; the model is named by its directory (the cookbook
reads the tokenizer from it, the node serves it as a base model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlnode.node.local import LocalNode, NodeOptions
from rlnode.sdk.vault import VaultClient
from rlnode.service.auth import TINKER_KEY_PREFIX, Scope
from rlnode.testing import unique_id

COOKBOOK_DATA = Path(__import__("tinker_cookbook").__file__).parent / "example_data"
TINY = ["renderer_name=qwen3_instruct", "behavior_if_log_dir_exists=delete"]
RECIPES = {
    "math_rl": [
        "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic",
        "loss_fn=importance_sampling",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=5",
        "lora_rank=8",
        "eval_every=0",
        "save_every=0",
        "max_steps=2",
    ],
    "chat_sl": [
        "tinker_cookbook.recipes.chat_sl.train",
        f"dataset={COOKBOOK_DATA / 'conversations.jsonl'}",
        "lora_rank=8",
        "batch_size=4",
        "max_length=256",
        "eval_every=0",
        "save_every=0",
        "infrequent_eval_every=0",
        "max_steps=2",
    ],
    # Ten turns of a growing chat: 2,700 tokens an episode, about a minute a step here.
    "guess_number": [
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        "group_size=2",
        "batch_size=1",
        "max_tokens=8",
        "eval_every=0",
        "save_every=0",
        "max_steps=1",
    ],
    "text_arena": [
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
        "batch_size=2",
        "num_train_datapoints=2",
        "num_test_datapoints=2",
        "max_tokens=8",
        "eval_every=0",
        "save_every=0",
        "max_steps=1",
    ],
    "shorter": [
        "tinker_cookbook.recipes.preference.shorter.train",
        "group_size=2",
        "batch_size=2",
        "max_tokens=8",
        "eval_every=0",
        "max_steps=2",
    ],
}


@pytest.fixture(scope="module")
def node(tmp_path_factory, smollm2):
    directory = tmp_path_factory.mktemp("cookbook")
    models = json.dumps({str(smollm2): str(smollm2)})
    options = NodeOptions(
        data_dir=directory / "node", env={"tinker-api": {"TINKER_API_BASE_MODELS": models}}
    )
    with LocalNode(options) as running:
        org = running.create_org(unique_id("org"), {})
        with VaultClient(running.url("credential-vault"), org.token) as vault:
            token = vault.create_token("cookbook", [Scope.TINKER.value], None, org.org_id)
        yield running, TINKER_KEY_PREFIX + token["token"], directory


def recipe(node, smollm2, args: list[str], log_path: Path) -> str:
    running, key, directory = node
    env = {
        **os.environ,
        "TINKER_BASE_URL": running.url("tinker-api"),
        "TINKER_API_KEY": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    module, *settings = args
    command = [sys.executable, "-m", module, f"model_name={smollm2}", f"log_path={log_path}"]
    result = subprocess.run(
        command + settings, env=env, cwd=directory, capture_output=True, text=True, timeout=900
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Training completed successfully" in output, output[-4000:]
    return output


def check_outputs(log_path: Path) -> None:
    """What a recipe that ran leaves: its metrics, and its last state on the node."""
    metrics = (log_path / "metrics.jsonl").read_text().splitlines()
    assert metrics, "the recipe wrote no metrics"
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").open()]
    assert saved[-1]["state_path"].startswith("tinker://")


# math_rl runs in the resume test below (a step, then resumed to its second): once is enough.
@pytest.mark.parametrize("name", [name for name in RECIPES if name != "math_rl"])
def test_a_cookbook_recipe_runs_on_the_node(node, smollm2, name, tmp_path) -> None:
    recipe(node, smollm2, RECIPES[name] + TINY, tmp_path / name)
    check_outputs(tmp_path / name)


def test_math_rl_runs_and_resumes_from_its_saved_state(node, smollm2, tmp_path) -> None:
    log_path = tmp_path / "resumed"
    first = [*RECIPES["math_rl"][:-2], "save_every=1", "renderer_name=qwen3_instruct"]
    recipe(node, smollm2, [*first, "max_steps=1", "behavior_if_log_dir_exists=delete"], log_path)
    output = recipe(
        node, smollm2, [*first, "max_steps=2", "behavior_if_log_dir_exists=resume"], log_path
    )
    assert "Resumed training from tinker://" in output
    check_outputs(log_path)
