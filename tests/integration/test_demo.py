"""`rlnode demo` as a newcomer runs it (shortened): a node of its own comes up, a job trains,
the checkpoint answers, everything stops, and the plot exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlnode.testing import processes_with


@pytest.mark.timeout(600)
def test_the_demo_runs_end_to_end_and_leaves_nothing_running(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env["RLNODE_DATA_DIR"] = str(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlnode.cli",
            "demo",
            "--steps",
            "2",
            "--data-dir",
            str(tmp_path / "d"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for stage in ("1/6", "2/6", "3/6", "4/6", "5/6", "6/6", "job.completed", "done in"):
        assert stage in out, stage
    # The dashboard's URL, and the org token in a file of the user's, never on the terminal.
    dashboard = re.search(
        r"dashboard: (http://\S+/dashboard/) \(sign in with the org token in (\S+)\)", out
    )
    assert dashboard, out
    token_file = Path(dashboard.group(2))
    assert token_file.stat().st_mode & 0o077 == 0 and token_file.read_text() not in out
    png = next(Path(tmp_path / "d").glob("job-*.png"))
    assert png.read_bytes()[:4] == b"\x89PNG" and str(png) in out
    # Every service and the broker stopped: no process left with the demo's environment.
    assert processes_with(str(tmp_path)) == []
