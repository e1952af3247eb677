"""The node's files are its own: created 0600/0700, and looser ones tightened."""

from __future__ import annotations

import os
import stat

from rlnode.service.files import private_dir, private_file


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_dirs_and_files_are_created_and_tightened(tmp_path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    assert mode(private_dir(loose)) == 0o700
    made = private_file(tmp_path / "new" / "db.sqlite3")
    assert mode(made) == 0o600 and mode(made.parent) == 0o700
    existing = tmp_path / "old.log"
    existing.write_text("kept")
    existing.chmod(0o644)
    assert mode(private_file(existing)) == 0o600 and existing.read_text() == "kept"
