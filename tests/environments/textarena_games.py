"""Two TextArena games of the tests' own, registered with TextArena's `register` (the library
otherwise unchanged): one whose engine hangs on a move and one whose engine raises, standing
in for a buggy game. `build` is the adapter's, with them registered in the worker too."""

from __future__ import annotations

from typing import Any

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from rlnode.environments import textarena as adapter
from rlnode.taskapp import TaskAppDefinition

HANGING_GAME = "RlnodeTestHangingGame-v0"
RAISING_GAME = "RlnodeTestRaisingGame-v0"


class _BrokenGame(ta.Env):
    def __init__(self, breaks: str) -> None:
        self.breaks = breaks

    def reset(self, num_players: int, seed: int | None = None) -> None:
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=5)
        self.state.reset(
            game_state={},
            player_prompt_function=lambda player_id, game_state: "Say [anything].",
        )

    def step(self, action: str) -> tuple[bool, dict[str, Any]]:
        if self.breaks == "hang":
            while True:  # an engine stuck in a loop, holding the GIL
                pass
        raise RuntimeError("the referee lost the rulebook")


for game_id, breaks in ((HANGING_GAME, "hang"), (RAISING_GAME, "raise")):
    if game_id not in ENV_REGISTRY:
        ta.register(
            id=game_id,
            entry_point=lambda breaks=breaks: _BrokenGame(breaks),
            default_wrappers=[ta.wrappers.LLMObservationWrapper],
        )


def build(**kwargs: Any) -> TaskAppDefinition:
    return adapter.build(**kwargs)
