"""`rlnode demo`: the whole product in one command, on the embedded defaults. It brings a
node up, does what a user does (an org, a key sealed on this side and uploaded, a managed
Task App, a job), shows the job live, draws the reward curve, asks the checkpoint a
question, and shuts everything down.

`rlnode demo --model smollm2`: the same with a real pretrained model, SmolLM2-135M-Instruct
(imported once from the GGUF its package ships), learning two-operand sums through a vLLM
generator where vLLM is installed; held-out questions answered before training (the imported
model, greedy, in this process) and after it (`<job>@best` through the checkpoint-server),
side by side."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from datetime import datetime
from pathlib import Path

from rlnode.examples import example_job
from rlnode.messages import JobConfig, JobEventType, ends_the_job
from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions, Org
from rlnode.sdk.checkpoints import CheckpointClient
from rlnode.sdk.jobs import JobError, new_job_id
from rlnode.sdk.progress import QUIET, Progress, terminal_curve, write_plot
from rlnode.service.files import private_file
from rlnode.service.registry import CHECKPOINT_SERVER
from rlnode.service.settings import NodeSettings


def run_demo(steps: int = 60, data_dir: Path | None = None) -> int:
    started = time.perf_counter()
    root = data_dir or NodeSettings().data_dir / "demo" / datetime.now().strftime("%Y%m%d-%H%M%S")
    say = _printer()
    say(f"rlnode demo: everything it writes goes under {root}")
    say(
        "1/6  starting the node: embedded broker, vault, gateway, generator, learner, checkpoint-server"
    )
    # The learner loads the demo's model from where the demo builds it.
    model_dirs = {"learner": {"LEARNER_MODEL_DIRS": json.dumps([str(root / "tiny-model")])}}
    with LocalNode(NodeOptions(data_dir=root / "node", env=model_dirs)) as node:
        say(f"     up in {time.perf_counter() - started:.0f}s (broker {node.bootstrap})")
        say(
            "2/6  creating org 'demo'; sealing ENVIRONMENT_API_KEY with its public key on this side"
        )
        org = node.create_org("demo", {"ENVIRONMENT_API_KEY": "demo-" + secrets.token_hex(16)})
        _dashboard(node, org, root, say)
        say("3/6  registering the managed copy-task Task App (the key is injected at run time)")
        verdict = node.register_example_task_app(org, "copy", "copy_task")
        say(
            f"     verified: healthy {verdict['healthy']['ok']}, accepts the key "
            f"{verdict['accepts_key']['ok']}, refuses a wrong one {verdict['refuses_wrong_key']['ok']}"
        )
        model = init_tiny_model(root / "tiny-model", seed=0)
        # Checkpoints half way and at the end: the answer below comes from @latest.
        config = example_job("copy_task", model, steps=steps, checkpoint_every=max(1, steps // 2))
        say(f"4/6  starting a job: {steps} GRPO steps of 8 prompts x 16 samples on the tiny model")
        job_id, rows, _evals = asyncio.run(_train(node, org, config, say))
        say("5/6  reward against step")
        say(terminal_curve([r["reward_mean"] for r in rows]))
        png = write_plot(rows, root / f"{job_id}.png", title=f"{job_id} (copy task, tiny model)")
        say(f"     plot: {png}")
        with CheckpointClient(node.url(CHECKPOINT_SERVER.name), org.token) as server:
            question = "Copy: cab"
            answer = server.chat(f"{job_id}@latest", question, max_tokens=6, temperature=0)
            say(
                f"6/6  asked {job_id}@latest {question!r}; it answered {answer['choices'][0]['message']['content']!r}"
            )
            say(
                f"     checkpoints: {', '.join(m for m in server.models() if m.startswith(job_id))}"
            )
        say("")
        say("What to try next:")
        say(f"  open {png}")
        say("  rlnode demo --steps 120                    a longer run")
        say(
            "  make test                                  the test suite (real broker, services, databases)"
        )
        say("  your own Task App: docs/taskapp-contract.md; examples in rlnode.examples.taskapps")
        say(
            "  rlnode up                                  a node that stays up (rlnode status, rlnode down)"
        )
        say(
            "  rlnode job start CONFIG.toml --watch       your own job on it (README: config reference)"
        )
        say("shutting the node down ...")
    say(f"done in {time.perf_counter() - started:.0f}s")
    return 0


def run_real_model_demo(steps: int = 12, data_dir: Path | None = None) -> int:
    from rlnode.engine.precision import cpu_training_precision
    from rlnode.examples.taskapps import arithmetic
    from rlnode.messages.config import EvalSeeds
    from rlnode.models.catalogue import packaged_gguf
    from rlnode.models.gguf import import_gguf

    started = time.perf_counter()
    root = data_dir or NodeSettings().data_dir / "demo" / datetime.now().strftime("%Y%m%d-%H%M%S")
    store = NodeSettings().model_dir
    say = _printer()
    say(f"rlnode demo --model smollm2: everything it writes goes under {root}")
    say(f"1/7  importing SmolLM2-135M-Instruct from its package's GGUF into {store} (once)")
    imported = import_gguf(packaged_gguf("smollm2-135m-instruct"), store)
    say(f"     {'found' if imported.reused else 'imported'}: {imported.path}")
    env = real_model_env(store)
    engine = env["rollout-generator"]
    say(
        f"2/7  starting the node (the generator runs {engine['GENERATOR_ENGINE']} in "
        f"{engine['GENERATOR_DTYPE']}); ~1-2 min"
    )
    with LocalNode(NodeOptions(data_dir=root / "node", env=env)) as node:
        say(f"     up in {time.perf_counter() - started:.0f}s")
        org = node.create_org("demo", {"ENVIRONMENT_API_KEY": "demo-" + secrets.token_hex(16)})
        _dashboard(node, org, root, say)
        say("3/7  org 'demo' with its sealed key; registering the managed arithmetic Task App")
        node.register_example_task_app(org, "arithmetic", "arithmetic")
        config = example_job("arithmetic_smollm2", imported.path, steps=steps)
        assert config.eval is not None
        shown = [arithmetic.make_task(s, config.task_app.env_config) for s in HELD_OUT_SHOWN]
        say("4/7  the model before training, greedy on held-out questions (in this process)")
        before = _answers_of_the_imported_model(imported.path, shown, config.sampling.max_tokens)
        every = max(1, steps // 3)
        config = config.model_copy(
            update={
                "eval": config.eval.model_copy(
                    update={
                        "every": every,
                        "seeds": EvalSeeds(start=HELD_OUT_SHOWN.start, count=32),
                    }
                ),
                "training": config.training.model_copy(
                    update={"checkpoint_every": steps, **cpu_training_precision()}
                ),
            }
        )
        say(
            f"5/7  training {steps} GRPO steps of 8 questions x 8 samples; 32 held-out "
            f"questions evaluated greedily at steps 0, {every}, ... ({steps} on two CPU cores: "
            "about 40 s a step)"
        )
        job_id, rows, evals = asyncio.run(_train(node, org, config, say))
        say("6/7  reward against step")
        say(terminal_curve([r["reward_mean"] for r in rows]))
        png = write_plot(
            rows, root / f"{job_id}.png", title=f"{job_id} (SmolLM2, sums)", evals=evals
        )
        say(f"     plot: {png}")
        say(
            "     held-out accuracy: "
            + ", ".join(f"step {e['step']} {e['pass_at_1']:.2f}" for e in evals)
        )
        say(f"7/7  the same questions asked of {job_id}@best through the checkpoint-server")
        with CheckpointClient(node.url(CHECKPOINT_SERVER.name), org.token) as server:
            after = [
                server.chat(
                    f"{job_id}@best",
                    arithmetic.prompt(task),
                    max_tokens=config.sampling.max_tokens,
                    temperature=0,
                )["choices"][0]["message"]["content"]
                for task in shown
            ]
        say(f"     {'question':<48} {'before':<28} {'after':<16} right")
        for task, old, new in zip(shown, before, after, strict=True):
            question = task["question"].removesuffix(" Answer with the number only.")
            say(f"     {question:<48} {_one_line(old):<28} {_one_line(new):<16} {task['answer']}")
        say("shutting the node down ...")
    say(f"done in {time.perf_counter() - started:.0f}s")
    return 0


# Held-out questions (the Task App's seeds from 1,000,000), the first few shown side by side.
HELD_OUT_SHOWN = range(1_000_000, 1_000_006)


def real_model_env(store: Path) -> dict[str, dict[str, str]]:
    """The node's services' settings for a real-model job on models in `store`: a vLLM
    generator where vLLM is installed (torch's otherwise, fp32), in bf16 where the CPU
    computes it natively (rlnode.engine.precision), and the learner writing its weight
    versions in the generator's dtype (half the bytes in bf16)."""
    import importlib.util

    from rlnode.engine.precision import cpu_generation_dtype

    learner = {"LEARNER_MODEL_DIRS": json.dumps([str(store)])}
    if importlib.util.find_spec("vllm") is None:
        generator = {"GENERATOR_ENGINE": "torch", "GENERATOR_DTYPE": "float32"}
    else:
        generator = {
            "GENERATOR_ENGINE": "vllm",
            "GENERATOR_DTYPE": cpu_generation_dtype(),
            "GENERATOR_CPU_KV_CACHE_MIB": "512",
        }
    learner["LEARNER_WEIGHTS_DTYPE"] = generator["GENERATOR_DTYPE"]
    return {"learner": learner, "rollout-generator": generator}


def _answers_of_the_imported_model(model: Path, tasks: list[dict], max_tokens: int) -> list[str]:
    import torch

    from rlnode.engine import render_chat
    from rlnode.examples.taskapps import arithmetic
    from rlnode.models.hf import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model)
    lm = load_causal_lm(model, dtype=torch.float32).eval()
    answers = []
    for task in tasks:
        # The same rendering of the chat template as the engines'.
        ids = torch.tensor([render_chat(tokenizer, arithmetic.prompt(task))])
        with torch.no_grad():
            out = lm.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
        answers.append(str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    return answers


def _one_line(text: str, width: int = 26) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


async def _train(
    node: LocalNode, org, config: JobConfig, say
) -> tuple[str, list[dict], list[dict]]:
    progress = Progress()
    rows: list[dict] = []
    evals: list[dict] = []
    job_id = new_job_id()
    accepted = False
    async with node.jobs(org, service="demo") as jobs:
        await jobs.start(config, job_id)
        async for event in jobs.events(job_id, wait_first_s=120):
            accepted = accepted or event.type is JobEventType.ACCEPTED
            if event.type is JobEventType.TRAIN_STEP:
                rows.append(event.data)
                progress.step(event)
            elif event.type is JobEventType.EVAL_COMPLETED:
                evals.append(event.data)
                progress.say(f"     {event.type.value:<18} {event.message}")
            elif event.type not in QUIET:
                progress.say(f"     {event.type.value:<18} {event.message}")
            if ends_the_job(event, accepted):
                if event.type is not JobEventType.COMPLETED:
                    raise JobError(f"the demo job {event.type.value}: {event.message}", event)
                break
    return job_id, rows, evals


def _dashboard(node: LocalNode, org: Org, root: Path, say) -> None:
    """Where to watch the job in a browser; the org token goes to a file of the user's only
    (never to the terminal: it would land in logs)."""
    token_file = private_file(root / "demo-org.token")
    token_file.write_text(org.token)
    say(
        f"     dashboard: {node.url(CHECKPOINT_SERVER.name)}/dashboard/ (sign in with the org "
        f"token in {token_file})"
    )


def _printer():
    def say(text: str) -> None:
        print(text, flush=True)

    return say
