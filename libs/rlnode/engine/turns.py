"""One recorded turn of an episode: sample from the policy as the job's sampling config says
(a Task App may only lower `max_tokens`), and record exactly what was sampled: the prompt
and completion token ids, the sampling logprobs and the policy version. The generator's
per-rollout endpoints and the in-process generator both sample through here."""

from __future__ import annotations

from rlnode.engine.base import Engine, EngineError, GenerationRequest, cut_at_stop
from rlnode.messages import SamplingSpec, TokenTurn


class TurnRefused(EngineError):
    """The turn cannot be sampled as asked (says why; a 400 on the HTTP routes)."""


async def sample_turn(
    engine: Engine,
    prompt_ids: list[int],
    sampling: SamplingSpec,
    max_seq_len: int,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
) -> tuple[TokenTurn, str]:
    """The recorded turn and its text (cut before the first stop string)."""
    stop = stop or []
    budget = sampling.max_tokens if max_tokens is None else min(max_tokens, sampling.max_tokens)
    if budget <= 0:
        raise TurnRefused("max_tokens must be positive")
    if len(prompt_ids) + budget > max_seq_len:
        raise TurnRefused(
            f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({budget}) exceed the "
            f"model's {max_seq_len}-token context"
        )
    result = await engine.generate(
        GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=budget,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=stop,
        )
    )
    turn = TokenTurn(
        prompt_ids=prompt_ids,
        completion_ids=result.completion_ids,
        logprobs=result.logprobs,
        policy_version=result.policy_version,
        last_policy_version=result.last_policy_version,
        finish_reason=result.finish_reason,
    )
    text = engine.tokenizer.decode(result.completion_ids, skip_special_tokens=True)
    return turn, cut_at_stop(text, stop)
