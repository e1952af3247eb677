"""DAPO ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Yu et al. 2025):
GRPO's token mean with
- clip-higher: separate ε_low and ε_high (0.2 and 0.28), so unlikely tokens that earned
  their advantage can grow (entropy does not collapse);
- dynamic sampling: groups whose rewards are all equal teach nothing; the learner drops
  them and samples more prompts for the step until it has `prompts_per_step` groups that
  differ (at most `training.dapo.max_refills` more rounds; rlnode.training.loop);
- the soft overlong penalty: a completion within `overlong_buffer` tokens of
  sampling.max_tokens loses reward linearly, up to `overlong_penalty` at the limit
  (`overlong_shaped`, applied before advantages).
"""

from __future__ import annotations

from rlnode.training.losses.grpo import GRPO


class DAPO(GRPO):
    name = "dapo"
    default_clip = (0.2, 0.28)


def overlong_shaped(
    reward: float, completion_tokens: int, max_tokens: int, buffer: int, penalty: float
) -> float:
    """The reward less DAPO's soft overlong penalty: 0 up to max_tokens - buffer, then
    linear to `penalty` at max_tokens (and beyond)."""
    if buffer <= 0:
        return reward
    into = completion_tokens - (max_tokens - buffer)
    if into <= 0:
        return reward
    return reward - penalty * min(1.0, into / buffer)
