"""OpenReward environments (openreward==0.1.167, tested with that version) as a multi-turn,
tool-calling Task App. rlnode is the OpenReward client; the environment runs unchanged on an
environment server that speaks OpenReward's protocol: the user's own
`openreward.environments.Server([MyEnv]).run()`, or hosted OpenReward.

    ENVIRONMENT_API_KEY=... PORT=8120 .venvs/openreward/bin/python \
        -m rlnode.environments.openreward --server http://127.0.0.1:8080 --environment myenv
    rlnode taskapp register openreward --command "/path/to/rlnode/.venvs/openreward/bin/python \
        -m rlnode.environments.openreward --server http://127.0.0.1:8080 --environment myenv"

env config (each field optional; the CLI options give the defaults):
    {"server": "http://127.0.0.1:8080", "environment": "myenv", "split": "train",
     "eval_split": "test", "max_turns": 10}
`environment`: on a server of your own, an Environment class's name in lower case (what its
/list_environments lists; none: the server's first); on hosted OpenReward
(--server https://sessions.openreward.ai, OPENREWARD_API_KEY set) "owner/name", untested here.

Seeds: a rollout of seed s plays task s mod N of the split (N: its number of tasks): mode "rl"
in `split`, mode "eval" in `eval_split`, which must be another split, so an evaluation round
plays the environment's held-out tasks, never its training ones.

What it translates, all through OpenReward's own client (AsyncEnvironmentsAPI, unchanged): a
session on the task (`env.session(split=, index=)`); its prompt as OpenAI chat messages
(`session.get_messages(format="openai")`); its tools as OpenAI `tools` (each ToolSpec's schema
through `sanitize_tool_schema(schema, "openai")`, in chat completions' function envelope).
Each turn the policy answers; each tool call it makes runs on the server (`session.call_tool`)
and its output comes back as a `tool` message (`convert_messages` of a ToolResultBlock), until
an output says `finished` or `max_turns` turns have passed. A reply that calls no tool goes to
the environment's `@terminal` tool if it has one (OpenReward's convention: a plain message is
the final answer), else ends the episode with reward 0.

Reward: what the environment's tool outputs carry (`reward`; None counts 0): each turn's step
the sum of its calls' rewards, the episode's return the sum over turns. Each step's info has
every call's tool, arguments, text, reward, finished and metadata; metrics.details
`finished` is 1 for an episode a tool output finished (not cut by max_turns or a reply with
no tool call).

The policy's mistakes (an unknown tool, arguments that are not JSON or fail the tool's schema)
come back to it as tool messages beginning "error:". The environment's failures fail that
rollout: a tool that raised (OpenReward's ToolFailed, with the tool's message), a server that
cannot be reached, an unknown environment or split. A tool that never returns is stopped by
the rollout's `safety.max_time_s` (the rollout is aborted). Episodes run in worker processes
(rlnode.taskapp.Isolated), so that even a client stuck past that deadline is killed.

Network: the client reaches only `server` (aiohttp with trust_env: HTTP(S)_PROXY and NO_PROXY
apply), so a managed Task App under isolated networking needs the server's address in the
gateway's GATEWAY_TASKAPP_ALLOW_TO. OpenReward's `Server.run()` starts a version check against
pypi.org in a daemon thread (fails silently offline); OPENREWARD_DISABLE_UPDATE_CHECK=1 turns
it off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import aiohttp
from openreward import AsyncEnvironmentsAPI, convert_messages, sanitize_tool_schema
from openreward.api.environments.client import AsyncEnvironment, AsyncSession
from openreward.api.environments.types import Message, TextBlock, ToolOutput, ToolResultBlock
from openreward.api.errors import MaxRetriesError, ToolCallError, ToolFailed

from rlnode.taskapp import Episode, Isolated, TaskAppDefinition, serve

CONFIG_FIELDS = ("server", "environment", "split", "eval_split", "max_turns")
NO_PARAMETERS = {"type": "object", "properties": {}}


def settings(defaults: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The episode's settings: the CLI's defaults and the rollout's env config, checked."""
    unknown = sorted(set(config) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"env_config has unknown fields {unknown}: it takes {CONFIG_FIELDS}")
    merged = {**defaults, **config}
    server = merged["server"]
    if server is None:
        raise ValueError(
            "no OpenReward environment server: start the Task App with --server URL or set "
            "env_config.server"
        )
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise ValueError(f"env_config.server must be an http(s) URL, not {server!r}")
    for name in ("split", "eval_split"):
        if not isinstance(merged[name], str) or not merged[name]:
            raise ValueError(f"env_config.{name} must be a split's name, not {merged[name]!r}")
    if merged["eval_split"] == merged["split"]:
        raise ValueError(
            f"env_config.eval_split is the training split {merged['split']!r}: evaluation would "
            "replay training tasks; name another split of the environment"
        )
    if merged["environment"] is not None and not isinstance(merged["environment"], str):
        raise ValueError(f"env_config.environment must be a name, not {merged['environment']!r}")
    turns = merged["max_turns"]
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"env_config.max_turns must be a whole number >= 1, not {turns!r}")
    return merged


def chat_tools(specs: list[Any]) -> list[dict[str, Any]]:
    """OpenReward's tool specs as OpenAI chat-completions `tools`."""
    return [
        {
            "type": "function",
            "function": {
                "name": spec.name,
                "description": spec.description,
                "parameters": sanitize_tool_schema(spec.input_schema, "openai") or NO_PARAMETERS,
            },
        }
        for spec in specs
    ]


def tool_message(call_id: str, blocks: list[Any], is_error: bool = False) -> dict[str, Any]:
    """A tool's output as the OpenAI `tool` message OpenReward's converter makes of it."""
    result = ToolResultBlock(tool_call_id=call_id, blocks=blocks, is_error=is_error)
    [message] = convert_messages([Message(role="user", blocks=[result])], format="openai")
    return message


def described(output: ToolOutput) -> dict[str, Any]:
    return {
        "text": "\n".join(b.text for b in output.blocks if isinstance(b, TextBlock)),
        "reward": output.reward,
        "finished": output.finished,
        "metadata": output.metadata,
    }


async def run_call(
    session: AsyncSession, call: dict[str, Any], call_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One tool call run on the server: what it gave (for the step's info) and its `tool`
    message. The policy's mistakes come back as an error message; a tool that raised fails
    the rollout (ToolFailed, naming the tool)."""
    function = call.get("function") or {}
    name, arguments = str(function.get("name")), function.get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(parsed, dict):
            raise ValueError("not an object")
    except ValueError:
        error = f"error: the arguments of {name} are not a JSON object: {arguments!r}"
        return refused(name, arguments, call_id, error)
    try:
        output = await session.call_tool(name, parsed)
    except ToolCallError as e:  # an unknown tool, or arguments the tool's schema refused
        return refused(name, parsed, call_id, f"error: {e.detail}")
    except ToolFailed as e:
        raise ToolFailed(f"the environment's tool {name!r} raised: {e}") from None
    record = {"tool": name, "arguments": parsed, **described(output)}
    return record, tool_message(call_id, list(output.blocks))


def refused(
    name: str, arguments: Any, call_id: str, error: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A call the policy got wrong: nothing ran, and the error goes back to it."""
    record = {"tool": name, "arguments": arguments, "error": error, "reward": None}
    message = tool_message(call_id, [TextBlock(text=error)], is_error=True)
    return record | {"finished": False}, message


def build(
    server: str | None = None,
    environment: str | None = None,
    split: str = "train",
    eval_split: str = "test",
    max_turns: int = 10,
) -> TaskAppDefinition:
    """The Task App, with the CLI's defaults for the rollout's `env.config`."""
    defaults: dict[str, Any] = {
        "server": server,
        "environment": environment,
        "split": split,
        "eval_split": eval_split,
        "max_turns": max_turns,
    }
    # The defaults themselves (the server may come with each rollout's env config instead).
    settings(defaults, {} if server else {"server": "http://127.0.0.1"})
    # One client per server for the process (its connections are reused across episodes),
    # and each environment's splits and task counts, which OpenReward's servers fix.
    clients: dict[str, AsyncEnvironmentsAPI] = {}
    task_counts: dict[tuple[str, str | None, str], int] = {}

    def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
        return {**settings(defaults, config), "seed": seed}

    def environment_of(task: dict[str, Any]) -> AsyncEnvironment:
        server, name = task["server"], task["environment"]
        if server not in clients:
            api_key = os.environ.get("OPENREWARD_API_KEY") or None
            clients[server] = AsyncEnvironmentsAPI(base_url=server, api_key=api_key)
        if name is None:  # the server's first environment
            return clients[server].get("default")
        # A name without owner is a class on the server: routed by path (its "variant").
        return clients[server].get(name, variant=None if "/" in name else name)

    async def task_count(env: AsyncEnvironment, task: dict[str, Any], field: str) -> int:
        server, name, split = task["server"], task["environment"], task[field]
        key = (server, name, split)
        if key in task_counts:
            return task_counts[key]
        where = f"OpenReward environment {name or '(the default)'} at {server}"
        try:
            splits = await env.list_splits()
        except aiohttp.ClientResponseError as e:
            if e.status == 404:
                raise ValueError(
                    f"the OpenReward server at {server} has no environment {name!r} (404): set "
                    f"env_config.environment to one that {server}/list_environments lists"
                ) from None
            raise RuntimeError(f"{where} answered {e.status}: {e.message}") from None
        except (aiohttp.ClientError, TimeoutError, MaxRetriesError) as e:
            # After the client's retries: what the last one met.
            cause = e.errors[-1] if isinstance(e, MaxRetriesError) and e.errors else e
            raise RuntimeError(
                f"the OpenReward environment server at {server} (--server / env_config.server) "
                f"could not be reached: {type(cause).__name__}: {cause}"
            ) from None
        if split not in splits:
            raise ValueError(
                f"env_config.{field} {split!r} is not a split of {where}: it has {splits}"
            )
        count = await env.num_tasks(split)
        if count < 1:
            raise ValueError(f"split {split!r} of {where} has no tasks (env_config.{field})")
        task_counts[key] = count
        return count

    async def run_episode(task: dict[str, Any], episode: Episode) -> None:
        env = environment_of(task)
        field = "eval_split" if episode.request.mode == "eval" else "split"
        split, max_turns = task[field], task["max_turns"]
        index = task["seed"] % await task_count(env, task, field)
        episode.details["finished"] = 0.0
        async with env.session(split=split, index=index) as session:
            messages: list[dict[str, Any]] = list(await session.get_messages(format="openai"))
            tools = chat_tools(await session.list_tools())
            final_tool = await session.terminal_tool()
            for turn in range(1, max_turns + 1):
                reply = await episode.chat(messages, tools=tools or None)
                observation = {"turn": turn, "split": split, "index": index}
                if not reply.tool_calls and final_tool is None:  # nothing to grade
                    ended: dict[str, Any] = {"ended": "the reply called no tool", "calls": []}
                    episode.step(observation, reply.text, 0.0, done=True, info=ended)
                    return
                if not reply.tool_calls:  # OpenReward's convention: the final answer
                    output = await session.call_terminal_tool(reply.text)
                    calls: list[dict[str, Any]] = [
                        {"tool": final_tool.name, "arguments": reply.text, **described(output)}
                    ]
                    action = reply.text
                else:
                    messages.append(
                        {"role": "assistant", "content": reply.text, "tool_calls": reply.tool_calls}
                    )
                    calls = []
                    for number, call in enumerate(reply.tool_calls):
                        call_id = str(call.get("id") or f"call-{turn}-{number}")
                        record, message = await run_call(session, call, call_id)
                        calls.append(record)
                        messages.append(message)
                        if record["finished"]:  # the server would refuse later calls
                            break
                    action = json.dumps([c.get("function") for c in reply.tool_calls])
                finished = calls[-1]["finished"]
                reward = float(sum(c["reward"] or 0.0 for c in calls))
                info = {"calls": calls, "truncated": not finished and turn == max_turns}
                episode.step(observation, action, reward, finished or turn == max_turns, info)
                if finished:
                    episode.details["finished"] = 1.0
                    return

    return TaskAppDefinition(
        name="openreward",
        description="OpenReward environments, played through OpenReward's client.",
        make_task=make_task,
        run_episode=run_episode,
        dataset={"seeds": "seed s: task s mod N of the split", "config": defaults},
        action_space={"type": "tool_calls", "tools": "the environment's own"},
        rubric={"outcome": "the rewards the environment's tool outputs carry, summed"},
        limits={"max_turns": max_turns},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OpenReward environments as an rlnode Task App")
    parser.add_argument("--server", help="the OpenReward environment server's URL")
    parser.add_argument("--environment", help="its environment (default: its first)")
    parser.add_argument("--split", default="train", help="the training split")
    parser.add_argument("--eval-split", default="test", help="the split evaluation plays")
    parser.add_argument("--max-turns", type=int, default=10, help="policy turns per episode")
    parser.add_argument("--processes", type=int, default=4, help="episodes run at once")
    args, rest = parser.parse_known_args(argv)
    kwargs = {
        "server": args.server,
        "environment": args.environment,
        "split": args.split,
        "eval_split": args.eval_split,
        "max_turns": args.max_turns,
    }
    try:
        build(**kwargs)
    except ValueError as e:
        parser.error(f"{e} (the command line's --options give the env config's defaults)")
    return serve(Isolated(build, kwargs, processes=args.processes), rest)


if __name__ == "__main__":
    sys.exit(main())
