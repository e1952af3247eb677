"""TextArena games (rlnode.environments.textarena) served on loopback as the adapter serves
them (episodes in worker processes), played by a scripted policy on a real HTTP endpoint
that answers chosen moves and keeps every request it was sent."""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

import httpx
import pytest
from fastapi import Request

from rlnode.taskapp import Isolated, create_task_app
from rlnode.testing import ThreadedServer
from tests.environments import textarena_games
from tests.integration.fakes import RecordingPolicy

KEY = "textarena-test-key-0123456789"

# For the lead's node test: the managed Task App's command and a 1-2 step job's env_config
# (GuessTheNumber: one seat, 1..20, each turn one short reply; a tiny model mostly loses,
# which TextArena scores by how close its last guess was).
REGISTER_COMMAND = "python -m rlnode.environments.textarena --game GuessTheNumber-v0"
NODE_JOB_ENV_CONFIG = {"game": "GuessTheNumber-v0", "max_turns": 3}


class ScriptedPlayer(RecordingPolicy):
    """An OpenAI-compatible endpoint whose `model` names how it plays."""

    async def chat(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.record(body)
        messages = body["messages"]
        match body["model"]:
            case "binary-search":  # GuessTheNumber, from the hints so far
                low, high = map(
                    int, re.findall(r"between (\d+) and (\d+)", messages[1]["content"])[0]
                )
                for said, heard in zip(messages[2::2], messages[3::2], strict=False):
                    guess = int(re.findall(r"\[(\d+)\]", said["content"])[0])
                    if "higher" in heard["content"]:
                        low = guess + 1
                    elif "lower" in heard["content"]:
                        high = guess - 1
                text = f"My guess is [{(low + high) // 2}].\n"
            case "first-free-cell":  # TicTacToe: the first move the board offers
                offered = re.findall(r"Available Moves: (.*)", messages[-1]["content"])[-1]
                text = "I take " + re.findall(r"\[\d\]", offered)[0]
            case _:
                text = "I would rather not play."
        return self.completion(body, {"role": "assistant", "content": text}, "stop")


@pytest.fixture(scope="module")
def player():
    scripted = ScriptedPlayer()
    with ThreadedServer(scripted.app) as server:
        scripted.url = server.url
        yield scripted


@pytest.fixture(scope="module")
def app_url():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ENVIRONMENT_API_KEY", KEY)
        spec = Isolated(
            textarena_games.build,
            {"game": "GuessTheNumber-v0", "max_turns": 12},
            processes=2,
            task_timeout_s=20,
        )
        with ThreadedServer(create_task_app(spec)) as server:
            yield server.url


def rollout(
    app_url: str, policy: ScriptedPlayer, seed: int, model: str, max_time_s: float = 30, **config
) -> httpx.Response:
    body = {
        "run_id": f"run-{seed}",
        "env": {"seed": seed, "config": config},
        "policy": {"config": {"inference_url": policy.url, "model": model}},
        "safety": {"max_time_s": max_time_s},
    }
    policy.take()
    return httpx.post(app_url + "/rollout", json=body, headers={"X-API-Key": KEY}, timeout=60)


def steps_of(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return response.json()["trajectories"][0]["steps"]


def test_a_found_number_earns_textarenas_win_reward(app_url, player) -> None:
    response = rollout(app_url, player, 7, "binary-search")
    steps = steps_of(response)
    assert response.json()["metrics"]["mean_return"] == 1.0
    assert [s["reward"] for s in steps] == [0.0] * (len(steps) - 1) + [1.0]
    assert steps[-1]["done"] and steps[-1]["info"]["game_info"]["reason"].startswith("Congrat")
    assert response.json()["metrics"]["details"]["inference_calls"] == len(steps)


def test_invalid_moves_earn_the_lower_reward(app_url, player) -> None:
    # One retry after an invalid move, then TextArena ends the game: GuessTheNumber scores
    # how close the last valid guess was (none: 0), TicTacToe counts it a loss (-1).
    for game, lower in (("GuessTheNumber-v0", 0.0), ("TicTacToe-v0", -1.0)):
        steps = steps_of(rollout(app_url, player, 7, "refuses", game=game))
        assert len(steps) == 2 and steps[-1]["reward"] == lower, game
        assert steps[-1]["info"]["game_info"]["invalid_move"] is True


def test_each_prompt_is_the_last_one_and_its_reply_verbatim(app_url, player) -> None:
    steps_of(rollout(app_url, player, 5, "binary-search"))  # 20: five guesses
    bodies = player.take()
    assert len(bodies) == 5
    assert [m["role"] for m in bodies[0]["messages"]] == ["system", "user"]
    for before, after in itertools.pairwise(bodies):
        history = before["messages"]
        # the reply exactly as the policy sent it, trailing newline included
        reply = {"role": "assistant", "content": after["messages"][len(history)]["content"]}
        assert reply["content"].startswith("My guess is [") and reply["content"].endswith(".\n")
        assert after["messages"][: len(history) + 1] == [*history, reply]
        assert [m["role"] for m in after["messages"][len(history) + 1 :]] == ["user"]


def test_the_policy_plays_one_seat_and_a_seeded_opponent_the_other(app_url, player) -> None:
    transcripts: dict[int, list[dict[str, Any]]] = {}
    outcomes: set[float] = set()
    for seed in (0, 1, 2, 3, 0):
        response = rollout(app_url, player, seed, "first-free-cell", game="TicTacToe-v0")
        steps, bodies = steps_of(response), player.take()
        assert len(bodies) == len(steps)  # the opponent never asked the policy
        final = steps[-1]["info"]
        reason, reward = final["game_info"]["reason"], steps[-1]["reward"]
        assert reward == (1.0 if "Player 0 has won" in reason else -1.0 if "won" in reason else 0.0)
        assert not final["rewards"] or final["rewards"]["0"] == reward
        outcomes.add(reward)
        transcript = bodies[-1]["messages"]
        assert transcripts.setdefault(seed, transcript) == transcript  # same seed, same game
    assert 1.0 in outcomes
    assert len({str(t) for t in transcripts.values()}) > 1  # the opponent's moves follow the seed


def test_same_seed_same_game_and_eval_seeds_other_games(app_url, player) -> None:
    def first_board(seed: int) -> str:
        steps_of(rollout(app_url, player, seed, "refuses", game="Sudoku-v0"))
        return player.take()[0]["messages"][1]["content"]

    training = [first_board(seed) for seed in (0, 1, 2)]
    held_out = [first_board(seed) for seed in (1_000_000, 1_000_001, 1_000_002)]
    assert first_board(1) == training[1]
    assert len(set(training + held_out)) == 6


def test_max_turns_truncates_with_no_reward(app_url, player) -> None:
    steps = steps_of(rollout(app_url, player, 7, "binary-search", max_turns=2))
    assert len(steps) == 2 and steps[-1]["done"]
    assert steps[-1]["reward"] == 0.0 and steps[-1]["info"]["truncated"] is True


def test_a_game_that_hangs_is_stopped_by_the_rollout_timeout(app_url, player) -> None:
    started = time.monotonic()
    hung = rollout(app_url, player, 1, "refuses", max_time_s=1, game=textarena_games.HANGING_GAME)
    assert hung.status_code == 504 and "killed and replaced" in hung.json()["detail"]
    assert time.monotonic() - started < 15
    assert steps_of(rollout(app_url, player, 7, "binary-search"))[-1]["reward"] == 1.0


def test_a_game_that_raises_is_that_rollouts_failure(app_url, player) -> None:
    raised = rollout(app_url, player, 1, "refuses", game=textarena_games.RAISING_GAME)
    assert raised.status_code == 500
    assert "RuntimeError: the referee lost the rulebook" in raised.json()["detail"]
    assert steps_of(rollout(app_url, player, 7, "binary-search"))[-1]["reward"] == 1.0


def test_bad_games_and_config_are_clear_errors(app_url, player) -> None:
    def detail(**config) -> str:
        response = rollout(app_url, player, 1, "refuses", **config)
        assert response.status_code == 500, response.text
        return response.json()["detail"]

    assert "did you mean GuessTheNumber-v0" in detail(game="GuessTheNumbr-v0")
    assert "use the id without '-raw'" in detail(game="TicTacToe-v0-raw")
    assert "env_config.max_turns must be a whole number >= 1, not 0" in detail(max_turns=0)
    assert "unknown fields ['gmae']" in detail(gmae="TicTacToe-v0")
    assert "env_config.player 1 is not a seat" in detail(player=1)
    wordle = rollout(app_url, player, 1, "refuses", game="Wordle-v0")
    if wordle.status_code == 200:
        pytest.skip("NLTK's data is installed here: Wordle runs")
    assert "python -m nltk.downloader words" in wordle.json()["detail"]
