"""A training rank on a host other than the learner's: the worker torchrun starts there, one
per device (`rlnode trainer-ranks --join LEARNER:PORT` runs torchrun with the right
arguments, `rlnode.cli.ranks.torchrun_command`; the learner's README shows it whole):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1 --nproc-per-node N \
        --rdzv-backend c10d --rdzv-endpoint LEARNER:PORT --rdzv-id rlnode-HOST \
        --rdzv-conf is_host=false --local-addr HOST --max-restarts 1000000 \
        -m rlnode.training.rank_host --join LEARNER:PORT --host HOST

It lives across jobs: it registers its seat with the learner's rendezvous
(`rlnode.training.rank_hosts`), waits for a job, joins the job's process group, builds its
share of the trainer from the job's spec, follows rank 0's commands until "stop", releases
the trainer and waits for the next job. A job that goes wrong here (the model cannot be
loaded, a collective fails) is reported in the store and ends the process, as does one the
learner aborts while this rank is inside a command: torchrun starts a fresh one, which
registers again. When the learner goes away the process ends too."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import pickle
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlnode.training.network import source_address, split_endpoint, use_interface
from rlnode.training.rank_hosts import (
    BEAT_S,
    Offer,
    Seat,
    beat_key,
    first_line,
    offer_key,
    seat_key,
)
from rlnode.training.trainer import Trainer  # imported while waiting, not when a job starts

log = logging.getLogger("rlnode.training.rank_host")

WAIT_SLICE = datetime.timedelta(minutes=5)  # a store wait without end, in slices


def _connect(address: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=60))


def _wait(store: dist.Store, key: str) -> bytes:
    """The value of `key` once it is set, however long that takes (a lost learner raises
    DistNetworkError)."""
    while True:
        try:
            store.wait([key], WAIT_SLICE)
            return store.get(key)
        except dist.DistStoreError:  # the slice ran out
            continue


class _Watch(threading.Thread):
    """Beats this worker's counter every BEAT_S on a connection of its own, and ends the
    process when nothing else can: the learner is gone, or it aborted the job while this
    worker is inside a command (a collective that will never complete; torchrun starts a
    fresh worker, which registers again)."""

    def __init__(self, address: str, port: int, token: str) -> None:
        super().__init__(name="rank-watch", daemon=True)
        self.store = _connect(address, port)
        self.key = beat_key(token)
        self.job: str | None = None  # the prefix of the job being served
        self.busy = False  # inside a command, or joining the job

    def run(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
                job, busy = self.job, self.busy
                aborted = job is not None and busy and self.store.check([job + "abort"])
            except dist.DistError as e:
                log.error("the learner's rendezvous went away (%s): ending", first_line(e))
                os._exit(1)
            if aborted:
                log.error("the learner aborted the job while this rank was in it: ending")
                os._exit(1)
            threading.Event().wait(BEAT_S)


def _serve(store: dist.Store, offer: Offer, seat: Seat, watch: _Watch) -> None:
    """One job, from joining its process group to "stop" (or "abort")."""
    prefix = offer.prefix
    watch.job, watch.busy = prefix, True
    store.set(f"{prefix}took/{offer.rank}", seat.token)
    dist.init_process_group(
        offer.backend,
        store=dist.PrefixStore(prefix + "pg/", store),
        rank=offer.rank,
        world_size=offer.world,
        timeout=datetime.timedelta(seconds=offer.timeout_s),
    )
    trainer: Trainer | None = None
    try:
        try:
            trainer = _build(pickle.loads(store.get(prefix + "spec")), seat)
        except Exception as e:
            store.set(f"{prefix}failed/{offer.rank}", first_line(e))
            raise
        store.set(f"{prefix}ready/{offer.rank}", "")
        commands = 0
        while True:
            watch.busy = False
            command = _wait(store, f"{prefix}cmd/{commands}").decode()
            watch.busy = True
            commands += 1
            if command == "abort":  # the job failed elsewhere: nothing more comes
                return
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            name, argument = box[0]
            if name == "stop":
                return
            getattr(trainer, name)(*argument)
    except Exception as e:
        key = f"{prefix}failed/{offer.rank}"
        if not store.check([key]):
            store.set(key, first_line(e))
        raise
    finally:
        watch.job, watch.busy = None, False
        del trainer
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if seat.device.startswith("cuda"):
            torch.cuda.empty_cache()


def _build(spec: Any, seat: Seat) -> Trainer:
    model_path, config, reference_on_trainer, is_path = spec
    if is_path and not Path(model_path).exists():
        raise FileNotFoundError(
            f"the job's model {model_path} is not on rank host {seat.host}: every rank host "
            "must reach the model at the same path (a shared filesystem) or the job must "
            "name it by Hugging Face hub id"
        )
    try:
        return Trainer(
            model_path,
            config,
            device=seat.device,
            reference_on_trainer=reference_on_trainer,
        )
    except OSError as e:  # transformers' "not a local folder and not a valid model id"
        raise OSError(
            f"rank host {seat.host} cannot load the job's model {model_path} ({first_line(e)}): "
            "it must be reachable there by the same path or hub id"
        ) from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlnode.training.rank_host",
        description="A training rank that serves the learner's jobs (torchrun starts it).",
    )
    parser.add_argument("--join", required=True, help="the learner's LEARNER_RENDEZVOUS")
    parser.add_argument(
        "--host", help="this host's name in LEARNER_RANK_HOSTS (default: its address toward it)"
    )
    parser.add_argument("--device", help="default: cuda:LOCAL_RANK with GPUs, else cpu")
    parser.add_argument(
        "--ifname",
        help="the interface collectives use (default: the one this host reaches --join from)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    address, port = split_endpoint(args.join)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    device = args.device or (f"cuda:{local_rank}" if gpu else "cpu")
    local = source_address(address, port)
    host = args.host or local
    use_interface(args.ifname, local)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    try:
        return _serve_jobs(args.join, host, local_rank, local_world, device)
    except dist.DistNetworkError as e:
        log.error("the learner's rendezvous at %s went away (%s)", args.join, first_line(e))
        return 1


def _serve_jobs(join: str, host: str, local_rank: int, local_world: int, device: str) -> int:
    address, port = split_endpoint(join)
    store = _connect(address, port)
    token = uuid.uuid4().hex
    watch = _Watch(address, port, token)
    watch.start()
    jobs = 0
    while True:
        seat = Seat(host, local_rank, local_world, device, token, jobs, os.getpid())
        store.set(seat_key(host, local_rank), seat.to_json())
        log.info("%s waits for a job from %s", seat.name, join)
        offer = Offer(**json.loads(_wait(store, offer_key(token, jobs))))
        # Taken: not offered again until it registers anew after this job.
        store.delete_key(seat_key(host, local_rank))
        jobs += 1
        log.info("job %d: rank %d of %d", offer.job, offer.rank, offer.world)
        try:
            _serve(store, offer, seat, watch)
        except Exception:
            log.exception("job %d failed here; starting afresh", offer.job)
            return 1
        log.info("job %d done", offer.job)


if __name__ == "__main__":
    sys.exit(main())
