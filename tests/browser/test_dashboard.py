"""The dashboard in a real browser (headless Debian chromium driven by Playwright) against a
real embedded node: sign in with an org token, start a job from a job file, watch its curve
grow as steps arrive, cancel it; read a finished job's rollouts, ask its checkpoint and read
the streamed answer; every number shown is the one the SDK's events carry; another org's
token shows none of it; bad input shows the service's own message and starts nothing."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rlnode.examples import example_job, job_config_path
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node.chaos import learner_jobs
from rlnode.node.local import LocalNode, NodeOptions, Org
from rlnode.sdk.vault import VaultClient
from rlnode.service.auth import LEEWAY_S
from rlnode.service.registry import CHECKPOINT_SERVER, VAULT
from rlnode.testing import unique_id, wait_until
from rlnode.training.schedule import learning_rate_at

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (make setup)")
CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip(
        "no chromium: tools/ensure-chromium installs Debian's (make setup does, as root)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(600)
SCREENSHOTS_ENV = "RLNODE_DASHBOARD_SCREENSHOTS"  # a directory: each page's screenshot goes there
SHORT_TOKEN_TTL_S = 60  # the vault's shortest
# Steps of a job on a loaded 2-core machine (a neighbour worker training a model) can take
# seconds each: the waits for them are long, and they end as soon as the steps come.
STEPS_WAIT_MS = 120_000


class Dashboard:
    def __init__(self, node: LocalNode, org: Org, other: Org, model: Path, tmp: Path) -> None:
        self.node, self.org, self.other, self.model, self.tmp = node, org, other, model, tmp
        self.url = node.url(CHECKPOINT_SERVER.name) + "/dashboard/"
        self.tokens = [org.token, other.token]  # none of them may ever ride in a URL

    def short_token(self, org: Org) -> tuple[str, float]:
        """A token of `org` that expires soon, and when the vault refuses it for sure."""
        with VaultClient(self.node.url(VAULT.name), org.token) as vault:
            short = vault.create_token(unique_id("short"), ttl_s=SHORT_TOKEN_TTL_S)
        self.tokens.append(short["token"])
        return short["token"], time.time() + SHORT_TOKEN_TTL_S + LEEWAY_S + 2

    def job_file(self, name: str, **training) -> Path:
        """The example job file as a user would upload it: the model and steps edited in."""
        text = job_config_path("copy_task").read_text()
        text = re.sub(r'source = "[^"]*"', f'source = "{self.model}"', text)
        for key, value in training.items():
            text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        path = self.tmp / name
        path.write_text(text)
        return path

    def jobs(self, org: Org) -> list[dict]:
        response = httpx.get(
            self.node.url(CHECKPOINT_SERVER.name) + "/v1/jobs",
            headers={"Authorization": f"Bearer {org.token}"},
        )
        return response.raise_for_status().json()


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[Dashboard]:
    directory = tmp_path_factory.mktemp("dashboard")
    with LocalNode(NodeOptions(data_dir=directory / "node")) as node:
        org = node.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("key")})
        other = node.create_org(unique_id("other"), {"ENVIRONMENT_API_KEY": unique_id("key")})
        assert node.register_example_task_app(org, "copy", "copy_task")["ok"]
        model = init_tiny_model(directory / "tiny", seed=0)
        yield Dashboard(node, org, other, model, directory)


def run_async(coroutine):
    """Playwright's sync API runs an event loop on this thread: the SDK's coroutines run on
    another."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@pytest.fixture(scope="module")
def browser(dashboard) -> Iterator[sync_api.Browser]:  # the node first: it runs asyncio here
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@contextmanager
def open_page(browser: sync_api.Browser, dashboard: Dashboard) -> Iterator[sync_api.Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    urls: list[str] = []
    opened.on("request", lambda request: urls.append(request.url))
    yield opened
    # The token never rides in a URL (they end up in logs and histories).
    for token in dashboard.tokens:
        assert not any(token in url for url in urls)
    context.close()


@pytest.fixture
def page(browser, dashboard) -> Iterator[sync_api.Page]:
    with open_page(browser, dashboard) as opened:
        yield opened


@dataclass
class ExpiringPage:
    page: sync_api.Page
    refused_from: float  # when the vault's services refuse its token for sure


@pytest.fixture(scope="module", autouse=True)
def expiring(browser, dashboard) -> Iterator[ExpiringPage]:
    """A page signed in with a token that expires in a minute, opened before the module's
    other tests and left open while they run, as a tab is: the last test finds its token
    expired without waiting out the token's life and the vault's leeway (92 s). Its org is
    the one that starts no job, so nothing on the page asks the node for more meanwhile."""
    token, refused_from = dashboard.short_token(dashboard.other)
    with open_page(browser, dashboard) as opened:
        sign_in(opened, dashboard, token)
        opened.wait_for_selector("#no-jobs", state="visible")
        yield ExpiringPage(opened, refused_from)


def sign_in(page: sync_api.Page, dashboard: Dashboard, token: str) -> None:
    page.goto(dashboard.url)
    page.fill("#token", token)
    page.click("#sign-in button")
    page.wait_for_selector("#jobs")


def screenshot(page: sync_api.Page, name: str) -> None:
    import os

    where = os.environ.get(SCREENSHOTS_ENV)
    if where:
        page.screenshot(path=str(Path(where) / f"{name}.png"), full_page=True)


def points(page: sync_api.Page, chart: str = "#chart-reward") -> int:
    return int(page.get_attribute(chart, "data-points") or 0)


def test_start_a_job_from_a_file_watch_its_curve_grow_and_cancel_it(page, dashboard) -> None:
    sign_in(page, dashboard, dashboard.org.token)
    page.click("#nav a[data-view=start]")
    # Long enough to be cancelled mid-way, with a checkpoint only at its end.
    job_file = dashboard.job_file("long.toml", steps=5000, checkpoint_every=5000)
    page.set_input_files("#toml-file", str(job_file))
    page.wait_for_function("document.querySelector('#toml').value.includes('[training]')")
    page.click("#start-job")
    page.wait_for_url(re.compile(r"#/jobs/.+"))
    job_id = page.url.rsplit("/", 1)[1]
    try:
        page.wait_for_selector("#job-state.running", timeout=STEPS_WAIT_MS)

        # The curve grows as train.step events arrive (server-sent, not polled).
        page.wait_for_function(
            "Number(document.querySelector('#chart-reward').dataset.points) >= 3",
            timeout=STEPS_WAIT_MS,
        )
        seen = points(page)
        page.wait_for_function(
            f"Number(document.querySelector('#chart-reward').dataset.points) > {seen + 2}",
            timeout=STEPS_WAIT_MS,
        )
        assert page.inner_text("#job-facts [data-fact='Task App']") == "copy"
        screenshot(page, "job-live")

        page.click("#cancel-job")
        page.wait_for_selector("#job-state.cancelled", timeout=60_000)
    finally:
        # A failure above must not leave 5000 steps ahead of the next tests' jobs.
        run_async(_cancel(dashboard, job_id))
    learner = wait_until(
        lambda: (learner_jobs(dashboard.node, dashboard.org) or {}).get(job_id),
        30,
        "the learner's record",
    )
    wait_until(
        lambda: learner_jobs(dashboard.node, dashboard.org)[job_id]["status"] == "cancelled",
        30,
        f"the learner records the cancel (it said {learner})",
    )
    # The job list says so too, live.
    page.click("#nav a[data-view=jobs]")
    row = page.locator(f"#jobs tr[data-job='{job_id}']")
    assert row.locator("[data-field=status]").inner_text() == "cancelled"


async def _cancel(dashboard: Dashboard, job_id: str) -> None:
    async with dashboard.node.jobs(dashboard.org, "dashboard-test") as jobs:
        await jobs.cancel(job_id, "the test ended")


def test_a_finished_job_shows_the_sdks_numbers_its_rollouts_and_answers(page, dashboard) -> None:
    config = example_job(
        "copy_task", dashboard.model, steps=6, checkpoint_every=3, rollout_samples=4
    )

    async def run() -> tuple[str, list]:
        async with dashboard.node.jobs(dashboard.org, "dashboard-test") as jobs:
            return await jobs.run(config, unique_id("finished"), idle_timeout_s=120)

    job_id, events = run_async(run())
    sign_in(page, dashboard, dashboard.org.token)
    page.goto(f"{dashboard.url}#/jobs/{job_id}")
    page.wait_for_selector("#job-state.completed")
    page.wait_for_function("Number(document.querySelector('#chart-reward').dataset.points) === 6")

    # Every number shown is the events' (the SDK's, `rlnode job watch`'s) own.
    steps = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    # The copy task's cosine decay, step by step, and its chart.
    rates = [learning_rate_at(config.training.optimizer, i, 6) for i in range(6)]
    assert [s["learning_rate"] for s in steps] == pytest.approx(rates)
    assert points(page, "#chart-rate") == 6
    for step in steps:
        row = page.locator(f"#steps tr[data-step='{step['step']}']")
        assert row.locator("[data-field=reward_mean]").inner_text() == f"{step['reward_mean']:.3f}"
        assert row.locator("[data-field=reward_std]").inner_text() == f"{step['reward_std']:.3f}"
        assert row.locator("[data-field=loss]").inner_text() == f"{step['loss']:.4f}"
        assert (
            row.locator("[data-field=tokens_per_s]").inner_text() == f"{step['tokens_per_s']:.0f}"
        )
    assert page.inner_text("#job-facts [data-fact=step]") == "6 / 6"
    assert page.inner_text("#job-facts [data-fact=reward]") == f"{steps[-1]['reward_mean']:.3f}"
    listed = next(j for j in dashboard.jobs(dashboard.org) if j["job_id"] == job_id)
    assert listed["reward_mean"] == steps[-1]["reward_mean"] and listed["step"] == 6

    # Rollouts: the learner's sample of each step, searchable; one opened shows its text.
    samples = [e.data for e in events if e.type is JobEventType.ROLLOUT_SAMPLE]
    assert len(samples) == 6 and all(len(s["samples"]) == 4 for s in samples)
    page.wait_for_selector("#rollouts tr.episode")
    assert page.locator("#rollouts tr.episode").count() == 24
    page.fill("#rollout-filter [name=step]", "2")
    page.click("#rollout-filter button")
    page.wait_for_selector("#rollouts[data-query='step=2']")
    shown_steps = page.locator("#rollouts tr.episode").evaluate_all(
        "rows => rows.map(r => r.dataset.step)"
    )
    assert shown_steps == ["2"] * 4
    (step_2,) = [s for s in samples if s["step"] == 2]  # a sample's step counts from 0
    best = max(step_2["samples"], key=lambda s: s["reward"])
    page.fill("#rollout-filter [name=min_reward]", str(best["reward"]))
    page.click("#rollout-filter button")
    page.wait_for_selector("#rollouts[data-query*='min_reward']")
    rewards = page.locator("#rollouts tr.episode td:nth-child(4)").all_inner_texts()
    assert rewards and all(float(r) >= round(best["reward"], 3) for r in rewards), rewards
    page.locator("#rollouts tr.episode").first.click()
    shown = page.inner_text("#rollout")
    assert "Copy" in shown and f"reward {best['reward']:.3f}" in shown
    screenshot(page, "job-rollout")

    # Checkpoints: listed with their files; the final one answers a question, streamed.
    page.wait_for_selector("#checkpoints tr[data-step='6']")
    assert page.locator("#checkpoints tr[data-step='3']").count() == 1
    page.locator("#checkpoints tr[data-step='6'] button").click()
    page.wait_for_selector("#checkpoints button.file")
    assert "model.safetensors" in page.inner_text("#checkpoints tr[data-step='6']")
    assert page.input_value("#chat-model") == f"{job_id}@6"
    page.select_option("#chat-mode", "text")  # the tiny model has no chat template
    page.fill("#chat-prompt", "Copy: abc")
    page.fill("#chat-max", "4")
    page.click("#chat button")
    page.wait_for_selector("#chat-answer[data-done=true]")
    assert page.inner_text("#chat-answer").strip(), "a streamed answer"
    assert page.locator("#chat-error").is_hidden()
    screenshot(page, "job-chat")


def test_another_org_sees_none_of_it(page, dashboard) -> None:
    ours = [j["job_id"] for j in dashboard.jobs(dashboard.org)]
    assert ours, "the tests before started jobs"
    sign_in(page, dashboard, dashboard.other.token)
    page.wait_for_selector("#no-jobs", state="visible")
    assert page.locator("#jobs tbody tr").count() == 0
    page.goto(f"{dashboard.url}#/jobs/{ours[0]}")
    page.wait_for_selector("#job-error", state="visible")
    assert "no job" in page.inner_text("#job-error")
    assert page.locator("#steps tbody tr").count() == 0
    page.click("#nav a[data-view=node]")
    page.wait_for_selector("#services tbody tr")
    assert page.locator("#task-apps tbody tr").count() == 0  # ours is "copy", not theirs


def test_the_node_page(page, dashboard) -> None:
    sign_in(page, dashboard, dashboard.org.token)
    page.click("#nav a[data-view=node]")
    page.wait_for_selector("#task-apps tr[data-app=copy]")
    services = page.locator("#services tbody tr")
    assert services.count() == len(dashboard.node.processes)
    assert all(
        cell == "healthy"
        for cell in services.evaluate_all("rows => rows.map(r => r.cells[1].innerText)")
    )
    assert page.locator("#plan tbody tr").count() >= 2
    app = page.locator("#task-apps tr[data-app=copy]")
    assert app.locator("td").nth(3).inner_text() == "yes"  # verified: healthy, checks the key
    screenshot(page, "node")


def test_bad_input_shows_the_services_message_and_starts_nothing(page, dashboard) -> None:
    before = {j["job_id"] for j in dashboard.jobs(dashboard.org)}
    sign_in(page, dashboard, dashboard.org.token)
    page.click("#nav a[data-view=start]")

    page.fill("#toml", "[model\nsource = 'x'")  # not TOML
    page.click("#start-job")
    page.wait_for_selector("#start-error", state="visible")
    assert "cannot be read as toml" in page.inner_text("#start-error")

    bad = dashboard.job_file("bad.toml", group_size=1).read_text()
    page.fill("#toml", bad)
    page.click("#start-job")
    page.wait_for_function(
        "document.querySelector('#start-error').innerText.includes('training.group_size')"
    )
    assert {j["job_id"] for j in dashboard.jobs(dashboard.org)} == before

    # One the learner refuses: a Task App this org never registered.
    unknown = (
        dashboard.job_file("unknown.toml").read_text().replace('name = "copy"', 'name = "nope"')
    )
    page.fill("#toml", unknown)
    page.click("#start-job")
    page.wait_for_selector("#job-state.rejected", timeout=60_000)
    reason = page.inner_text("#job-error")
    assert "nope" in reason, reason
    job_id = page.url.rsplit("/", 1)[1]
    assert job_id not in (learner_jobs(dashboard.node, dashboard.org) or {}), "nothing started"


def test_an_expired_token_is_sent_back_to_sign_in_with_the_reason(expiring) -> None:
    page = expiring.page
    time.sleep(max(0.0, expiring.refused_from - time.time()))
    page.click("#nav a[data-view=node]")
    page.wait_for_selector("#sign-in-error", state="visible")
    assert "token expired" in page.inner_text("#sign-in-error")
    assert page.evaluate("sessionStorage.getItem('rlnode.token')") is None
