"""TextArena games (textarena==0.7.4, tested with that version) as a multi-turn Task App.

    ENVIRONMENT_API_KEY=... PORT=8110 python -m rlnode.environments.textarena --game TicTacToe-v0
    rlnode taskapp register textarena --command "python -m rlnode.environments.textarena"

env config (each field optional; the CLI options give the defaults):
    {"game": "GuessTheNumber-v0", "max_turns": 30, "player": 0, "num_players": null}

What it translates, unchanged: the game is `textarena.make(game)` with the wrappers TextArena
registered for that id (e.g. LLMObservationWrapper + ActionFormattingWrapper for "-v0"),
reset with the rollout's `env.seed`, so one seed is one game. The episode is one chat that
grows: TextArena's own system prompt (STANDARD_GAME_PROMPT), the first observation, then per
turn the policy's reply verbatim and, as a user message, what the game said since. Each
turn's prompt is the previous prompt and completion token for token, so rlnode trains the
episode as one sequence. An observation that extends the last one the seat saw (the
cumulative wrappers) is sent as only its new part; one that does not is sent whole.

Reward: TextArena's own end-of-game reward for the policy's seat, `env.close()[0][player]`,
on the policy's last step (every other step 0), so the episode return is that reward.
Two-player games give +1 win, -1 loss (an invalid move after its one retry counts as a
loss), 0 draw; one-player games give what the game sets, e.g. GuessTheNumber 1 for a find,
else how close the last guess was (0..1). Each step's info has TextArena's step info; the
last one its `game_info` for the seat (reason, invalid_move, turn_count) and every seat's
reward. An episode that reaches `max_turns` policy turns first stops there: reward 0 and
`truncated: true` on its last step.

The other seats are played by `RandomLegalOpponent`, seeded by the rollout's seed, never by
the policy (every inference call is trained on): TextArena ships no non-LLM agent, so it
plays a uniformly random move among those the game lists in [brackets] on the last line of
its observation that lists any ("Available Moves: '[0]', '[4]'" in TicTacToe). It plays
TicTacToe, WildTicTacToe, Othello, KuhnPoker, IteratedPrisonersDilemma; a game that lists
no moves (ConnectFour, Breakthrough, Battleship) fails the rollout saying so, and one whose
last bracketed line is an example, not a list (Nim), makes it lose by invalid moves.

Offline (checked here) the one-player GuessTheNumber, TowerOfHanoi, Sudoku, Minesweeper,
Countdown, FrozenLake, Mastermind and Crosswords run. The word games (Wordle, Hangman,
WordLadder, SpellingBee, WordSearch, WordChains, Codenames, ...) call `nltk.download` on
import, which tries raw.githubusercontent.com, then fail with NLTK's LookupError "Resource
'words' not found": install the data where the app runs (`python -m nltk.downloader words
averaged_perceptron_tagger_eng`). Games judged by an LLM (TwentyQuestions, ...) need an
OpenRouter key and the network; Chess, Checkers and ReverseTicTacToe do not import on
Python 3.11 (SyntaxError in their f-strings). Each reports its game and error as that
rollout's failure.

Game engines can hang or raise, and TextArena seeds the process-wide `random`: the app runs
episodes in worker processes (rlnode.taskapp.Isolated), one at a time per worker.
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
import sys
from typing import Any

import textarena as ta
from textarena.agents.basic_agents import STANDARD_GAME_PROMPT
from textarena.envs.registration import ENV_REGISTRY

from rlnode.taskapp import Episode, Isolated, TaskAppDefinition, serve

CONFIG_FIELDS = ("game", "max_turns", "player", "num_players")
BRACKETED = re.compile(r"\[[^\[\]\n]+\]")
NLTK_RESOURCE = re.compile(r"Resource '?([\w./-]+)'? not found")


def check_game(game: str) -> str:
    """`game` if TextArena registers it with an observation wrapper (chat needs text), else
    an error that says what to use instead."""
    spec = ENV_REGISTRY.get(game)
    if spec is None:
        close = difflib.get_close_matches(game, list(ENV_REGISTRY), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. GuessTheNumber-v0"
        raise ValueError(
            f"game {game!r} is not a TextArena {ta.__version__} game: {hint} "
            "(all ids: textarena.envs.registration.ENV_REGISTRY)"
        )
    wrappers = spec.default_wrappers or []
    if not any(issubclass(w, ta.ObservationWrapper) for w in wrappers):
        raise ValueError(
            f"game {game!r} has no TextArena observation wrapper, so its observations are not "
            "text (a '-raw' id): use the id without '-raw'"
        )
    return game


def unrunnable(game: str, error: Exception) -> RuntimeError:
    """What TextArena raised making or resetting `game`, said with the fix where there is one."""
    if isinstance(error, LookupError):  # NLTK data, which the word games download on import
        found = NLTK_RESOURCE.search(str(error))
        resource = found.group(1) if found else "words"
        return RuntimeError(
            f"TextArena game {game!r} needs the NLTK data {resource!r}, which is not installed "
            f"here (NLTK raised LookupError: Resource {resource!r} not found, after failing to "
            f"download it). Install it where the Task App runs: `python -m nltk.downloader "
            f"{resource}` (the word games also use averaged_perceptron_tagger_eng), or set "
            "NLTK_DATA to a folder that has it."
        )
    return RuntimeError(
        f"TextArena game {game!r} could not be started: {type(error).__name__}: {error}"
    )


def open_game(game: str, seed: int, num_players: int | None) -> tuple[Any, int]:
    """The game made and reset for `seed`, and its number of players: `num_players`, or the
    fewest of 1 and 2 that the game accepts (its reset checks its own rule)."""
    refusals = []
    for players in [num_players] if num_players else [1, 2]:
        try:
            env = ta.make(game)
        except Exception as e:
            raise unrunnable(game, e) from None
        try:
            env.reset(num_players=players, seed=seed)
        except (AssertionError, ValueError) as e:  # how TextArena's games refuse a count
            if num_players:
                raise ValueError(f"TextArena game {game!r} refused num_players: {e}") from None
            refusals.append(f"{players}: {e}")
            continue
        except Exception as e:
            raise unrunnable(game, e) from None
        return env, players
    raise ValueError(
        f"TextArena game {game!r} takes neither 1 nor 2 players ({'; '.join(refusals)}): "
        "set env_config.num_players"
    )


class RandomLegalOpponent:
    """A seat the policy does not play: a uniformly random move among those the game listed
    in [brackets] on the last line of its observation that lists any (not a line that
    repeats a player's move), without repeating a move the game refused."""

    def __init__(self, rng: random.Random, role_mapping: dict[int, str]) -> None:
        self.rng = rng
        self.role_tags = {f"[{name}]" for name in role_mapping.values()}  # who spoke
        self.player_tags = tuple(f"[{n}]" for pid, n in role_mapping.items() if pid != ta.GAME_ID)
        self.moves: list[str] = []

    def act(self, game: str, new_observation: str) -> str:
        for line in reversed(new_observation.splitlines()):
            if line.startswith(self.player_tags):
                continue
            listed = [m for m in BRACKETED.findall(line) if m not in self.role_tags]
            if listed:
                self.moves = listed
                break
        if not self.moves:
            raise RuntimeError(
                f"TextArena game {game!r} lists no moves in [brackets] to the opponent, so "
                "the built-in random opponent cannot play it: choose a game that does"
            )
        move = self.rng.choice(self.moves)
        self.moves.remove(move)
        return move


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def build(game: str = "GuessTheNumber-v0", max_turns: int = 30) -> TaskAppDefinition:
    """The Task App, with the CLI's defaults for the rollout's `env.config`."""
    defaults: dict[str, Any] = {"game": game, "max_turns": max_turns, "player": 0}

    def settings(config: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(config) - set(CONFIG_FIELDS))
        if unknown:
            raise ValueError(f"env_config has unknown fields {unknown}: it takes {CONFIG_FIELDS}")
        merged = {**defaults, **config}
        for name, least in (("max_turns", 1), ("player", 0), ("num_players", 1)):
            value = merged.get(name)
            if value is None and name == "num_players":
                continue  # the game's own count
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"env_config.{name} must be a whole number >= {least}, not {value!r}"
                )
        if not isinstance(merged["game"], str):
            raise ValueError(f"env_config.game must be a TextArena env id, not {merged['game']!r}")
        check_game(merged["game"])
        return merged

    settings({})  # the defaults themselves

    def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
        task = settings(config)
        env, players = open_game(task["game"], seed, task.get("num_players"))
        if task["player"] >= players:
            raise ValueError(
                f"env_config.player {task['player']} is not a seat of {task['game']!r}, "
                f"which has {players} players (seats 0..{players - 1})"
            )
        _, first_observation = env.get_observation()
        return {**task, "num_players": players, "seed": seed, "observation": first_observation}

    async def run_episode(task: dict[str, Any], episode: Episode) -> None:
        game, player, seed = task["game"], task["player"], task["seed"]
        env, _ = open_game(game, seed, task["num_players"])
        opponents = {
            seat: RandomLegalOpponent(random.Random(f"{seed}:{seat}"), env.state.role_mapping)
            for seat in range(task["num_players"])
            if seat != player
        }
        messages: list[dict[str, Any]] = [{"role": "system", "content": STANDARD_GAME_PROMPT}]
        seen = {seat: "" for seat in range(task["num_players"])}
        # The policy's last turn, recorded once the game has answered it.
        last: dict[str, Any] | None = None
        turns, done, truncated = 0, False, False
        while not done:
            seat, observation = env.get_observation()
            said = seen[seat]
            new = observation[len(said) :] if observation.startswith(said) else observation
            seen[seat] = observation
            if seat != player:
                done, _ = env.step(action=opponents[seat].act(game, new))
                continue
            if turns == task["max_turns"]:
                truncated = True
                break
            if last:
                episode.step(last["observation"], last["action"], 0.0, info=last["info"])
            messages.append({"role": "user", "content": new.strip()})
            answer = await episode.chat(messages)
            messages.append({"role": "assistant", "content": answer.text})
            turns += 1
            done, step_info = env.step(action=answer.text)
            last = {
                "observation": {"turn": turns, "observation": new.strip()},
                "action": answer.text,
                "info": {"textarena": _json_safe(step_info), "finish_reason": answer.finish_reason},
            }
        if last is None:
            raise RuntimeError(f"TextArena game {game!r} ended before seat {player} played")
        reward, info = 0.0, {**last["info"], "truncated": truncated}
        if not truncated:
            rewards, game_info = env.close()
            reward = float((rewards or {}).get(player, 0.0))
            info["rewards"] = _json_safe(rewards)
            info["game_info"] = _json_safe((game_info or {}).get(player))
        episode.step(last["observation"], last["action"], reward, done=True, info=info)

    return TaskAppDefinition(
        name="textarena",
        description=f"TextArena {ta.__version__} games, the policy playing one seat.",
        version=ta.__version__,
        make_task=make_task,
        run_episode=run_episode,
        dataset={"seeds": "any integer: one seed, one game", "config": defaults},
        rubric={"outcome": "TextArena's end-of-game reward for the policy's seat"},
        limits={"max_turns": max_turns},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TextArena games as an rlnode Task App")
    parser.add_argument("--game", default="GuessTheNumber-v0", help="TextArena env id")
    parser.add_argument("--max-turns", type=int, default=30, help="policy turns per episode")
    parser.add_argument("--processes", type=int, default=4, help="episodes run at once")
    args, rest = parser.parse_known_args(argv)
    kwargs = {"game": args.game, "max_turns": args.max_turns}
    try:
        build(**kwargs)
    except ValueError as e:
        parser.error(f"--game/--max-turns: {e}")
    return serve(Isolated(build, kwargs, processes=args.processes), rest)


if __name__ == "__main__":
    sys.exit(main())
