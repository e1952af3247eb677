"""verifiers environments (Prime Intellect's library; the Environments Hub's format) as an
rlnode Task App, run unchanged by the library's own loader, rollout and rubric. Both its APIs:

- the classic one (verifiers 0.3.1, tested with it): a module with `load_environment(**args)`
  returning a SingleTurnEnv / MultiTurnEnv / ToolEnv with its parser and Rubric, loaded by
  `vf.load_environment(env, **args)`; a rollout is its `env.run_rollout(row, client, model,
  sampling)`, with a verifiers client on `<inference_url>/v1` (not streaming);
- the Taskset API (verifiers 0.4.0, `verifiers.v1`): rlnode.environments.verifiers_v04.

Neither goes in the node's venv; each runs from its own (`make environments`), where the
environment's module must be importable: installed (`.venvs/verifiers-0.3/bin/pip install
./my_env`, as `prime env install` does) or on PYTHONPATH:

    rlnode taskapp register vf-sums --env PYTHONPATH=/path/to/my_envs \
        --command "/path/to/rlnode/.venvs/verifiers-0.3/bin/python \
        -m rlnode.environments.verifiers --env vf_sums"

env config (each field optional; the CLI options --env, --args JSON, ... give the defaults):
    {"env": "vf_sums", "args": {...}, "eval_args": {...}, "agent": {...},
     "heldout_from": 1000000}
`env`: the environment's module (classic) or taskset id (0.4); `args`: `load_environment`'s
keyword arguments (classic) or the taskset's config fields (0.4, `--env.taskset.*`).
`eval_args` (0.4): the taskset config fields, over `args`, that select its held-out tasks
(e.g. {"split": "test"}); `agent` (0.4): its agent seats' config (`--env.agent.*`).

Rows: a rollout is held out when its mode is "eval" or its seed >= `heldout_from`. A training
rollout of seed s plays row s mod N of the environment's training dataset (classic) or of its
tasks (0.4); a held-out one plays row (s - heldout_from, or s) mod M of its eval dataset
(classic) or of the taskset loaded with `eval_args` (0.4). So eval rows are never training
rows, and an environment without an eval dataset (or `eval_args`) fails held-out rollouts.

The environment plays its own rollout (its prompt, parser, turns and tools) against the
rollout's inference URL, with the rollout's model name and sampling over the environment's own
sampling args, and scores it with its own rubric: the episode's reward is the rubric's, and
each reward function's (and metric's) score goes into metrics.details under its name.

Failures fail that rollout: a reward function that raised (the classic rubric logs it and
scores 0: reported here), an error the rollout recorded, a model call that failed (as the
policy's failure, 502). An environment stuck in `await` is stopped by `safety.max_time_s` (the
rollout is aborted); episodes run in worker processes (rlnode.taskapp.Isolated), so one stuck
in a loop is killed at that deadline (504).
"""

from __future__ import annotations

import argparse
import contextvars
import importlib
import importlib.util
import json
import logging
import re
import sys
from importlib.metadata import version
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rlnode.taskapp import Episode, Isolated, TaskAppDefinition, serve
from rlnode.taskapp.inference import InferenceError

CONFIG_FIELDS = ("env", "args", "eval_args", "agent", "heldout_from")
HELDOUT_FROM = 1_000_000
# The classic API logs a reward function that raised (and scores it 0): the rollout's failure.
REWARD_RAISED = re.compile(r"^Error calling (group )?reward function")
_rollout_errors: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "verifiers_rollout_errors", default=None
)


class _RewardErrors(logging.Handler):
    """Collects the classic API's "reward function raised" records for the rollout whose
    context logged them."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _rollout_errors.get()
        if errors is not None and REWARD_RAISED.match(record.getMessage()):
            errors.append(record.getMessage())


def settings(defaults: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"env_config has unknown fields {unknown}: it takes {CONFIG_FIELDS}")
    merged = {**defaults, **config}
    if not isinstance(merged["env"], str) or not merged["env"]:
        raise ValueError(
            "no verifiers environment: start the Task App with --env MODULE or set env_config.env"
        )
    for name in ("args", "eval_args", "agent"):
        if merged[name] is not None and not isinstance(merged[name], dict):
            raise ValueError(f"env_config.{name} must be an object, not {merged[name]!r}")
    heldout_from = merged["heldout_from"]
    if isinstance(heldout_from, bool) or not isinstance(heldout_from, int) or heldout_from < 1:
        raise ValueError(
            f"env_config.heldout_from must be a whole number >= 1, not {heldout_from!r}"
        )
    return merged


def api_base(inference_url: str) -> str:
    """The OpenAI base URL (`.../v1`) of the rollout's inference URL."""
    parts = urlsplit(inference_url)
    path = parts.path.rstrip("/").removesuffix("/chat/completions")
    path = path if path.endswith("/v1") else path + "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def row_index(episode: Episode, heldout_from: int) -> tuple[bool, int]:
    """Whether the rollout is held out, and its row number before wrapping."""
    seed = episode.seed
    held_out = episode.request.mode == "eval" or seed >= heldout_from
    return held_out, seed - heldout_from if seed >= heldout_from else seed


def sampling_of(episode: Episode) -> dict[str, Any]:
    """The rollout's sampling (the job's), over which the environment's own are laid."""
    c = episode.request.policy.config
    chosen = {"max_tokens": c.max_tokens, "temperature": c.temperature, "top_p": c.top_p}
    return {k: v for k, v in chosen.items() if v is not None}


def module_name(env: str) -> str:
    """The module of an environment id, as verifiers' loaders name it (a Hub id "owner/name@v"
    is installed as `name`)."""
    return env.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def located(env: str) -> str:
    """Which API the environment is written for: "classic" (a module with load_environment)
    or "tasksets" (a taskset package, or one verifiers ships)."""
    name = module_name(env)
    if importlib.util.find_spec(name) is not None:
        classic = hasattr(importlib.import_module(name), "load_environment")
        return "classic" if classic else "tasksets"
    if importlib.util.find_spec("verifiers.v1") and importlib.util.find_spec(
        f"verifiers.v1.tasksets.{name}"
    ):
        return "tasksets"
    raise ValueError(
        f"env_config.env {env!r}: no module {name!r} for {sys.executable}: install the "
        f"environment in that venv (its bin/pip install ./{name}) or put it on PYTHONPATH"
    )


class Classic:
    """Plays a rollout of a classic environment: its Environment.run_rollout on one row."""

    def __init__(self) -> None:
        import verifiers as vf

        self.vf = vf
        self.environments: dict[str, Any] = {}
        # After the classic API's first import, which resets the "verifiers" logger's handlers.
        self.load_environment = vf.load_environment
        logging.getLogger("verifiers").addHandler(_RewardErrors(logging.ERROR))

    def environment(self, task: dict[str, Any]) -> Any:
        key = json.dumps([task["env"], task["args"] or {}], sort_keys=True)
        if key not in self.environments:
            self.environments[key] = self.load_environment(task["env"], **(task["args"] or {}))
        return self.environments[key]

    def row(self, env: Any, task: dict[str, Any], episode: Episode) -> tuple[str, dict[str, Any]]:
        held_out, index = row_index(episode, task["heldout_from"])
        if held_out:
            rows = env.build_eval_dataset()
            if not rows:
                raise ValueError(
                    f"environment {task['env']!r} has no eval dataset, so no held-out rows: an "
                    "evaluation would replay training rows (give it an eval_dataset)"
                )
        else:
            rows = env.build_dataset()
            if not rows:
                raise ValueError(
                    f"environment {task['env']!r} has only an eval dataset: it has no rows to train "
                    "on (give it a dataset)"
                )
        split = "eval" if held_out else "train"
        return split, dict(rows[index % len(rows)])

    async def play(self, task: dict[str, Any], episode: Episode) -> None:
        from openai import AsyncOpenAI

        env = self.environment(task)
        split, row = self.row(env, task, episode)
        config = episode.request.policy.config
        openai = AsyncOpenAI(
            base_url=api_base(config.inference_url),
            api_key="rlnode",
            max_retries=0,
            timeout=episode.request.safety.max_time_s,
        )
        client = self.vf.OpenAIChatCompletionsClient(openai)
        errors: list[str] = []
        token = _rollout_errors.set(errors)
        try:
            output = await env.run_rollout(
                row, client, config.model, {**env.sampling_args, **sampling_of(episode)}
            )
        finally:
            _rollout_errors.reset(token)
            await openai.close()
        if errors:
            raise RuntimeError(f"the environment's rubric failed: {'; '.join(errors)}")
        if output.get("error"):
            self.raise_error(output["error"])
        metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items()}
        episode.details.update(metrics)
        completion = messages(output.get("completion"))
        replies = [m.get("content") for m in completion if m.get("role") == "assistant"]
        episode.details["inference_calls"] = float(len(replies))  # its own client's calls
        episode.step(
            {
                "split": split,
                "example_id": row.get("example_id"),
                "prompt": messages(row["prompt"]),
            },
            str(replies[-1] or "") if replies else "",
            float(output["reward"]),
            done=True,
            info={
                "answer": output.get("answer"),
                "metrics": metrics,
                "stop_condition": output.get("stop_condition"),
                "is_truncated": output.get("is_truncated"),
                "completion": completion,
            },
        )

    def raise_error(self, error: Any) -> None:
        name, message = (
            (error.get("error"), error.get("error_chain_repr") or error.get("message"))
            if isinstance(error, dict)
            else (type(error).__name__, str(error))
        )
        kind = getattr(self.vf, str(name), None)
        if isinstance(kind, type) and issubclass(kind, self.vf.ModelError):
            raise InferenceError(f"the environment's model call failed: {name}: {message}")
        raise RuntimeError(f"the environment's rollout failed: {name}: {message}")


def messages(value: Any) -> list[dict[str, Any]]:
    """Messages as JSON (the classic API keeps pydantic messages or dicts)."""
    out = []
    for message in value or []:
        dumped = (
            message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else message
        )
        out.append(json.loads(json.dumps(dumped, default=str)))
    return out


def build(
    env: str | None = None,
    args: dict[str, Any] | None = None,
    eval_args: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
    heldout_from: int = HELDOUT_FROM,
) -> TaskAppDefinition:
    """The Task App, with the CLI's defaults for the rollout's `env.config`."""
    defaults: dict[str, Any] = {
        "env": env,
        "args": args,
        "eval_args": eval_args,
        "agent": agent,
        "heldout_from": heldout_from,
    }
    settings(defaults, {} if env else {"env": "-"})
    runners: dict[str, Any] = {}  # loaded on first use: verifiers is slow to import

    def runner(env: str) -> Any:
        kind = located(env)
        if kind not in runners:
            if kind == "classic" and importlib.util.find_spec("verifiers.legacy") is None:
                raise ValueError(
                    f"env_config.env {env!r} is written for verifiers' classic API "
                    f"(load_environment), which verifiers {version('verifiers')} no longer has: "
                    "run it with .venvs/verifiers-0.3/bin/python"
                )
            if kind == "classic":
                runners[kind] = Classic()
            else:
                from rlnode.environments.verifiers_v04 import Tasksets

                runners[kind] = Tasksets()
        return runners[kind]

    def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
        return {**settings(defaults, config), "seed": seed}

    async def run_episode(task: dict[str, Any], episode: Episode) -> None:
        await runner(task["env"]).play(task, episode)

    return TaskAppDefinition(
        name="verifiers",
        description="verifiers environments, run by verifiers' own loader, rollout and rubric.",
        make_task=make_task,
        run_episode=run_episode,
        dataset={
            "seeds": "seed s: row s mod N of the training rows; held out (mode eval, or seeds "
            ">= heldout_from): row (s - heldout_from) mod M of the eval rows",
            "config": defaults,
        },
        action_space={"type": "chat", "tools": "the environment's own"},
        rubric={"outcome": "the environment's rubric (its reward functions, weighted)"},
        limits={"max_turns": 64},  # the environment keeps its own; this marks it multi-turn
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="verifiers environments as an rlnode Task App")
    parser.add_argument("--env", help="the environment's module (classic) or taskset id (0.4)")
    parser.add_argument(
        "--args", type=json.loads, help="load_environment's kwargs / taskset config"
    )
    parser.add_argument("--eval-args", type=json.loads, help="taskset config of held-out tasks")
    parser.add_argument("--agent", type=json.loads, help="the 0.4 agent seat's config")
    parser.add_argument("--heldout-from", type=int, default=HELDOUT_FROM)
    parser.add_argument("--processes", type=int, default=4, help="episodes run at once")
    parser.add_argument("--prepare", action="store_true", help="download the 0.4 harness packages")
    args, rest = parser.parse_known_args(argv)
    if args.prepare:
        from rlnode.environments.verifiers_v04 import prepare

        return prepare()
    kwargs = {
        "env": args.env,
        "args": args.args,
        "eval_args": args.eval_args,
        "agent": args.agent,
        "heldout_from": args.heldout_from,
    }
    try:
        build(**kwargs)
        if args.env and importlib.util.find_spec(module_name(args.env)) is None:
            located(args.env)  # unless verifiers ships it, says where to install it
        if importlib.util.find_spec("verifiers.legacy") is None:  # 0.4: check its uv setup
            from rlnode.environments.verifiers_v04 import NOT_PREPARED, UV_CONFIG

            if not UV_CONFIG.is_file():
                raise ValueError(f"{UV_CONFIG} is missing: {NOT_PREPARED}")
    except ValueError as e:
        parser.error(f"{e} (the command line's --options give the env config's defaults)")
    return serve(Isolated(build, kwargs, processes=args.processes), rest)


if __name__ == "__main__":
    sys.exit(main())
