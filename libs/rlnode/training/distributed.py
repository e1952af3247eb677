"""Data parallelism for a service that owns the training loop: the calling process is rank 0
and drives the loop; ranks 1..N-1 are spawned worker processes that hold their shard of the
model (FSDP2, see `rlnode.training.trainer`) and follow rank 0's commands (a step on this
batch, score the probe, gather the weights, save or load a checkpoint), each training on its
share of the batch. NCCL on GPUs, gloo on the CPU.

Every command is collective (the ranks gather each other's shards); rank 0 writes the files."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlnode.training.grpo import Sample
from rlnode.training.trainer import StepMetrics, Trainer, TrainerConfig

log = logging.getLogger("rlnode.training.distributed")

# A collective waits this long for a rank that went away before it fails (instead of hanging).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class DataParallelError(RuntimeError):
    pass


def _backend(devices: list[str]) -> str:
    return "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, devices: list[str]) -> None:
    device = devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        _backend(devices),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _receive() -> tuple[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(
    rank: int,
    world: int,
    port: int,
    model_path: str,
    config: TrainerConfig,
    devices: list[str],
    reference_on_trainer: bool,
    reference_device: str | None,
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _init(rank, world, port, devices)
    try:
        trainer = Trainer(
            model_path,
            config,
            device=devices[rank],
            reference_on_trainer=reference_on_trainer,
            reference_device=reference_device,
        )
        while True:
            command, argument = _receive()
            if command == "stop":
                return
            getattr(trainer, command)(*argument)
    finally:
        dist.destroy_process_group()


class DataParallelTrainer:
    """A `Trainer` over several devices (`devices[0]` is this process's). Offers the same
    methods as `Trainer`; with one device it is a plain `Trainer` with no processes."""

    def __init__(
        self,
        model_path: Path | str,
        config: TrainerConfig,
        devices: list[str],
        *,
        reference_on_trainer: bool = False,
        reference_device: str | None = None,
    ) -> None:
        if not devices:
            raise DataParallelError("data parallelism needs at least one device")
        if config.lora is not None and len(devices) > 1:  # before any rank starts
            raise ValueError(
                "LoRA over several training devices is not supported yet (FSDP2 with PEFT's "
                "adapters is untested here): train on one (topology.training_gpus = 1)"
            )
        if dist.is_initialized():
            raise DataParallelError(
                "a process group exists already in this process: one data-parallel job at a time"
            )
        self.devices = list(devices)
        self.world = len(devices)
        self._workers: list[BaseProcess] = []
        if self.world > 1:
            port = _free_port()
            context = mp.get_context("spawn")
            for rank in range(1, self.world):
                process = context.Process(
                    target=_worker,
                    args=(
                        rank,
                        self.world,
                        port,
                        str(model_path),
                        config,
                        self.devices,
                        reference_on_trainer,
                        reference_device,
                    ),
                    name=f"rlnode-trainer-rank{rank}",
                    daemon=True,
                )
                process.start()
                self._workers.append(process)
            _init(0, self.world, port, self.devices)
        self.trainer = Trainer(
            model_path,
            config,
            device=self.devices[0],
            reference_on_trainer=reference_on_trainer,
            reference_device=reference_device,
        )

    def __getattr__(self, name: str) -> Any:
        # tokenizer, config, steps: the same on every rank.
        return getattr(self.__dict__["trainer"], name)

    def _command(self, command: str, argument: Any = None) -> None:
        if self.world == 1:
            return
        dead = [w.name for w in self._workers if not w.is_alive()]
        if dead:
            raise DataParallelError(
                f"training rank(s) {', '.join(dead)} exited; the job cannot go on data parallel"
            )
        dist.broadcast_object_list([(command, argument)], src=0)

    def step(self, samples: list[Sample]) -> StepMetrics:
        if len(samples) < self.world:
            raise ValueError(
                f"{len(samples)} sample(s) cannot be split over {self.world} training devices"
            )
        self._command("step", (samples,))
        return self.trainer.step(samples)

    def score(self, token_ids: list[int]) -> list[float]:
        self._command("score", (token_ids,))
        return self.trainer.score(token_ids)

    def save_weights(self, path: Path, dtype: str = "float32") -> tuple[str, int]:
        self._command("save_weights", (path, dtype))
        return self.trainer.save_weights(path, dtype)

    def save_checkpoint(self, directory: Path, state: dict[str, Any]) -> Path:
        self._command("save_checkpoint", (directory, state))
        return self.trainer.save_checkpoint(directory, state)

    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        self._command("load_checkpoint", (directory,))
        return self.trainer.load_checkpoint(directory)

    def close(self) -> None:
        if self.world == 1:
            return
        try:
            self._command("stop")
        except DataParallelError:
            pass
        finally:
            for worker in self._workers:
                worker.join(timeout=30)
                if worker.is_alive():
                    worker.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
