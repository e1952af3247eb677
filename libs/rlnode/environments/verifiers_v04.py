"""The Taskset API of verifiers (0.4.0, `verifiers.v1`; tested with 0.4.0) for
rlnode.environments.verifiers, which says how environments are named, configured and seeded.

An environment is a taskset package: it exports its Taskset (and maybe its own Env, whose
seats play it, and a Harness) via `__all__`; it is loaded by verifiers' own
`load_environment(resolve_env_config(...))` and one rollout is `env.run_episode(task, ctx)`,
inside `env.serving()`: its harness program plays the task, its model calls relayed by
verifiers' interception server (on loopback) to `<inference_url>/v1` with the rollout's model
and sampling, always as `stream: true`; then the task's @vf.reward and @vf.metric functions (and
the Env's own `record_reward`s) score each trace. A step per trace, its reward theirs, weighted.

Every seat runs in the "subprocess" runtime (the others are remote sandboxes or containers)
with the taskset's bundled harness, else "null", a plain chat loop (verifiers' own default,
"bash", would run the model's commands on this host); env_config.agent overrides either.

Offline: a harness runs its program as a uv script (`uv sync --script ... --no-config`, with
UV_OFFLINE=false forced): with no uv on PATH verifiers pip-installs uv into ~/.local/bin, then
uv fetches the program's packages from PyPI. Here uv comes with the venv
(requirements/environments/verifiers-0.4.txt; this puts the venv's bin/ first on PATH) and the
packages from a folder: `--prepare` (`make environments`) downloads them once into
<venv>/verifiers-wheels and writes a uv.toml there (no-index, find-links = that folder,
python-downloads = never), named in UV_CONFIG_FILE (uv reads an explicit config file despite
--no-config; uv 0.13 has no environment variable for --no-index). Prepared are the chat
program's packages (the "null" and "bash" harnesses); others install theirs from the network.
Each rollout starts that program (~1.5 s of Python importing openai and mcp); uv and verifiers
keep the script's environment in ~/.cache/uv and ~/.cache/verifiers.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rlnode.environments.verifiers import api_base, row_index, sampling_of
from rlnode.taskapp import Episode
from rlnode.taskapp.inference import InferenceError

WHEELS = Path(sys.prefix) / "verifiers-wheels"
UV_CONFIG = WHEELS / "uv.toml"
NOT_PREPARED = (
    "verifiers' harness program would fetch its packages from PyPI at the first rollout. Run "
    f"`make environments` (it runs {sys.executable} -m rlnode.environments.verifiers --prepare)"
)


class Tasksets:
    """Plays a rollout of a taskset package: Env.run_episode on one of its tasks."""

    def __init__(self) -> None:
        import verifiers.v1 as vf

        self.vf = vf
        self.environments: dict[str, tuple[Any, list[Any]]] = {}
        # The harness program's uv from this venv, its packages from the prepared folder.
        if not UV_CONFIG.is_file():
            raise RuntimeError(f"{UV_CONFIG} is missing: {NOT_PREPARED}")
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        os.environ["UV_CONFIG_FILE"] = str(UV_CONFIG)

    def environment(self, task: dict[str, Any], held_out: bool) -> tuple[Any, list[Any]]:
        vf = self.vf
        args = dict(task["args"] or {})
        if held_out:
            if not task["eval_args"] or {**args, **task["eval_args"]} == args:
                raise ValueError(
                    f"taskset {task['env']!r}: held-out rollouts need env_config.eval_args, the "
                    'taskset config that selects its held-out tasks (e.g. {"split": "test"})'
                )
            args |= task["eval_args"]
        agent = {"runtime": {"type": "subprocess"}, **(task["agent"] or {})}
        if "harness" not in agent and vf.default_harness_id(task["env"]) == "bash":
            agent["harness"] = {"id": "null"}
        # Every seat of the env (SingleAgentEnv's one is "agent") gets the agent settings.
        seats = vf.env_config_type(task["env"]).model_fields.items()
        config: dict[str, Any] = {"taskset": {**args, "id": task["env"]}}
        config |= {name: agent for name, f in seats if isinstance(f.default, vf.AgentConfig)}
        key = json.dumps(config, sort_keys=True)
        if key not in self.environments:
            env = vf.load_environment(vf.resolve_env_config(config))
            tasks = list(env.taskset) if env.taskset.bounded else []
            if env.taskset.bounded and not tasks:
                raise ValueError(f"taskset {task['env']!r} with {args} has no tasks")
            self.environments[key] = (env, tasks)
        return self.environments[key]

    async def play(self, task: dict[str, Any], episode: Episode) -> None:
        vf = self.vf
        held_out, index = row_index(episode, task["heldout_from"])
        env, tasks = self.environment(task, held_out)
        chosen = (
            tasks[index % len(tasks)]
            if tasks
            else next(itertools.islice(iter(env.taskset), index, None))
        )
        config = episode.request.policy.config
        context = vf.ModelContext(
            model=config.model,
            client=vf.EvalClientConfig(
                base_url=api_base(config.inference_url), api_key_var="RLNODE_VERIFIERS_NO_KEY"
            ),
            sampling=vf.Sampling(**sampling_of(episode)),
        )
        async with env.serving():
            result = await env.run_episode(chosen, context)
        errors = list(result.errors) + [e for trace in result.traces for e in trace.errors]
        if errors:
            error = errors[-1]
            if error.type in ("ProviderError", "InterceptionError"):
                raise InferenceError(f"the model call failed: {error.type}: {error.message}")
            raise RuntimeError(f"the environment's episode failed: {error.type}: {error.message}")
        split = "eval" if held_out else "train"
        data = chosen.data.model_dump(mode="json")
        for trace in result.traces:
            scores = {k: r.score for k, r in trace.rewards.items() if r is not None}
            episode.details.update(scores)
            episode.details.update({k: v for k, v in trace.metrics.items() if v is not None})
            episode.details["num_turns"] = trace.num_turns
            episode.details["inference_calls"] = float(trace.num_turns)  # via its relay
            episode.step(
                {"split": split, "task": data["id"] or data["idx"], "prompt": data["prompt"]},
                trace.last_reply,
                trace.reward,
                done=True,
                info={
                    "rewards": {
                        k: r.model_dump() for k, r in trace.rewards.items() if r is not None
                    },
                    "metrics": dict(trace.metrics),
                    "stop_condition": trace.stop_condition,
                    "turns": trace.num_turns,
                },
            )


def prepare() -> int:
    """Download the packages of verifiers' chat harness program into WHEELS (the versions this
    venv has), so its uv script installs offline."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM

    [listed] = re.findall(r"^# dependencies = (\[.*\])$", CHAT_PROGRAM, re.MULTILINE)
    wanted = []
    for requirement in json.loads(listed):
        name = re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0]
        try:
            wanted.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            wanted.append(requirement)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"]
    status = subprocess.call([*pip, "--dest", str(WHEELS), *wanted])
    if status == 0:
        settings = f'no-index = true\nfind-links = ["{WHEELS}"]\npython-downloads = "never"\n'
        UV_CONFIG.write_text(settings)
    return status
