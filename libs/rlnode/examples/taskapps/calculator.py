"""Calculator: a multi-turn tool-use task. The policy is asked an arithmetic question and is
offered one tool, `calculator(expression)`, through OpenAI `tools`; each call it makes comes
back as a `tool` message with the result, for up to `max_turns` turns, until it answers in
plain text.

Reward: 1 when the last number of the final answer is right, plus `tool_bonus` (0.2) for an
episode that called the calculator with an expression it could evaluate (a shaping term, so
that a model that never called a tool learns to; set it to 0 for the plain outcome).

    ENVIRONMENT_API_KEY=... PORT=8104 python -m rlnode.examples.taskapps.calculator

env config: {"max_operand": 99, "max_turns": 4, "tool_bonus": 0.2}
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import sys
from typing import Any

from rlnode.taskapp import Episode, TaskAppDefinition, serve

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 17 * 23"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression: numbers, + - * /, unary minus, parentheses;
    anything else (names, calls, powers) is a ValueError, as is a long one."""
    if len(expression) > 200:
        raise ValueError("expression too long (200 characters at most)")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"only numbers and + - * / ( ) are allowed: {expression!r}")

    try:
        return value(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


def shown(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:.6g}"


def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(seed)
    high = int(config.get("max_operand", 99))
    a, b, c = (rng.randint(2, high) for _ in range(3))
    first, second = rng.choice("+-*"), rng.choice("+-")
    expression = f"{a} {first} {b} {second} {c}"
    return {
        "question": f"What is {expression}?",
        "answer": evaluate(expression),
        "max_turns": int(config.get("max_turns", 4)),
        "tool_bonus": float(config.get("tool_bonus", 0.2)),
    }


def run_call(call: dict[str, Any]) -> tuple[str, bool]:
    """A tool call's result, and whether it evaluated."""
    function = call.get("function") or {}
    if function.get("name") != "calculator":
        return f"error: no tool {function.get('name')!r}; the tool is calculator", False
    try:
        arguments = json.loads(function.get("arguments") or "{}")
        return shown(evaluate(str(arguments["expression"]))), True
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}", False


async def run_episode(task: dict[str, Any], episode: Episode) -> None:
    messages: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": "Use the calculator tool, then give the final number.",
        },
        {"role": "user", "content": task["question"]},
    ]
    used_tool = False
    for turn in range(1, task["max_turns"] + 1):
        reply = await episode.chat(messages, tools=TOOLS)
        observation = {"turn": turn, "question": task["question"]}
        if reply.tool_calls:
            messages.append(
                {"role": "assistant", "content": reply.text, "tool_calls": reply.tool_calls}
            )
            results = []
            for call in reply.tool_calls:
                result, ok = run_call(call)
                used_tool = used_tool or ok
                results.append(result)
                messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": result})
            last = turn == task["max_turns"]
            bonus = task["tool_bonus"] if last and used_tool else 0.0
            action = json.dumps([c.get("function") for c in reply.tool_calls])
            episode.step(observation, action, bonus, done=last, info={"tool_results": results})
            continue
        numbers = NUMBER.findall(reply.text.replace(",", ""))
        correct = bool(numbers) and abs(float(numbers[-1]) - task["answer"]) < 1e-6
        reward = (1.0 if correct else 0.0) + (task["tool_bonus"] if used_tool else 0.0)
        episode.step(
            observation,
            reply.text,
            reward,
            done=True,
            info={"correct": correct, "used_tool": used_tool, "answer": task["answer"]},
        )
        return


DEFINITION = TaskAppDefinition(
    name="calculator",
    description="Arithmetic with a calculator tool over several turns (OpenAI tool calls).",
    make_task=make_task,
    run_episode=run_episode,
    dataset={"seeds": "any integer", "config": {"max_operand": 99, "max_turns": 4}},
    action_space={"type": "tool_calls", "tools": TOOLS},
    rubric={
        "outcome": "1 if the last number of the final answer is right",
        "shaping": "+tool_bonus (0.2) for an episode with a calculator call that evaluated",
    },
    limits={"max_turns": 4},
)

if __name__ == "__main__":
    sys.exit(serve(DEFINITION))
