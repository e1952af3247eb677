"""The project documents itself: settings tables are generated from the settings classes
and current, and nothing in the repository points at files outside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlnode.service.settings_reference import MARKER, render

ROOT = Path(__file__).resolve().parents[2]
TRACKED = subprocess.run(
    ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
).stdout.split()
MARKDOWN = [ROOT / f for f in TRACKED if f.endswith(".md")]


@pytest.mark.parametrize(
    "path", [p for p in MARKDOWN if MARKER.search(p.read_text())], ids=lambda p: p.name
)
def test_settings_tables_are_current(path: Path) -> None:
    assert render(path.read_text()) == path.read_text(), f"run `make docs` ({path})"


def test_every_service_documents_its_settings() -> None:
    tables = "".join(p.read_text() for p in MARKDOWN)
    for target in (
        "rlnode.bus.settings.KafkaSettings",
        "rlnode.service.settings.NodeSettings",
        "rlnode.service.settings.DatabaseSettings",
        "rlnode_services.credential_vault.settings.VaultSettings",
        "rlnode_services.taskapp_gateway.settings.GatewaySettings",
        "rlnode_services.rollout_generator.settings.GeneratorSettings",
        "rlnode_services.learner.settings.LearnerSettings",
        "rlnode_services.checkpoint_server.settings.CheckpointServerSettings",
    ):
        assert f"<!-- settings: {target} -->" in tables, target


def test_a_stale_table_is_caught() -> None:
    text = "<!-- settings: rlnode.bus.settings.KafkaSettings -->\n| old |\n<!-- /settings -->\n"
    assert "KAFKA_BOOTSTRAP_SERVERS" in render(text) and render(text) != text


def test_nothing_points_outside_the_repository() -> None:
    outside = []
    for name in TRACKED:
        path = ROOT / name
        if path.suffix in {".png", ".json"} or not path.is_file() or path == Path(__file__):
            continue  # binary or generated files, and this test's own needles
        text = path.read_text(errors="replace")
        for needle in ("../shared", "DESIGN.md", "STYLE.md"):
            if needle in text:
                outside.append(f"{name}: {needle}")
    assert outside == []
