"""The policy side of one training run: its trainer (on a thread of its own), the weight
versions generators load, and the checkpoints it resumes from.

Two drivers use it. The job loop (rlnode.training.loop) issues rollout work, gathers
trajectories and calls `train`; the Tinker API's driver (rlnode.training.tinker) calls
`forward_backward` and `optim_step` as its client asks. Both see the same weight versions,
checkpoints and events, so a run of either is a job to the rest of the node."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from rlnode.messages import EventData, JobEventType, ParityProbe, WeightVersion
from rlnode.messages.config import LoraSpec
from rlnode.messages.jobs import CheckpointSavedData, WeightsPublishedData
from rlnode.service.stores import job_dir
from rlnode.training.distributed import DataParallelTrainer
from rlnode.training.rank_hosts import RankHub
from rlnode.training.storage import (
    StoreWriteFailed,
    free_bytes,
    remove_temporaries,
    write_waiting_for_room,
)
from rlnode.training.trainer import WEIGHT_DTYPES, TrainerConfig

log = logging.getLogger("rlnode.training.policy")
T = TypeVar("T")
EventSink = Callable[[JobEventType, str, EventData | None], Awaitable[None]]
WeightsSink = Callable[[WeightVersion], Awaitable[None]]


class JobCancelled(Exception):
    pass


class JobFailed(Exception):
    pass


class Policy:
    def __init__(
        self,
        run_id: str,
        org_id: str,
        root: Path,
        model_source: str,
        trainer_config: TrainerConfig,
        devices: list[str],
        *,
        publish_weights: WeightsSink,
        event: EventSink,
        cancelled: asyncio.Event,
        kept_versions: int,
        adapter: LoraSpec | None = None,
        reference_on_trainer: bool = False,
        reference_device: str | None = None,
        rank_hosts: RankHub | None = None,
        weights_root: Path | None = None,
        weights_dtype: str = "float32",
        max_checkpoint_bytes: int | None = None,
        disk_full_wait_s: float = 600.0,
        collective_timeout_s: float = 600.0,
    ) -> None:
        """`root`: the run's directory (checkpoints, and weights when the weights store has
        no room); `weights_root`: the weights store (None: beside the checkpoints);
        `kept_versions`: weight versions kept for generators still loading them;
        `cancelled`: set when the run is to stop (a write waiting for room gives up)."""
        self.run_id, self.org_id, self.root = run_id, org_id, root
        self.model_source = model_source
        self.trainer_config = trainer_config
        self.devices = devices
        self.adapter = adapter
        self.reference_on_trainer = reference_on_trainer
        self.reference_device = reference_device
        self.rank_hosts = rank_hosts
        self.weights_root = weights_root
        self.weights_dtype = weights_dtype
        self.kept_versions = kept_versions
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.disk_full_wait_s = disk_full_wait_s
        self.collective_timeout = datetime.timedelta(seconds=collective_timeout_s)
        self._publish, self._event, self.cancelled = publish_weights, event, cancelled
        self.weights_dir = root / "weights"
        self.trainer: DataParallelTrainer | None = None
        # The newest weight version published. Monotonic across restarts (a resumed run
        # publishes its checkpoint's weights under a new number), so generators that loaded
        # weights from after the checkpoint roll back to it.
        self.version = 0
        self.last_checkpoint: Path | None = None
        # Why the run waits for room in a store, while it does (None: it does not).
        self.waiting_for_room: str | None = None
        # The trainer's work runs on one thread of the run's own. glibc gives each thread
        # that allocates a heap (arena) of its own and keeps what is freed there: steps run
        # on whichever pool thread was free grew the learner by a step's activations per
        # thread (SmolLM2-135M: 4.4 GiB on one thread; 8 GiB after 4 steps on fresh threads,
        # and an in-process job killed for memory at 24 GiB after 8 steps).
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"trainer-{run_id}")

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def started(self) -> DataParallelTrainer:
        if self.trainer is None:
            raise RuntimeError("the policy's trainer is not started")
        return self.trainer

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the training ranks (DataParallelError: a rank could not start;
        ValueError: the config does not fit the model) and choose where weights go."""
        self.trainer = await self.on_trainer_thread(
            DataParallelTrainer,
            self.model_source,
            self.trainer_config,
            self.devices,
            reference_on_trainer=self.reference_on_trainer,
            reference_device=self.reference_device,
            rank_hosts=self.rank_hosts,
            collective_timeout=self.collective_timeout,
        )
        self.weights_dir = await asyncio.to_thread(self._choose_weights_dir)

    async def close(self) -> None:
        try:
            if self.trainer is not None:
                await self.on_trainer_thread(self.trainer.close)
        finally:
            self._thread.shutdown(wait=False)
            await asyncio.to_thread(self._discard_shared_weights)

    async def on_trainer_thread(self, function: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: function(*args, **kw))

    # -- weights --------------------------------------------------------------------------------

    def weights_path(self, version: int) -> Path:
        return self.weights_dir / f"v{version:06d}.safetensors"

    def published_versions(self) -> list[int]:
        if not self.weights_dir.exists():
            return []
        return [int(p.stem.removeprefix("v")) for p in self.weights_dir.glob("v*.safetensors")]

    def _choose_weights_dir(self) -> Path:
        """Weight versions are read once by each generator soon after they are written: on
        one node they belong in memory (the weights store, /dev/shm by default) when it holds
        the versions kept with room to spare; checkpoints stay on disk."""
        if self.weights_root is None:
            return self.root / "weights"
        size = self.started.published_parameters() * WEIGHT_DTYPES[self.weights_dtype].itemsize
        if free_bytes(self.weights_root) > 2 * self.kept_versions * size:
            return job_dir(self.weights_root, self.org_id, self.run_id)
        return self.root / "weights"

    def _discard_shared_weights(self) -> None:
        """The run's weight versions in the weights store (memory: /dev/shm) go when it ends,
        however it ends: they are working copies (checkpoints hold what lasts), and a node
        that kept every job's last versions filled its memory with them. A run that resumes
        publishes its weights again."""
        if self.weights_root is None:
            return
        shared = job_dir(self.weights_root, self.org_id, self.run_id)
        if self.weights_dir == shared and shared.is_dir():
            for version in shared.glob("v*.safetensors*"):
                version.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # something else put there stays
                shared.rmdir()

    def _prune_weights(self) -> None:
        for version in sorted(self.published_versions())[: -self.kept_versions]:
            self.weights_path(version).unlink(missing_ok=True)

    async def publish_weights(self, step: int, keep_as: str | None = None) -> WeightVersion:
        """Write the next weight version, tell the generators, and report it. `keep_as`:
        a name to keep it under for good, beside the checkpoints (else it is a working copy,
        pruned once `kept_versions` newer ones exist)."""
        trainer = self.started
        version = self.version + 1
        path = (
            self.root / "sampler" / f"{keep_as}.safetensors"
            if keep_as is not None
            else self.weights_path(version)
        )
        if keep_as is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        started = asyncio.get_running_loop().time()
        digest, size = await self._write(
            f"weights v{version:06d}", path, lambda: trainer.save_weights(path, self.weights_dtype)
        )
        probe_ids = self._probe_ids()
        probe = ParityProbe(
            token_ids=probe_ids, logprobs=await self.on_trainer_thread(trainer.score, probe_ids)
        )
        write_s = asyncio.get_running_loop().time() - started
        published = WeightVersion(
            job_id=self.run_id,
            org_id=self.org_id,
            version=version,
            step=step,
            uri=path.as_uri(),
            blake3=digest,
            size_bytes=size,
            dtype=self.weights_dtype,
            probe=probe,
            adapter=self.adapter,
        )
        await self._publish(published)
        self.version = version
        await asyncio.to_thread(self._prune_weights)
        await self._event(
            JobEventType.WEIGHTS_PUBLISHED,
            f"weights v{version} after step {step}",
            WeightsPublishedData(
                version=version,
                step=step,
                uri=path.as_uri(),
                blake3=digest,
                size_bytes=size,
                write_s=write_s,
            ),
        )
        return published

    def _probe_ids(self) -> list[int]:
        ids = self.started.tokenizer("The parity probe: 0123456789 abcdefghij")["input_ids"]
        return list(ids[:32]) if len(ids) >= 2 else [0, 1]

    # -- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(
        self, name: str, step: int, state: dict[str, Any], final: bool
    ) -> Path:
        """A whole checkpoint (model, optimizer, `state`) under checkpoints/`name`, reported
        as `checkpoint.saved`. Fails the run when its checkpoints pass the node's limit."""
        trainer = self.started
        path = self.checkpoints / name
        state = {"job_id": self.run_id, "step": step, "version": self.version, **state}
        await self._write(f"checkpoint {name}", path, lambda: trainer.save_checkpoint(path, state))
        if self.max_checkpoint_bytes is not None:
            used = await asyncio.to_thread(_bytes_under, self.checkpoints)
            if used > self.max_checkpoint_bytes:
                raise RuntimeError(
                    f"the job's checkpoints hold {used / 2**30:.2f} GiB, over this node's "
                    f"{self.max_checkpoint_bytes / 2**30:.2f} GiB per job "
                    "(LEARNER_MAX_CHECKPOINT_BYTES)"
                )
        self.last_checkpoint = path
        await self._event(
            JobEventType.CHECKPOINT_SAVED,
            f"checkpoint at step {step}",
            CheckpointSavedData(step=step, uri=path.as_uri(), final=final),
        )
        return path

    async def load_checkpoint(self, path: Path, with_optimizer: bool = True) -> dict[str, Any]:
        """Restore the trainer from `path` (the model, and the optimizer's state unless not
        `with_optimizer`, which starts it afresh); returns the checkpoint's saved state."""
        state = await self.on_trainer_thread(self.started.load_checkpoint, path, with_optimizer)
        self.version = max([self.version, state.get("version", 0), *self.published_versions()])
        return state

    async def resume(self, pattern: str = "step-*") -> dict[str, Any] | None:
        """Remove what writes cut short by a crash left, then restore the newest checkpoint
        matching `pattern` (None: there is none)."""
        for directory in {self.checkpoints, self.root / "weights", self.weights_dir}:
            if removed := await asyncio.to_thread(remove_temporaries, directory):
                log.warning("run %s: removed unfinished writes %s", self.run_id, removed)
        found = sorted(self.checkpoints.glob(pattern)) if self.checkpoints.exists() else []
        if not found:
            return None
        state = await self.load_checkpoint(found[-1])
        self.last_checkpoint = found[-1]
        log.info("run %s resumes from %s (step %d)", self.run_id, found[-1].name, state["step"])
        return state

    async def _write(self, what: str, path: Path, write: Callable[[], T]) -> T:
        """A checkpoint or weights write, paused while its store is full; one that cannot
        be done ends the run saying why (see rlnode.training.storage)."""
        try:
            return await write_waiting_for_room(
                write, what, path, self.disk_full_wait_s, self.cancelled, self._wait_for_room
            )
        except StoreWriteFailed as e:
            if self.cancelled.is_set():
                raise JobCancelled from e
            if self.last_checkpoint is None:
                raise JobFailed(f"{e}; the job has no checkpoint yet") from None
            raise JobFailed(
                f"{e}; its last checkpoint, {self.last_checkpoint}, is whole: a new job can "
                "start from it (model.source)"
            ) from None

    def _wait_for_room(self, why: str | None) -> None:
        self.waiting_for_room = why


def _bytes_under(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
