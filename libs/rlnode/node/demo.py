"""`rlnode demo`: the whole product in one command, on the embedded defaults. It brings a
node up, does what a user does (an org, a key sealed on this side and uploaded, a managed
Task App, a job), shows the job live, draws the reward curve, asks the checkpoint a
question, and shuts everything down."""

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
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.sdk.checkpoints import CheckpointClient
from rlnode.sdk.jobs import JobError, new_job_id
from rlnode.sdk.progress import QUIET, Progress, terminal_curve, write_plot
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
        job_id, rows = asyncio.run(_train(node, org, config, say))
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


async def _train(node: LocalNode, org, config: JobConfig, say) -> tuple[str, list[dict]]:
    progress = Progress()
    rows: list[dict] = []
    job_id = new_job_id()
    accepted = False
    async with node.jobs(org, service="demo") as jobs:
        await jobs.start(config, job_id)
        async for event in jobs.events(job_id, wait_first_s=120):
            accepted = accepted or event.type is JobEventType.ACCEPTED
            if event.type is JobEventType.TRAIN_STEP:
                rows.append(event.data)
                progress.step(event)
            elif event.type not in QUIET:
                progress.say(f"     {event.type.value:<18} {event.message}")
            if ends_the_job(event, accepted):
                if event.type is not JobEventType.COMPLETED:
                    raise JobError(f"the demo job {event.type.value}: {event.message}", event)
                break
    return job_id, rows


def _printer():
    def say(text: str) -> None:
        print(text, flush=True)

    return say
