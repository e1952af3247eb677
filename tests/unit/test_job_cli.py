"""The pieces of `rlnode job` that need no node: when a job is over, the progress line,
the config loader's errors, the charts."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import pytest

from rlnode.cli.job import CliError, _config
from rlnode.messages import JobEvent, JobEventType, ends_the_job
from rlnode.sdk.jobs import load_config
from rlnode.sdk.progress import Progress, terminal_curve, write_plot

REQUIRED = {
    JobEventType.REJECTED: {"reason": "r"},
    JobEventType.FAILED: {"reason": "r"},
    JobEventType.CANCELLED: {"reason": "r"},
    JobEventType.COMPLETED: {"steps": 3},
}


def event(kind: JobEventType, at: float = 0.0, **data) -> JobEvent:
    return JobEvent(
        job_id="job-1",
        org_id="org-1",
        type=kind,
        source="learner",
        message=kind.value,
        data={**REQUIRED.get(kind, {}), **data},
        ts=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=at),
    )


def test_what_ends_a_job() -> None:
    assert ends_the_job(event(JobEventType.COMPLETED), accepted=True)
    assert ends_the_job(event(JobEventType.FAILED), accepted=True)
    assert ends_the_job(event(JobEventType.CANCELLED), accepted=True)
    assert ends_the_job(event(JobEventType.REJECTED), accepted=False)
    # A refused cancel, or a rejection after acceptance, leaves the job running.
    assert not ends_the_job(event(JobEventType.REJECTED, action="cancel"), accepted=False)
    assert not ends_the_job(event(JobEventType.REJECTED), accepted=True)
    assert not ends_the_job(event(JobEventType.STARTED), accepted=True)


def test_the_progress_line_has_step_reward_loss_staleness_and_eta() -> None:
    out = io.StringIO()
    progress = Progress(out)
    common = {
        "total_steps": 10,
        "loss": -0.01,
        "reward_std": 0.1,
        "kl": None,
        "clip_fraction": 0.0,
        "staleness_min": 0,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "tokens_per_s": 100.0,
        "wait_s": 1.0,
        "compute_s": 0.1,
    }
    progress.step(event(JobEventType.TRAIN_STEP, 0, step=1, reward_mean=0.1, **common))
    progress.step(event(JobEventType.TRAIN_STEP, 30, step=4, reward_mean=0.25, **common))
    last = out.getvalue().splitlines()[-1]
    assert "4/10" in last and "reward 0.250" in last and "loss -0.0100" in last
    assert "staleness 0.5" in last and "ETA 1m00s" in last  # 3 steps in 30 s, 6 to go


def test_config_errors_name_the_field(tmp_path) -> None:
    bad = tmp_path / "job.toml"
    bad.write_text('[model]\nsource = "m"\n[task_app]\nname = "copy"\n[training]\ngroup_size = 1\n')
    with pytest.raises(CliError, match=r"training\.group_size"):
        _config(str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(CliError, match="cannot be read"):
        _config(str(broken))
    good = tmp_path / "job.json"
    good.write_text('{"model": {"source": "m"}, "task_app": {"name": "copy"}}')
    assert load_config(good).training.group_size == 4


def test_charts(tmp_path) -> None:
    rows = [
        {"step": i, "reward_mean": i / 10, "reward_std": 0.05, "loss": -i / 100}
        for i in range(1, 11)
    ]
    path = write_plot(rows, tmp_path / "plot.png", "job-1")
    assert path.read_bytes()[:4] == b"\x89PNG"
    chart = terminal_curve([r["reward_mean"] for r in rows], width=10, height=4)
    lines = chart.splitlines()
    assert len(lines) == 4 and "1.000" in lines[0] and "0.100" in lines[-1]


def test_the_readme_config_reference_is_a_valid_config() -> None:
    import re
    import tomllib
    from pathlib import Path

    from rlnode.messages import JobConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    reference, *sections = re.findall(r"```toml\n(.*?)```", readme, flags=re.S)
    whole = tomllib.loads(reference)
    config = JobConfig.model_validate(whole)
    assert config.training.group_size == 16 and config.topology.reference == "auto"
    # The sections shown on their own ([eval], [logging]) fit into it.
    for section in sections:
        assert JobConfig.model_validate(whole | tomllib.loads(section))


def test_watch_shows_a_pause_and_a_resume(monkeypatch) -> None:
    import asyncio

    from rlnode.cli import job as job_cli

    out = io.StringIO()
    monkeypatch.setattr(job_cli, "Progress", lambda: Progress(out))

    paused = {
        "step": 3,
        "bad_steps": 2,
        "rollouts": 16,
        "failed": 16,
        "failures": {"task_app_unreachable": 16},
        "max_failed_share": 0.5,
        "give_up_after_s": 600,
    }
    resumed = {"step": 3, "paused_s": 12.0, "probes": 3, "probe": "passes"}
    events = [
        event(JobEventType.ACCEPTED, 0, steps=5),
        event(JobEventType.PAUSED, 1, **paused).model_copy(update={"message": "paused after 3"}),
        event(JobEventType.RESUMED, 13, **resumed).model_copy(update={"message": "resumed"}),
        event(JobEventType.COMPLETED, 20),
    ]

    class Jobs:
        async def events(self, _job_id: str, wait_first_s: float):
            for e in events:
                yield e

    assert asyncio.run(job_cli._follow(Jobs(), "job-1", wait_first_s=1.0)) == 0  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert any("job.paused" in line and "paused after 3" in line for line in lines)
    assert any("job.resumed" in line and line.endswith("resumed") for line in lines)


@pytest.mark.parametrize("count", ["0", "11", "two"])
def test_rlnode_up_refuses_a_gateway_count_it_cannot_give_ports(count, capsys) -> None:
    from rlnode.cli import main as cli

    with pytest.raises(SystemExit) as exited:
        cli(["up", "--gpus", "0", "--gateways", count])
    assert exited.value.code == 2
    assert "--gateways" in capsys.readouterr().err
