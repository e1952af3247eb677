"""Weight versions over HTTP, for a generator on another host than the learner: the learner's
route under uvicorn on loopback serving a real safetensors file, the generator's download
(digest checked as bytes arrive, a connection cut mid-way resumed with Range, a wrong digest
refused with nothing kept), and a whole node whose generator cannot see the learner's files
completing a job on versions it downloaded."""

from __future__ import annotations

import asyncio
import shutil
import signal
import stat
import sys
import time
import uuid
from pathlib import Path

import blake3
import pytest
from fastapi import FastAPI
from nacl.signing import SigningKey
from pydantic import SecretStr
from safetensors.torch import load_file

from rlnode.bus.localbroker import free_port
from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples import example_job
from rlnode.messages import JobEventType, ModelSpec, ParityProbe, WeightVersion
from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.node.processes import ServiceProcess
from rlnode.service.auth import Scope, TokenClaims, TokenVerifier, sign_token
from rlnode.service.http import install_error_handlers
from rlnode.service.registry import GENERATOR, LEARNER
from rlnode.testing import ThreadedServer, unique_id, wait_until
from rlnode_services.learner.weights import PublishedWeights, weights_router
from rlnode_services.rollout_generator.engines import EnginePool, WeightsRefused
from rlnode_services.rollout_generator.fetch import FetchFailed, WeightsFetcher
from rlnode_services.rollout_generator.settings import GeneratorSettings, safe_name

ORG, JOB = "acme", "job-http"


class CutAfter:
    """Closes the connection after `limit` bytes of body, for the next `times` answers (a
    learner's host that goes away mid-download); notes each request's Range header."""

    def __init__(self, app) -> None:
        self.app = app
        self.limit = 0
        self.times = 0
        self.ranges: list[str | None] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        wanted = dict(scope["headers"]).get(b"range")
        self.ranges.append(wanted.decode() if wanted else None)
        if self.times <= 0:
            await self.app(scope, receive, send)
            return
        self.times -= 1
        sent = 0

        async def cutting(message) -> None:
            nonlocal sent
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if sent + len(body) >= self.limit:
                    await send({**message, "body": body[: self.limit - sent], "more_body": True})
                    raise ConnectionAbortedError("cut mid-download (test)")
                sent += len(body)
            await send(message)

        await self.app(scope, receive, cutting)


class Learner:
    """The learner's weights route on a real server, over a store of its own."""

    def __init__(self, store: Path, key: SigningKey) -> None:
        self.store = store
        self.key = key
        self.published = PublishedWeights()
        app = FastAPI()
        app.state.verifier = TokenVerifier(key.verify_key)
        install_error_handlers(app)
        app.include_router(weights_router(self.published, [store]))
        self.cut = CutAfter(app)
        self.server = ThreadedServer(self.cut)

    def token(self, scopes=(Scope.WEIGHTS_READ,), kind: str = "service", org: str | None = None):
        now = int(time.time())
        claims = TokenClaims(
            f"t_{uuid.uuid4().hex[:12]}", kind, "rollout-generator", org, frozenset(scopes),
            now, now + 600, "k",
        )  # fmt: skip
        return sign_token(self.key, claims)

    def publish(self, version: int, weights: Path, **changes) -> WeightVersion:
        """Put a weights file where the learner writes them and note the record."""
        path = self.store / ORG / JOB / f"v{version:06d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(weights, path)
        record = WeightVersion(
            job_id=JOB,
            org_id=ORG,
            version=version,
            step=version,
            uri=path.as_uri(),
            blake3=blake3.blake3(path.read_bytes()).hexdigest(),
            size_bytes=path.stat().st_size,
            dtype="float32",
            probe=ParityProbe(token_ids=[1, 2], logprobs=[0.0]),
        ).model_copy(update=changes)
        self.published.note(record)
        return record


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def perturbed(tiny, tmp_path_factory) -> tuple[Path, ParityProbe]:
    """Weights of the tiny model moved a little, and the probe the learner would send."""
    import torch
    from safetensors.torch import save_file

    state = load_file(str(tiny / "model.safetensors"))
    noise = torch.Generator().manual_seed(1)
    changed = {k: (v + 0.05 * torch.randn(v.shape, generator=noise)) for k, v in state.items()}
    path = tmp_path_factory.mktemp("perturbed") / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in changed.items()}, str(path))
    engine = TorchEngine(tiny)
    engine._apply_state(load_file(str(path)))
    tokens = [1, 44, 30, 31, 40, 83, 100, 16, 17]
    return path, ParityProbe(token_ids=tokens, logprobs=engine.score_sync([tokens])[0])


@pytest.fixture
def learner(tmp_path):
    learner = Learner(tmp_path / "learner-shm", SigningKey.generate())
    with learner.server:
        yield learner


def generator_settings(
    tmp_path: Path, learner: Learner, monkeypatch, shm: Path | None = None, **changes
) -> GeneratorSettings:
    """A generator whose stores are not the learner's (it sees none of its files), unless
    `shm` names the learner's weights store (a generator on the learner's host)."""
    monkeypatch.setenv("RLNODE_WEIGHTS_DIR", str(shm or tmp_path / "generator-shm"))
    monkeypatch.setenv("RLNODE_CHECKPOINT_DIR", str(tmp_path / "generator-checkpoints"))
    fields = {
        "engine": "torch",
        "device": "cpu",
        "dtype": "float32",
        "weights_url": learner.server.url,
        "weights_dir": tmp_path / "fetched",
        "service_token": SecretStr(learner.token()),
        "weights_fetch_timeout_s": 10.0,
        **changes,
    }
    return GeneratorSettings(**fields)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def links_of(tmp_path: Path, generator_id: str) -> Path:
    """Where a generator of `generator_settings` keeps its links of the host's copies."""
    return tmp_path / "fetched" / "generators" / safe_name(generator_id)


def host_copies(tmp_path: Path) -> list[str]:
    """The digests of the whole versions the host holds."""
    shared = tmp_path / "fetched" / "shared"
    return sorted(p.name.removesuffix(".safetensors") for p in shared.glob("*.safetensors"))


def perturbed_again(weights: Path, directory: Path) -> Path:
    """Other bytes than `weights` (another digest), the same weights to within a float's
    last bit: the lowest mantissa byte of the last float32 has a bit flipped."""
    data = bytearray(weights.read_bytes())
    data[-4] ^= 1
    path = directory / "perturbed-again.safetensors"
    path.write_bytes(bytes(data))
    return path


async def test_a_version_this_host_cannot_see_is_downloaded_checked_and_loaded(
    tmp_path, learner, tiny, perturbed, monkeypatch
) -> None:
    weights, probe = perturbed
    settings = generator_settings(tmp_path, learner, monkeypatch)
    pool = EnginePool(settings)
    engines = await pool.for_job(JOB, ModelSpec(source=str(tiny)))
    first = learner.publish(1, weights, probe=probe)
    loaded = await pool.load(engines, first)
    assert loaded is not None and loaded.transport == "http"
    assert loaded.fetched is not None and loaded.fetched.resumes == 0
    assert engines.loaded_version == 1 and loaded.probe_max_abs_diff < 1e-4
    fetched = links_of(tmp_path, settings.generator_id) / ORG / JOB / "v000001.safetensors"
    assert blake3.blake3(fetched.read_bytes()).hexdigest() == first.blake3
    assert stat.S_IMODE(fetched.stat().st_mode) == 0o600
    assert stat.S_IMODE(fetched.parent.stat().st_mode) == 0o700
    # The generator's link of the host's copy, named by its digest; no temporary.
    assert leftovers(links_of(tmp_path, settings.generator_id)) == ["v000001.safetensors"]
    assert host_copies(tmp_path) == [first.blake3]
    assert fetched.samefile(tmp_path / "fetched" / "shared" / f"{first.blake3}.safetensors")

    # A newer version loaded: the older download goes. The job ends: all of them go.
    second = learner.publish(2, perturbed_again(weights, tmp_path), probe=probe)
    assert (await pool.load(engines, second)).transport == "http"
    assert leftovers(links_of(tmp_path, settings.generator_id)) == ["v000002.safetensors"]
    assert host_copies(tmp_path) == [second.blake3]
    await pool.release(JOB)
    assert leftovers(tmp_path / "fetched") == []
    await pool.close()


async def test_a_download_cut_midway_resumes_with_range_and_ends_whole(
    tmp_path, learner, perturbed, monkeypatch
) -> None:
    weights, _probe = perturbed
    version = learner.publish(1, weights)
    size = version.size_bytes
    learner.cut.limit, learner.cut.times = size // 3, 2  # cut twice, a third each time
    fetcher = WeightsFetcher(generator_settings(tmp_path, learner, monkeypatch), 0.01)
    fetched = await fetcher.fetch(version)
    assert fetched.resumes == 2
    assert blake3.blake3(fetched.path.read_bytes()).hexdigest() == version.blake3
    # Each try went on from the bytes the earlier ones had written.
    assert learner.cut.ranges == [None, f"bytes={size // 3}-", f"bytes={2 * (size // 3)}-"]
    fetcher.close()
    assert leftovers(tmp_path / "fetched") == []


async def test_the_generators_of_a_host_download_a_version_once_and_each_links_it(
    tmp_path, learner, perturbed, monkeypatch
) -> None:
    """An inference host runs a generator per engine: they share the host's directory, one
    downloads while the others wait for it, and each loads a link of its own, so one
    discarding its version does not pull the file from another."""
    weights, _probe = perturbed
    version = learner.publish(1, weights)
    fetchers = [
        WeightsFetcher(generator_settings(tmp_path, learner, monkeypatch, generator_id=name))
        for name in ("gen0", "gen1", "gen2")
    ]
    fetched = await asyncio.gather(*(f.fetch(version) for f in fetchers))
    assert learner.cut.ranges == [None]  # one GET for the three of them
    assert sorted(f.reused for f in fetched) == [False, True, True]
    copy = tmp_path / "fetched" / "shared" / f"{version.blake3}.safetensors"
    assert all(f.path.samefile(copy) for f in fetched) and copy.stat().st_nlink == 4
    assert blake3.blake3(copy.read_bytes()).hexdigest() == version.blake3

    newer = version.model_copy(update={"version": 2})
    fetchers[0].discard_older(newer)  # gen0 loaded a newer version: its link goes
    assert not fetched[0].path.exists() and fetched[1].path.read_bytes() == copy.read_bytes()
    fetchers[1].close()
    assert host_copies(tmp_path) == [version.blake3]  # gen2 still links it
    fetchers[2].discard_job(JOB)
    assert host_copies(tmp_path) == []  # linked by none: gone
    fetchers[0].close()
    fetchers[2].close()
    assert leftovers(tmp_path / "fetched") == []


async def test_a_download_a_killed_generator_left_half_way_goes_on_from_its_bytes(
    tmp_path, learner, perturbed, monkeypatch
) -> None:
    """A generator SIGKILLed while it downloads: its lock goes with its process, and the
    generator that was waiting for the version goes on from the bytes it had written."""
    weights, _probe = perturbed
    version = learner.publish(1, weights)
    settings = generator_settings(tmp_path, learner, monkeypatch, generator_id="waiting")
    shared = settings.fetched_weights_dir / "shared"
    shared.mkdir(parents=True)
    half = version.size_bytes // 2
    downloading = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        KILLED_MID_DOWNLOAD,
        str(shared),
        version.blake3,
        str(weights),
        str(half),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert downloading.stdout is not None
        assert await asyncio.wait_for(downloading.stdout.readline(), 60) == b"holding\n"
        waiting = asyncio.ensure_future(WeightsFetcher(settings).fetch(version))
        await asyncio.sleep(0.5)
        assert not waiting.done() and learner.cut.ranges == []  # it waits for the other
        downloading.send_signal(signal.SIGKILL)
        fetched = await asyncio.wait_for(waiting, 30)
    finally:
        if downloading.returncode is None:
            downloading.kill()
        await downloading.wait()
    assert learner.cut.ranges == [f"bytes={half}-"] and not fetched.reused
    assert blake3.blake3(fetched.path.read_bytes()).hexdigest() == version.blake3


# A generator's download, half-way when it is killed: the digest's lock held and half the
# file in the host's partial download.
KILLED_MID_DOWNLOAD = """
import sys, time
from pathlib import Path
from rlnode_services.rollout_generator.fetch import HostCopies
shared, digest, weights, half = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
copies = HostCopies(shared)
with copies.locked(digest) as held:
    assert held
    copies.partial(digest).write_bytes(weights.read_bytes()[:half])
    print("holding", flush=True)
    time.sleep(600)
"""


async def test_a_download_that_keeps_breaking_is_refused_after_its_retries(
    tmp_path, learner, perturbed, monkeypatch
) -> None:
    weights, _probe = perturbed
    version = learner.publish(1, weights)
    learner.cut.limit, learner.cut.times = 1000, 100
    settings = generator_settings(tmp_path, learner, monkeypatch, weights_fetch_retries=2)
    fetcher = WeightsFetcher(settings, 0.01)
    with pytest.raises(FetchFailed, match=r"broke 3 time\(s\)"):
        await fetcher.fetch(version)
    assert len(learner.cut.ranges) == 3
    assert leftovers(tmp_path / "fetched") == []  # the partial file is gone


async def test_a_download_with_another_digest_is_refused_and_nothing_is_loaded(
    tmp_path, learner, tiny, perturbed, monkeypatch
) -> None:
    weights, probe = perturbed
    pool = EnginePool(generator_settings(tmp_path, learner, monkeypatch))
    engines = await pool.for_job(JOB, ModelSpec(source=str(tiny)))
    forged = learner.publish(1, weights, probe=probe, blake3="0" * 64)
    with pytest.raises(WeightsRefused, match="BLAKE3 digest of the download"):
        await pool.load(engines, forged)
    assert engines.loaded_version == 0
    assert leftovers(tmp_path / "fetched") == []
    # A size that is not the file's: refused the same way, once the learner checks it too.
    wrong_size = learner.publish(2, weights, probe=probe)
    learner.published.note(wrong_size.model_copy(update={"size_bytes": 10}))
    with pytest.raises(WeightsRefused, match="404"):
        await pool.load(engines, wrong_size.model_copy(update={"size_bytes": 10}))
    assert engines.loaded_version == 0 and leftovers(tmp_path / "fetched") == []
    await pool.close()


async def test_a_generator_that_sees_the_file_reads_it_unless_told_to_always_fetch(
    tmp_path, learner, tiny, perturbed, monkeypatch
) -> None:
    weights, probe = perturbed
    version = learner.publish(1, weights, probe=probe)
    same_host = generator_settings(tmp_path, learner, monkeypatch, shm=learner.store)
    pool = EnginePool(same_host)
    engines = await pool.for_job(JOB, ModelSpec(source=str(tiny)))
    loaded = await pool.load(engines, version)
    assert loaded is not None and loaded.transport == "shared-memory"
    assert learner.cut.ranges == []  # nothing was asked of the learner
    await pool.close()

    always = generator_settings(
        tmp_path, learner, monkeypatch, shm=learner.store, weights_fetch="always"
    )
    pool = EnginePool(always)
    engines = await pool.for_job(JOB, ModelSpec(source=str(tiny)))
    loaded = await pool.load(engines, version)
    assert loaded is not None and loaded.transport == "http" and learner.cut.ranges == [None]
    await pool.close()


def test_a_generator_on_another_host_completes_a_job_on_versions_it_downloads(
    tmp_path, tiny
) -> None:
    """A whole node whose generator has stores of its own (it cannot see the learner's
    weights store nor its checkpoints) and GENERATOR_WEIGHTS_URL set to the learner: every
    version is loaded over HTTP, and the job completes."""
    options = NodeOptions(
        data_dir=tmp_path / "node",
        services=("credential-vault", "taskapp-gateway", "learner"),
        env={"learner": {"RLNODE_WEIGHTS_DIR": str(tmp_path / "learner-shm")}},
    )
    with LocalNode(options) as node:
        org = node.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("tk")})
        assert node.register_example_task_app(org, "copy", "copy_task")["ok"]
        elsewhere = tmp_path / "generator-host"
        generator = ServiceProcess(
            GENERATOR,
            free_port(),
            tmp_path / "generator.log",
            env={
                **node.kafka_env(GENERATOR.name),  # its login, the node's CA
                "KAFKA_SESSION_TIMEOUT_MS": "6000",
                "KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
                "GENERATOR_VAULT_URL": node.url("credential-vault"),
                "GENERATOR_GATEWAY_URL": node.url("taskapp-gateway"),
                "GENERATOR_SERVICE_TOKEN": node.service_token(
                    [str(s) for s in GENERATOR.token_scopes], GENERATOR.name
                ),
                "GENERATOR_GENERATOR_ID": "remote",
                "GENERATOR_WEIGHTS_URL": node.url(LEARNER.name),
                "GENERATOR_WEIGHTS_DIR": str(elsewhere / "fetched"),
                "RLNODE_DATA_DIR": str(elsewhere / "data"),
                "RLNODE_CHECKPOINT_DIR": str(elsewhere / "checkpoints"),
                "RLNODE_WEIGHTS_DIR": str(elsewhere / "shm"),
            },
        ).start()
        try:
            generator.wait_healthy()
            job = example_job(
                "copy_task", tiny, steps=3, group_size=4, prompts_per_step=2, checkpoint_every=3
            )
            _job_id, events = node.run_job(org, job)  # raises unless it completed
            loaded = [e for e in events if e.type is JobEventType.WEIGHTS_LOADED]
            # v1 before step 2's work is sampled; the last may come after the job's end.
            assert 1 in [e.data["version"] for e in loaded], [e.message for e in events]
            assert {e.data["transport"] for e in loaded} == {"http"}
            assert all(e.data["fetch_s"] > 0 and "over HTTP" in e.message for e in loaded)
            # The ended job's downloads go with its engines.
            wait_until(lambda: not leftovers(elsewhere / "fetched"), 30, "downloads removed")
        finally:
            assert generator.stop() == 0, generator.log_tail()
