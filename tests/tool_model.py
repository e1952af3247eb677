"""A tiny Qwen2-shaped model that already calls the calculator tool, for the tests that train
on tool use: a random tiny model never writes a well-formed tool call by chance, so it is
fine-tuned first (as a real run starts from an instruction-tuned model) on the calculator
Task App's two kinds of turn: the call, and the answer after the tool's result."""

from __future__ import annotations

import json
from pathlib import Path

from rlnode.engine import render_chat
from rlnode.examples.taskapps import calculator
from rlnode.models.build import init_model
from rlnode.models.hf import load_tokenizer
from rlnode.testing import fit_completions

SYSTEM = "Use the calculator tool, then give the final number."


def build_tool_model(
    out: Path, seeds: range = range(200), steps: int = 200, learning_rate: float = 3e-3
) -> Path:
    # Qwen2's shape and tokenizer, narrowed: the prompt (the tools in the system turn) is
    # long, and it is run for every example.
    init_model(out, "tiny-qwen2", seed=0, hidden=64, heads=4, kv_heads=2, intermediate=256)
    tokenizer = load_tokenizer(out)

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    pairs = []
    for seed in seeds:
        task = calculator.make_task(seed, {})
        expression = task["question"].removeprefix("What is ").removesuffix("?")
        asked = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["question"]},
        ]
        arguments = {"expression": expression}
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
        pairs.append(
            (render_chat(tokenizer, asked, calculator.TOOLS), [*ids(call), tokenizer.eos_token_id])
        )
        called = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": arguments},
        }
        answered = [
            *asked,
            {"role": "assistant", "content": "", "tool_calls": [called]},
            {"role": "tool", "tool_call_id": "call_0", "content": calculator.shown(task["answer"])},
        ]
        answer = f"The answer is {calculator.shown(task['answer'])}."
        pairs.append(
            (
                render_chat(tokenizer, answered, calculator.TOOLS),
                [*ids(answer), tokenizer.eos_token_id],
            )
        )
    fit_completions(out, pairs, steps=steps, learning_rate=learning_rate)
    return out
