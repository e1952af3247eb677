"""Screenshots of the dashboard for docs/dashboard/, on the real model's job: SmolLM2-135M-
Instruct learning two-operand sums (the arithmetic Task App, as `rlnode demo --model
smollm2`), watched live in headless chromium, then its rollouts, a chat answer from
`<job>@best` and the node page.

    .venv/bin/python tools/dashboard_screenshots.py [--steps 8] [--out docs/dashboard]

About 10 minutes on two CPU cores (a step of SmolLM2 takes ~40 s)."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from rlnode.examples import example_job
from rlnode.messages.config import EvalSeeds
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.node.demo import real_model_env
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.service.registry import CHECKPOINT_SERVER
from rlnode.service.settings import NodeSettings

VIEWPORT = {"width": 1400, "height": 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium: tools/ensure-chromium installs Debian's")

    store = NodeSettings().model_dir
    model = import_gguf(packaged_gguf("smollm2-135m-instruct"), store).path
    root = Path(tempfile.mkdtemp(prefix="rlnode-screenshots-"))
    env = real_model_env(store)
    with LocalNode(NodeOptions(data_dir=root / "node", env=env)) as node:
        org = node.create_org("demo", {"ENVIRONMENT_API_KEY": "demo-" + secrets.token_hex(16)})
        node.register_example_task_app(org, "arithmetic", "arithmetic")
        config = example_job("arithmetic_smollm2", model, steps=args.steps)
        assert config.eval is not None
        half = max(1, args.steps // 2)
        config = config.model_copy(
            update={
                "name": "sums on SmolLM2",
                "eval": config.eval.model_copy(
                    update={"every": half, "seeds": EvalSeeds(start=1_000_000, count=32)}
                ),
                "training": config.training.model_copy(update={"checkpoint_every": half}),
            }
        )

        async def start() -> str:
            async with node.jobs(org, "screenshots") as jobs:
                return await jobs.start(config)

        job_id = asyncio.run(start())
        url = node.url(CHECKPOINT_SERVER.name) + "/dashboard/"
        print(f"job {job_id}; dashboard {url}", flush=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(url)
            page.fill("#token", org.token)
            page.click("#sign-in button")
            page.goto(f"{url}#/jobs/{job_id}")
            # Live: half way, with the first evaluation in.
            wait_for(page, f"#steps tr[data-step='{half + 1}']", 30 * 60)
            shot(page, args.out / "job-live.png")
            page.click("#nav a[data-view=jobs]")
            page.wait_for_selector(f"#jobs tr[data-job='{job_id}']")
            shot(page, args.out / "jobs.png")
            page.goto(f"{url}#/jobs/{job_id}")
            wait_for(page, "#job-state.completed", 30 * 60)
            page.wait_for_selector("#evals tbody tr")
            shot(page, args.out / "job-completed.png")
            # A rollout: the best of the last step.
            page.fill("#rollout-filter [name=step]", str(args.steps - 1))
            page.click("#rollout-filter button")
            page.wait_for_selector("#rollouts tr.episode")
            page.locator("#rollouts tr.episode").first.click()
            page.locator("#rollout").scroll_into_view_if_needed()
            shot(page, args.out / "rollout.png", full_page=False)
            # Ask the best checkpoint (chat, through SmolLM2's template), streamed.
            page.wait_for_selector(
                f"#chat-model option[value='{job_id}@{args.steps}']", state="attached"
            )
            page.select_option("#chat-model", f"{job_id}@{args.steps}")
            page.fill("#chat-prompt", "What is 12 + 7? Answer with the number only.")
            page.fill("#chat-max", "16")
            page.click("#chat button")
            page.wait_for_selector("#chat-answer[data-done=true]", timeout=120_000)
            card = page.locator("section.card", has=page.locator("#chat"))
            card.screenshot(path=str(args.out / "chat.png"))
            print(f"wrote {args.out / 'chat.png'}: {page.inner_text('#chat-answer')!r}")
            page.click("#nav a[data-view=node]")
            page.wait_for_selector("#task-apps tbody tr", timeout=60_000)
            shot(page, args.out / "node.png")
            browser.close()
    print(f"screenshots in {args.out}")
    return 0


def wait_for(page: Page, selector: str, timeout_s: float) -> None:
    started = time.monotonic()
    page.wait_for_selector(selector, timeout=timeout_s * 1000)
    print(f"{selector} after {time.monotonic() - started:.0f}s", flush=True)


def shot(page: Page, path: Path, full_page: bool = True) -> None:
    page.wait_for_timeout(500)  # the charts draw on the next frame
    page.screenshot(path=str(path), full_page=full_page)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
