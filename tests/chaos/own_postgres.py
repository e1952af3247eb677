"""A PostgreSQL server of the test's own (initdb and pg_ctl in a temporary directory), so
that a test may stop and start it under running services without touching a shared one."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from rlnode.bus.localbroker import free_port


class OwnPostgres:
    def __init__(self, directory: Path, as_user: list[str]) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.port = free_port()
        self._as_user = as_user  # initdb and postgres refuse to run as root

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self._as_user, *argv], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {done.stderr or done.stdout}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.directory / "postgres.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def missing_tools() -> str | None:
    """Why this machine cannot run an own PostgreSQL, or None."""
    absent = [tool for tool in ("initdb", "pg_ctl") if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not on PATH (install PostgreSQL's server binaries)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run initdb as"
    return None


@contextmanager
def own_postgres() -> Iterator[OwnPostgres]:
    """A fresh, running cluster; stopped and removed afterwards."""
    as_user: list[str] = []
    # A directory of its own outside the test's (pytest's are private to root).
    directory = Path(tempfile.mkdtemp(prefix="rlnode-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(directory, "postgres", "postgres")
    server = OwnPostgres(directory, as_user)
    try:
        server.init()
        server.start()
        yield server
    finally:
        try:
            server.stop()
        except RuntimeError:
            pass  # stopped already, or never started
        shutil.rmtree(directory, ignore_errors=True)
