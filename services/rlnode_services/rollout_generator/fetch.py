"""Weight versions this generator cannot see, downloaded from the learner that published
them (GENERATOR_WEIGHTS_URL; the learner's `GET /v1/weights/{org}/{job}/{version}`).

The URL comes from this generator's settings, never from the record: a record names the
org, job and version, and the one learner the operator configured answers for them. The
file is hashed with BLAKE3 as its bytes arrive and kept only when its size and digest are
the record's; otherwise nothing is left and the version is refused. A connection that
breaks mid-way resumes with `Range` from the bytes already written (hashed again from the
partial file first, with `If-Range` so that a learner now holding other bytes sends the
whole file), at most `weights_fetch_retries` times, waiting 0.5 s, then twice as long each
time.

One download per host, not per generator: an 8-GPU inference host runs a generator per
engine, and each fetching a 7B version of its own would move it over the network (and hold
it in memory) six or eight times. The generators of a host share one directory
(GENERATOR_WEIGHTS_DIR):

    shared/<blake3>.safetensors       the host's copy, named by its digest
    shared/<blake3>.part              a download under way (or one a killed generator left)
    shared/<blake3>.lock              flock(2)ed by whoever downloads or links it
    generators/<id>/<org>/<job>/v<N>.safetensors   a hard link per generator that loaded it

The first generator to want a version takes its lock and downloads it (going on from a
`.part` a killed one left); the others wait on the lock and find it there. Each loads from a
hard link of its own, so what one discards never pulls a file from under another; the
host's copy goes once no generator links it. The lock dies with its process, so a killed
downloader blocks no one.

The download runs on a thread with a blocking client: writing and hashing a large file off
the event loop that serves the Task Apps' inference calls."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import httpx

from rlnode.messages import WeightVersion
from rlnode.service.files import PRIVATE_FILE_MODE, private_dir
from rlnode.service.pooled_http import IDLE_CONNECTION_S
from rlnode.service.ranges import quoted_etag
from rlnode.service.stores import job_dir
from rlnode.training.storage import temporary_sibling
from rlnode_services.rollout_generator.settings import GeneratorSettings, safe_name

log = logging.getLogger("rollout_generator.fetch")

FIRST_RETRY_S, LONGEST_RETRY_S = 0.5, 8.0
LOCK_POLL_S = 0.1  # how often a generator waiting for another's download looks again
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class FetchFailed(Exception):
    """The version could not be downloaded whole and as published; nothing of it is kept."""


class _Broken(Exception):
    """The connection broke or the learner could not answer now: try again from here."""


@dataclass(frozen=True)
class Fetched:
    path: Path
    seconds: float
    resumes: int
    reused: bool = False  # the host had it: another generator (or an earlier run) downloaded it


def version_file(root: Path, version: WeightVersion) -> Path:
    return job_dir(root, version.org_id, version.job_id) / f"v{version.version:06d}.safetensors"


class HostCopies:
    """The host's downloaded versions, by digest, shared by its generators (see above)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, digest: str) -> Path:
        return self.directory / f"{digest}.safetensors"

    def partial(self, digest: str) -> Path:
        return self.directory / f"{digest}.part"

    @contextlib.contextmanager
    def locked(self, digest: str, stopping: threading.Event | None = None) -> Iterator[bool]:
        """Hold the digest's lock: yields True once held (waiting for another holder, unless
        `stopping` is set first: then False); with `stopping` None, False at once when held."""
        path = self.directory / f"{digest}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if stopping is None or stopping.wait(LOCK_POLL_S):
                    yield False
                    return
                continue
            # Held; but a holder that removed the lock file (below) leaves a stale inode to
            # whoever opened it before: then lock the file now at that name instead.
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        try:
            yield True
        finally:
            # A lock of nothing (a refused download's) goes; its holder may remove it.
            if not (self.path(digest).exists() or self.partial(digest).exists()):
                path.unlink(missing_ok=True)
            os.close(fd)

    def remove_unlinked(self) -> None:
        """Remove the copies no generator links any more and what killed downloads left,
        each under its lock (one being downloaded or linked now is left alone)."""
        if not self.directory.is_dir():
            return
        digests = {p.name.split(".", 1)[0] for p in self.directory.iterdir()}
        for digest in digests:
            with self.locked(digest) as held:
                if not held:
                    continue
                copy = self.path(digest)
                with contextlib.suppress(FileNotFoundError):
                    if copy.stat().st_nlink > 1:
                        continue
                copy.unlink(missing_ok=True)
                self.partial(digest).unlink(missing_ok=True)  # its lock goes with them


class WeightsFetcher:
    def __init__(self, settings: GeneratorSettings, first_retry_s: float = FIRST_RETRY_S) -> None:
        assert settings.weights_url is not None, "a fetcher needs GENERATOR_WEIGHTS_URL"
        self.base_url = settings.weights_url
        # This generator's links; the host's copies beside those of the other generators.
        self.root = settings.fetched_weights_dir / "generators" / safe_name(settings.generator_id)
        self.host = HostCopies(settings.fetched_weights_dir / "shared")
        self.retries = settings.weights_fetch_retries
        self.first_retry_s = first_retry_s
        token = settings.service_token.get_secret_value() if settings.service_token else None
        self._http = httpx.Client(
            timeout=settings.weights_fetch_timeout_s,
            limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S),
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        self._stopping = threading.Event()
        self._jobs: dict[str, Path] = {}  # job id -> its directory here
        self.discard_all()  # what an earlier run of this generator left

    async def fetch(self, version: WeightVersion) -> Fetched:
        return await asyncio.to_thread(self._fetch, version)

    def close(self) -> None:
        """Downloads in flight stop at their next chunk; every fetched version goes."""
        self._stopping.set()
        self._http.close()
        self.discard_all()

    # -- the download -----------------------------------------------------------------------

    def url(self, version: WeightVersion) -> str:
        return f"{self.base_url}/v1/weights/{version.org_id}/{version.job_id}/{version.version}"

    def _fetch(self, version: WeightVersion) -> Fetched:
        path = version_file(self.root, version)
        for directory in (self.root.parent.parent, self.host.directory, self.root):
            private_dir(directory)
        for directory in (path.parent.parent, path.parent):
            private_dir(directory)
        self._jobs[version.job_id] = path.parent
        started = time.perf_counter()
        with self.host.locked(version.blake3, self._stopping) as held:
            if not held:
                raise FetchFailed("the generator is stopping")
            copy = self.host.path(version.blake3)
            reused = copy.exists()
            resumes = 0 if reused else self._download_whole(version, copy)
            # A link of this generator's own: the host's copy may go when no one links it.
            temporary = temporary_sibling(path)
            temporary.unlink(missing_ok=True)
            os.link(copy, temporary)
            os.replace(temporary, path)
        return Fetched(path, time.perf_counter() - started, resumes, reused)

    def _download_whole(self, version: WeightVersion, copy: Path) -> int:
        """Download the version into the host's `copy` (its digest's lock held); returns how
        many times a broken download resumed."""
        partial = self.host.partial(version.blake3)
        resumes, delay = 0, self.first_retry_s
        try:
            while True:
                try:
                    digest = self._download(version, partial)
                    break
                except _Broken as e:
                    if resumes >= self.retries or self._stopping.is_set():
                        raise FetchFailed(
                            f"the download from {self.url(version)} broke {resumes + 1} "
                            f"time(s) (GENERATOR_WEIGHTS_FETCH_RETRIES={self.retries}); "
                            f"last: {e}"
                        ) from None
                    log.warning(
                        "weights v%d of %s: %s; resuming in %.1fs",
                        version.version,
                        version.job_id,
                        e,
                        delay,
                    )
                    self._stopping.wait(delay)
                    resumes, delay = resumes + 1, min(delay * 2, LONGEST_RETRY_S)
            if digest != version.blake3:
                raise FetchFailed(
                    f"the BLAKE3 digest of the download is {digest[:16]}…, the WeightVersion "
                    f"says {version.blake3[:16]}…"
                )
            os.replace(partial, copy)
        except BaseException:
            partial.unlink(missing_ok=True)  # nothing partial is left behind
            raise
        return resumes

    def _download(self, version: WeightVersion, temporary: Path) -> str:
        """Go on from what `temporary` holds to the end; the digest of the whole file."""
        size = version.size_bytes
        have, digest = _hashed(temporary)
        if have > size:  # not the bytes of this version
            temporary.unlink()
            have, digest = 0, blake3.blake3()
        if have == size:
            return digest.hexdigest()
        headers = {}
        if have:
            headers = {"Range": f"bytes={have}-", "If-Range": quoted_etag(version.blake3)}
        try:
            with self._http.stream("GET", self.url(version), headers=headers) as response:
                if response.status_code == 200 and have:  # the learner sends it whole
                    have, digest = 0, blake3.blake3()
                elif response.status_code == 206:
                    _check_resumes_at(response.headers.get("content-range", ""), have, size)
                elif response.status_code == 416 and have:  # what we hold is not its start
                    temporary.unlink()
                    raise _Broken("the learner refused the range asked for; starting again")
                elif response.status_code >= 500:
                    raise _Broken(f"the learner answered {response.status_code}")
                elif response.status_code != 200:
                    raise FetchFailed(
                        f"the learner at {self.base_url} answered {response.status_code} "
                        f"for weights v{version.version}: {_detail(response)}"
                    )
                fd = os.open(temporary, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
                with os.fdopen(fd, "r+b") as out:
                    out.truncate(have)
                    out.seek(have)
                    for chunk in response.iter_raw():  # as it arrives: none held back
                        if self._stopping.is_set():
                            raise FetchFailed("the generator is stopping")
                        if have + len(chunk) > size:
                            raise FetchFailed(
                                f"the learner sent more than the {size} bytes the "
                                "WeightVersion says"
                            )
                        out.write(chunk)
                        digest.update(chunk)
                        have += len(chunk)
        except httpx.TransportError as e:  # refused, reset, cut short, timed out
            raise _Broken(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
        if have < size:
            raise _Broken(f"the answer ended at byte {have} of {size}")
        return digest.hexdigest()

    # -- clean-up ---------------------------------------------------------------------------

    def discard_older(self, version: WeightVersion) -> None:
        """A version is loaded: the job's earlier downloads are of no more use here."""
        directory = version_file(self.root, version).parent
        for old in directory.glob("v*.safetensors"):
            if _number(old) < version.version:
                old.unlink(missing_ok=True)
        self.host.remove_unlinked()

    def discard_job(self, job_id: str) -> None:
        """The job's engines were released: everything downloaded for it goes."""
        directory = self._jobs.pop(job_id, None)
        if directory is not None:
            _empty(directory)
        self.host.remove_unlinked()

    def discard_all(self) -> None:
        """This generator's links (an earlier run's too), and the host's copies no other
        generator links."""
        if self.root.is_dir():
            for directory in self.root.glob("*/*"):
                _empty(directory)
        self.host.remove_unlinked()


def _hashed(path: Path) -> tuple[int, blake3.blake3]:
    """How many bytes a partial download holds, and their digest so far."""
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    have = 0
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
                have += len(block)
    except FileNotFoundError:
        pass
    return have, digest


def _check_resumes_at(content_range: str, have: int, size: int) -> None:
    found = _CONTENT_RANGE.match(content_range.strip())
    if found is None or int(found.group(1)) != have or int(found.group(3)) != size:
        raise FetchFailed(
            f"the learner answered Content-Range {content_range!r} to bytes={have}- of a "
            f"{size}-byte file"
        )


def _detail(response: httpx.Response) -> str:
    response.read()
    try:
        return str(response.json().get("detail", ""))[:500]
    except ValueError:
        return response.text[:200]


def _number(path: Path) -> int:
    digits = path.name.removeprefix("v").removesuffix(".safetensors")
    return int(digits) if digits.isdigit() else -1


def _empty(directory: Path) -> None:
    """Remove the versions (and unfinished downloads) in a job's directory, then it and its
    org's directory if nothing else is there."""
    for name in ("v*.safetensors", ".v*.safetensors.tmp-*"):
        for stale in directory.glob(name):
            stale.unlink(missing_ok=True)
    for empty in (directory, directory.parent):
        try:
            empty.rmdir()
        except OSError:
            break
