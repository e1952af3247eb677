"""Data parallelism for a service that owns the training loop: the calling process is rank 0
and drives the loop; the other ranks hold their shard of the model (FSDP2, see
`rlnode.training.trainer`) and follow rank 0's commands (a step on this batch, score the
probe, gather the weights, save or load a checkpoint), each training on its share of the
batch. NCCL on GPUs, gloo on the CPU.

The other ranks are spawned worker processes on this host (one per further device), and,
with rank hosts (`rlnode.training.rank_hosts`), the long-lived ranks other hosts lend
through the learner's rendezvous: they come after this host's in rank order.

Every command is collective (the ranks gather each other's shards); rank 0 writes the files.
A rank that exits, stops answering or fails makes every later call raise `DataParallelError`
naming it; `close` then ends the job's ranks without waiting on them."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlnode.training.grpo import Sample
from rlnode.training.losses.tinker import TokenLoss
from rlnode.training.rank_hosts import DataParallelError, RankHub, RemoteRanks, backend_for
from rlnode.training.trainer import StepMetrics, TokenDatum, TokenPass, Trainer, TrainerConfig

__all__ = ["COLLECTIVE_TIMEOUT", "DataParallelError", "DataParallelTrainer"]

log = logging.getLogger("rlnode.training.distributed")

# A collective waits this long for a rank that went away before it fails (instead of hanging).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# How long rank 0 waits for a live rank's stack once it asked for it (SIGUSR1).
STACK_WAIT_S = 5.0


@dataclass(frozen=True)
class _Rendezvous:
    """How the ranks meet: through a store (rank 0's on a loopback port when the ranks are
    this host's alone, the rank hosts' otherwise) under a job's prefix."""

    backend: str
    world: int
    timeout: datetime.timedelta
    store_address: tuple[str, int]
    prefix: str = ""


def _ready_key(rank: int) -> str:
    return f"ready/{rank}"


def _built_key(rank: int) -> str:
    return f"built/{rank}"


def _command_key(number: int) -> str:
    return f"cmd/{number}"


def _init(rank: int, device: str, rendezvous: _Rendezvous, store: dist.Store | None) -> dist.Store:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if store is None:  # a spawned rank: a client of the learner's store
        address, port = rendezvous.store_address
        store = dist.TCPStore(address, port, is_master=False, timeout=rendezvous.timeout)
        # Rank 0 waits for this (watching that the rank lives) before the process group's
        # own rendezvous, which would wait out the whole timeout for a rank that died.
        store.set(rendezvous.prefix + _ready_key(rank), "1")
    dist.init_process_group(
        rendezvous.backend,
        store=dist.PrefixStore(rendezvous.prefix + "pg/", store),
        rank=rank,
        world_size=rendezvous.world,
        timeout=rendezvous.timeout,
    )
    return store


def _next_command(store: dist.Store, key: str, parent: int) -> bool:
    """Waits until rank 0 announces its next command under `key` (True), or until rank 0 is
    gone (False): its store closed the connection, or this process was re-parented."""
    while True:
        try:
            store.wait([key])  # the store's timeout, the collectives' (it warns as it passes)
            return True
        except dist.DistNetworkError:
            return False
        except dist.DistStoreError:  # the timeout passed: a job may wait that long for data
            if os.getppid() != parent:
                return False


def _receive() -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(
    rank: int,
    rendezvous: _Rendezvous,
    model_path: str,
    config: TrainerConfig,
    devices: list[str],
    reference_on_trainer: bool,
    reference_device: str | None,
    stacks: str,
) -> None:
    parent = os.getppid()
    # Rank 0 asks for this rank's stack (SIGUSR1) when a collective fails with the rank
    # alive: written by the interpreter's C handler, so a rank stuck in native code (a
    # collective, a kernel) answers too.
    stack_file = open(_stack_path(stacks, rank), "w")  # open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    store = _init(rank, devices[rank], rendezvous, None)
    try:
        trainer = Trainer(
            model_path,
            config,
            device=devices[rank],
            reference_on_trainer=reference_on_trainer,
            reference_device=reference_device,
        )
        store.set(rendezvous.prefix + _built_key(rank), "1")
        # The next command is awaited in rank 0's store, not in a collective: a collective
        # would fail at its timeout (a job paused for its Task App waits longer), and the
        # store's connection ends with rank 0 if rank 0 is killed.
        number = 0
        while _next_command(store, rendezvous.prefix + _command_key(number), parent):
            number += 1
            command, argument = _receive()
            if command == "stop":
                return
            getattr(trainer, command)(*argument)
    finally:
        dist.destroy_process_group()


def _stack_path(stacks: str, rank: int) -> Path:
    return Path(stacks) / f"rank{rank}.txt"


class DataParallelTrainer:
    """A `Trainer` over several devices (`devices[0]` is this process's), and over the ranks
    the hosts of `rank_hosts` lend. Offers the same methods as `Trainer`; with one device
    and no rank hosts it is a plain `Trainer` with no processes."""

    def __init__(
        self,
        model_path: Path | str,
        config: TrainerConfig,
        devices: list[str],
        *,
        reference_on_trainer: bool = False,
        reference_device: str | None = None,
        rank_hosts: RankHub | None = None,
        collective_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
    ) -> None:
        """`collective_timeout`: how long this host's ranks wait in one collective (and in
        the rendezvous) for the others before the job fails with the stacks of those that
        live; rank hosts have theirs (`RankHub.timeout_s`)."""
        if not devices:
            raise DataParallelError("data parallelism needs at least one device")
        if config.lora is not None and (len(devices) > 1 or rank_hosts is not None):
            raise ValueError(  # before any rank starts
                "LoRA over several training devices is not supported yet (FSDP2 with PEFT's "
                "adapters is untested here): train on one (topology.training_gpus = 1)"
            )
        if dist.is_initialized():
            raise DataParallelError(
                "a process group exists already in this process: one data-parallel job at a time"
            )
        self.devices = list(devices)
        self.remote: RemoteRanks | None = None
        self._workers: list[BaseProcess] = []
        self._store: dist.TCPStore | None = None  # rank 0's, when the ranks are this host's
        self._commands = 0  # announced in the store, where spawned ranks wait for them
        self._stacks = ""  # where spawned ranks write their stacks when asked
        self._timeout = collective_timeout
        self._broken = False
        self.world = len(devices)
        try:
            self._start(model_path, config, reference_on_trainer, reference_device, rank_hosts)
        except BaseException:
            self._broken = True
            self.close()
            raise

    def _start(
        self,
        model_path: Path | str,
        config: TrainerConfig,
        reference_on_trainer: bool,
        reference_device: str | None,
        rank_hosts: RankHub | None,
    ) -> None:
        if rank_hosts is not None:
            # Rank hosts put a reference beside their policy (the learner's devices are not
            # theirs); the model must be where they can load it too (by path or hub id).
            spec = (str(model_path), config, reference_on_trainer, Path(model_path).exists())
            self.remote = rank_hosts.claim(self.devices, spec)
            self.world += len(self.remote)
            rendezvous = _Rendezvous(
                backend_for(self.devices + self.remote.devices()),
                self.world,
                datetime.timedelta(seconds=rank_hosts.timeout_s),
                store_address=(rank_hosts.address, rank_hosts.port),
                prefix=self.remote.prefix,
            )
        elif self.world > 1:
            # Rank 0's store takes a port the OS gives it, bound before any rank starts: a
            # port found free and bound later can be taken in between (CI saw a rendezvous
            # hang with xdist workers starting trainers at once).
            self._store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, timeout=self._timeout, wait_for_workers=False
            )
            rendezvous = _Rendezvous(
                backend_for(self.devices),
                self.world,
                self._timeout,
                store_address=("127.0.0.1", self._store.port),
            )
        if self.world > 1:
            self._stacks = tempfile.mkdtemp(prefix="rlnode-rank-stacks-")
            context = mp.get_context("spawn")
            for rank in range(1, len(self.devices)):
                process = context.Process(
                    target=_worker,
                    args=(
                        rank,
                        rendezvous,
                        str(model_path),
                        config,
                        self.devices,
                        reference_on_trainer,
                        reference_device,
                        self._stacks,
                    ),
                    name=f"rlnode-trainer-rank{rank}",
                    daemon=True,
                )
                process.start()
                self._workers.append(process)
            if self._store is not None:
                self._wait_for_workers(
                    self._store, rendezvous, _ready_key, "reached the rendezvous"
                )
            with self._collective():
                _init(
                    0, self.devices[0], rendezvous, rank_hosts.store if rank_hosts else self._store
                )
        self.trainer = Trainer(
            model_path,
            config,
            device=self.devices[0],
            reference_on_trainer=reference_on_trainer,
            reference_device=reference_device,
        )
        if self.remote is not None and rank_hosts is not None:
            self.remote.wait_for("ready", rank_hosts.timeout_s, "did not build its trainer")
        if self._store is not None:  # before the first command: a rank still loading the
            # model would make rank 0's first collective wait for it, its timeout counting
            self._wait_for_workers(self._store, rendezvous, _built_key, "built its trainer")

    def _wait_for_workers(
        self, store: dist.TCPStore, rendezvous: _Rendezvous, key: Callable[[int], str], what: str
    ) -> None:
        """Until every spawned rank set its `key` (it `what`); DataParallelError naming
        the first that exited before (its start: spawning, importing torch, its device,
        loading the model), or the ranks late past the timeout, with their stacks."""
        keys = {rank: rendezvous.prefix + key(rank) for rank in range(1, len(self.devices))}
        deadline = time.monotonic() + rendezvous.timeout.total_seconds()
        while not store.check(list(keys.values())):
            for worker in self._workers:
                if not worker.is_alive():
                    raise DataParallelError(
                        f"training rank {worker.name} exited (code {worker.exitcode}) before "
                        f"it {what}; its error is in this service's log"
                    )
            if time.monotonic() > deadline:
                late = [r for r, k in keys.items() if not store.check([k])]
                raise DataParallelError(
                    f"training rank(s) {', '.join(map(str, late))} had not {what} after "
                    f"{rendezvous.timeout.total_seconds():g} s; their stacks:\n"
                    + self._live_stacks(late)
                )
            time.sleep(0.1)

    def __getattr__(self, name: str) -> Any:
        # tokenizer, config, steps: the same on every rank.
        return getattr(self.__dict__["trainer"], name)

    def _exited(self) -> list[str]:
        return [w.name or "" for w in self._workers if not w.is_alive()]

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """A failure inside a collective leaves the ranks out of step: name the ranks that
        went away (or failed) when there are some."""
        try:
            yield
        except DataParallelError:
            self._broken = True
            raise
        except Exception as e:
            if self.world == 1:
                raise
            self._broken = True
            if self.remote is not None:
                diagnosis = self.remote.diagnose(
                    e, lambda: [f"training {name} exited" for name in self._exited()]
                )
                if diagnosis is e:
                    raise
                raise diagnosis from e
            exited = self._exited()
            if exited:
                raise DataParallelError(
                    f"training rank(s) {', '.join(exited)} exited; the job cannot go on "
                    "data parallel"
                ) from e
            if isinstance(e, RuntimeError):  # gloo's or NCCL's: a rank that lives is stuck
                stacks = self._live_stacks()
                log.error("a collective failed (%s); the other ranks' stacks:\n%s", e, stacks)
                raise DataParallelError(
                    f"a collective failed while every training rank lived (rank 0 waits "
                    f"{self._timeout.total_seconds():g} s for the others): "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. "
                    f"The other ranks' stacks:\n{stacks}"
                ) from e
            raise

    def _live_stacks(self, ranks: list[int] | None = None) -> str:
        """The Python stacks of this host's other ranks (`ranks`, default all) that live,
        each asked for with SIGUSR1 (faulthandler writes it); a rank that does not answer
        within STACK_WAIT_S is named as such (a stopped process answers when it runs
        again)."""
        asked = {}
        for rank, worker in enumerate(self._workers, start=1):
            if ranks is not None and rank not in ranks:
                continue
            if worker.is_alive() and worker.pid is not None:
                path = _stack_path(self._stacks, rank)
                asked[rank] = (worker, path, path.stat().st_size if path.exists() else 0)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGUSR1)
        out: list[str] = []
        deadline = time.monotonic() + STACK_WAIT_S
        for worker, path, before in asked.values():
            text = ""
            while time.monotonic() < deadline:
                time.sleep(0.1)  # faulthandler writes the whole dump at once, threads apart
                written = path.read_text(errors="replace")[before:] if path.exists() else ""
                if written and written == text:
                    break
                text = written
            out.append(
                f"--- {worker.name} (pid {worker.pid}):\n{text.rstrip()}"
                if text
                else f"--- {worker.name} (pid {worker.pid}): no stack within {STACK_WAIT_S:g} s"
            )
        return "\n".join(out)

    def _command(self, command: str, argument: Any = None) -> None:
        if self.world == 1:
            return
        if self._broken:
            raise DataParallelError("the training ranks are out of step after a failure")
        dead = self._exited()
        if dead:
            self._broken = True
            raise DataParallelError(
                f"training rank(s) {', '.join(dead)} exited; the job cannot go on data parallel"
            )
        with self._collective():
            if self.remote is not None:
                self.remote.check()
                self.remote.ring(command)
            elif self._store is not None:
                self._store.set(_command_key(self._commands), command)
                self._commands += 1
            dist.broadcast_object_list([(command, argument)], src=0)

    def _run(self, command: str, *argument: Any) -> Any:
        self._command(command, argument)
        with self._collective():
            return getattr(self.trainer, command)(*argument)

    def step(self, samples: list[Sample], index: int | None = None) -> StepMetrics:
        if len(samples) < self.world:
            raise ValueError(
                f"{len(samples)} sample(s) cannot be split over {self.world} training devices"
            )
        metrics: StepMetrics = self._run("step", samples, index)
        return metrics

    def forward_backward(
        self, datums: list[TokenDatum], loss: TokenLoss, backward: bool = True
    ) -> TokenPass:
        result: TokenPass = self._run("forward_backward", datums, loss, backward)
        return result

    def optim_step(self, *params: float) -> float:
        norm: float = self._run("optim_step", *params)
        return norm

    def score(self, token_ids: list[int]) -> list[float]:
        scores: list[float] = self._run("score", token_ids)
        return scores

    def save_weights(self, path: Path, dtype: str = "float32") -> tuple[str, int]:
        written: tuple[str, int] = self._run("save_weights", path, dtype)
        return written

    def save_checkpoint(self, directory: Path, state: dict[str, Any]) -> Path:
        saved: Path = self._run("save_checkpoint", directory, state)
        return saved

    def load_checkpoint(self, directory: Path, with_optimizer: bool = True) -> dict[str, Any]:
        loaded: dict[str, Any] = self._run("load_checkpoint", directory, with_optimizer)
        return loaded

    def close(self) -> None:
        """End the job on every rank: "stop" when they are in step, else the rank hosts are
        told to abort and this host's workers are ended at once."""
        if self.world == 1 and self.remote is None:
            return
        try:
            if not self._broken:
                self._command("stop")
        except DataParallelError:
            pass
        finally:
            if self.remote is not None and self._broken:
                with contextlib.suppress(dist.DistError):
                    self.remote.abort()
            for worker in self._workers:
                worker.join(timeout=1 if self._broken else 30)
                if worker.is_alive():
                    worker.kill()
                    worker.join()
            if dist.is_initialized():
                dist.destroy_process_group()
            if self._stacks:
                shutil.rmtree(self._stacks, ignore_errors=True)
