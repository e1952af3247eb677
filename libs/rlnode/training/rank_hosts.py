"""Training ranks on other hosts, the learner's side: the rendezvous it hosts and the ranks a
job claims from it.

The learner listens on LEARNER_RENDEZVOUS with a c10d TCPStore (bound to that address alone)
for as long as it runs. Each rank host runs torchrun with the c10d rendezvous backend pointed
at that store (`rlnode trainer-ranks --join ADDR:PORT`; `rlnode.training.rank_host` is the
worker torchrun starts): torchrun's agent joins its rendezvous there, starts one worker per
local device, and starts them again when they exit. A worker registers its seat (host, local
rank, device) in the same store, beats a counter every second and waits for a job.

A job (`claim`) takes a seat of every rank a listed host lends, numbers the ranks (the
learner's devices first, then the hosts in LEARNER_RANK_HOSTS order), leaves each seat an
offer and waits until every one took it; then every rank joins the job's own process group
over the store (under the job's prefix), the rank hosts build their trainer from the job's
spec (model path and TrainerConfig, pickled into the store) and say they are ready or why
not. Each command the learner then broadcasts is announced first in the store (the rank
hosts wait there, without a collective timeout, for as long as the learner waits for
trajectories). A host that never registered, stopped beating, or failed fails the job with
a `DataParallelError` naming it, within the join or collective timeout. docs/decisions.md
("Training ranks on other hosts") says why the learner hosts the store instead of being
launched by torchrun itself.

The store and the collectives carry pickles without authentication, as in every
torch.distributed deployment: the rendezvous port and the ranks' network belong on the
cluster's private network (docs/security.md)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from rlnode.training.network import split_endpoint, use_interface

log = logging.getLogger("rlnode.training.rank_hosts")

PREFIX = "rlnode/"
BEAT_S = 1.0  # a rank host's heartbeat period
STOPPED_AFTER_S = 5.0  # a heartbeat that has not moved this long is a rank that stopped


class DataParallelError(RuntimeError):
    """The ranks of a data-parallel trainer cannot go on together (one exited, stopped
    answering, never joined, or could not start the job)."""


@dataclass(frozen=True)
class Seat:
    """A rank a host lends, as its worker registered it."""

    host: str  # as the host names itself (its address toward the learner by default)
    local_rank: int
    local_world: int  # ranks this host lends
    device: str
    token: str  # this worker process's, for its offers and heartbeat
    jobs: int  # jobs it took before: its next offer's number
    pid: int

    @property
    def name(self) -> str:
        return f"rank host {self.host} (local rank {self.local_rank}, pid {self.pid})"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def backend_for(devices: list[str]) -> str:
    """NCCL when every rank trains on a GPU, gloo when none does; a mix cannot shard."""
    on_gpu = [d.startswith("cuda") for d in devices]
    if all(on_gpu):
        return "nccl"
    if not any(on_gpu):
        return "gloo"
    raise DataParallelError(
        f"the training ranks' devices mix GPUs and CPUs ({', '.join(devices)}): every rank "
        "must train on the same kind (rank hosts: --device)"
    )


def seat_key(host: str, local_rank: int) -> str:
    return f"{PREFIX}host/{host}/{local_rank}"


def beat_key(token: str) -> str:
    return f"{PREFIX}beat/{token}"


def offer_key(token: str, jobs: int) -> str:
    return f"{PREFIX}offer/{token}/{jobs}"


@dataclass(frozen=True)
class Offer:
    """What a seat's worker needs to join a job's process group."""

    job: int
    rank: int
    world: int
    backend: str
    timeout_s: float

    @property
    def prefix(self) -> str:
        return job_prefix(self.job)


def job_prefix(job: int) -> str:
    return f"{PREFIX}job/{job}/"


def first_line(error: BaseException) -> str:
    """An exception's message without the C++ stack torch.distributed appends."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class _Beats:
    """When each heartbeat counter last moved, in the learner's clock (hosts' clocks differ)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.seen: dict[str, tuple[int, float]] = {}

    def silent_for(self, token: str) -> float:
        """Seconds since the counter moved as far as we know (0 when first seen)."""
        value, now = int(self.store.add(beat_key(token), 0)), time.monotonic()
        last = self.seen.get(token)
        if last is None or last[0] != value:
            self.seen[token] = (value, now)
            return 0.0
        return now - last[1]

    def stopped(self, token: str) -> bool:
        return self.silent_for(token) > STOPPED_AFTER_S


class RankHub:
    """The rendezvous the learner hosts for rank hosts, for as long as it runs."""

    def __init__(
        self,
        endpoint: str,
        hosts: list[str],
        *,
        join_timeout_s: float = 60.0,
        timeout_s: float = 600.0,
        interface: str | None = None,
    ) -> None:
        if not hosts:
            raise ValueError("name at least one rank host")
        address, port = split_endpoint(endpoint)
        self.hosts = list(hosts)
        self.join_timeout_s = join_timeout_s
        self.timeout_s = timeout_s
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            listener = socket.create_server((address, port), family=family, backlog=128)
        except OSError as e:
            raise ValueError(f"the rendezvous cannot listen on {endpoint}: {e.strerror}") from None
        self.port = listener.getsockname()[1]
        self.address = address
        # The store listens on our socket (bound to this address alone; it owns the fd now).
        self.store = dist.TCPStore(
            address,
            self.port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.interface = use_interface(interface, address)
        # A NCCL collective that times out aborts its communicators and raises here (a job
        # error), instead of NCCL's default of ending the process (the learner). Not run on
        # GPUs here: no machine with two.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.beats = _Beats(self.store)
        log.info(
            "rendezvous for rank hosts %s on %s (collectives on %s)",
            ", ".join(self.hosts),
            self.endpoint,
            self.interface or "the hostname's address",
        )

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    def _seat(self, host: str, local_rank: int) -> Seat | None:
        key = seat_key(host, local_rank)
        if not self.store.check([key]):
            return None
        try:
            return Seat(**json.loads(self.store.get(key)))
        except (TypeError, ValueError) as e:
            raise DataParallelError(
                f"rank host {host} registered local rank {local_rank} in a form this learner "
                f"does not read ({e}): does it run the learner's version of rlnode?"
            ) from None

    def _join_command(self) -> str:
        unspecified = self.address in ("0.0.0.0", "::")
        address = "<this host's address>" if unspecified else self.endpoint.rsplit(":", 1)[0]
        return f"rlnode trainer-ranks --join {address}:{self.port}"

    def _seats(self) -> tuple[list[Seat], list[str]]:
        """The seats of every listed host that beat, and what is missing (in words)."""
        seats: list[Seat] = []
        missing: list[str] = []
        for host in self.hosts:
            first = self._seat(host, 0)
            if first is None:
                missing.append(f"rank host {host} has not joined")
                continue
            for local_rank in range(first.local_world):
                seat = first if local_rank == 0 else self._seat(host, local_rank)
                if seat is None:
                    missing.append(f"rank host {host} local rank {local_rank} has not joined")
                elif self.beats.stopped(seat.token):
                    missing.append(f"{seat.name} stopped answering")
                else:
                    seats.append(seat)
        return seats, missing

    def claim(self, local_devices: list[str], spec: Any) -> RemoteRanks:
        """Seats for one job: the ranks after the learner's own (one per local device), on
        the listed hosts, each given an offer it took, with `spec` (what every rank builds
        its trainer from) in the store. Raises DataParallelError naming what is missing
        after the join timeout."""
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            seats, missing = self._seats()
            if not missing:
                break
            if time.monotonic() > deadline:
                raise DataParallelError(
                    f"{'; '.join(missing)} (waited {self.join_timeout_s:g} s): each host in "
                    f"LEARNER_RANK_HOSTS runs `{self._join_command()}` and must reach that "
                    "address; its --host (default: its address toward the learner) is the "
                    "name listed"
                )
            time.sleep(0.2)
        backend = backend_for(local_devices + [s.device for s in seats])
        first_rank = len(local_devices)
        job = int(self.store.add(f"{PREFIX}jobs", 1))
        world = first_rank + len(seats)
        spec_bytes: Any = pickle.dumps(spec)  # the stub says str; the store takes bytes
        self.store.set(job_prefix(job) + "spec", spec_bytes)
        ranks = RemoteRanks(self, job, {first_rank + i: s for i, s in enumerate(seats)})
        try:
            for rank, seat in ranks.seats.items():
                offer = Offer(job, rank, world, backend, self.timeout_s)
                self.store.set(offer_key(seat.token, seat.jobs), json.dumps(asdict(offer)))
            ranks.wait_for("took", self.join_timeout_s, "did not take the job")
        except BaseException:
            ranks.abort()  # those that took it would wait for the others until the timeout
            raise
        return ranks


class RemoteRanks:
    """The rank-host seats one job holds, by global rank."""

    def __init__(self, hub: RankHub, job: int, seats: dict[int, Seat]) -> None:
        self.hub = hub
        self.store = hub.store
        self.job = job
        self.seats = seats
        self.prefix = job_prefix(job)
        self.commands = 0

    def __len__(self) -> int:
        return len(self.seats)

    def devices(self) -> list[str]:
        return [s.device for s in self.seats.values()]

    def _named(self, rank: int) -> str:
        return f"training rank {rank} on {self.seats[rank].name}"

    def _failed(self, rank: int) -> str | None:
        key = f"{self.prefix}failed/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def problems(self) -> list[str]:
        """Ranks that reported a failure or stopped beating, in words (empty: none)."""
        out = []
        for rank, seat in self.seats.items():
            failed = self._failed(rank)
            if failed is not None:
                out.append(f"{self._named(rank)} failed: {failed}")
            elif self.hub.beats.stopped(seat.token):
                out.append(f"{self._named(rank)} stopped answering (no heartbeat)")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise DataParallelError("; ".join(problems))

    def wait_for(self, what: str, timeout_s: float, late: str) -> None:
        """Until every rank has set `<prefix><what>/<rank>`, failing as soon as one fails or
        stops beating, or past the timeout (naming the ranks that are late)."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.seats)
        while pending:
            pending = {r for r in pending if not self.store.check([f"{self.prefix}{what}/{r}"])}
            self.check()
            if pending and time.monotonic() > deadline:
                raise DataParallelError(
                    "; ".join(f"{self._named(r)} {late}" for r in sorted(pending))
                    + f" within {timeout_s:g} s"
                )
            if pending:
                time.sleep(0.1)

    def ring(self, command: str) -> None:
        """Announce the next command: the rank hosts wait for it in the store, then take
        its argument from rank 0's broadcast."""
        self.store.set(f"{self.prefix}cmd/{self.commands}", command)
        self.commands += 1

    def abort(self) -> None:
        """The job ends out of step: a rank host waiting for a command goes back to wait
        for the next job; one inside a command (a collective that will not complete) ends
        its process at once, and torchrun starts a fresh one."""
        self.store.set(self.prefix + "abort", "")
        self.ring("abort")

    def diagnose(self, error: BaseException, local: Callable[[], list[str]]) -> BaseException:
        """What a failed collective says about the ranks: the ones that failed or stopped
        (watching their heartbeats a little longer if none has yet). A gloo or NCCL error
        (a RuntimeError) with every rank well is a DataParallelError saying so; anything
        else is rank 0's own error, returned as it is."""
        wait = STOPPED_AFTER_S + 2 * BEAT_S if isinstance(error, RuntimeError) else 0.0
        deadline = time.monotonic() + wait
        while True:
            problems = local() + self.problems()
            if problems or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if problems:
            return DataParallelError(
                f"{'; '.join(problems)}; the job cannot go on data parallel "
                f"(the collective: {first_line(error)})"
            )
        if isinstance(error, RuntimeError):
            return DataParallelError(
                f"a collective with the rank hosts failed: {first_line(error)}"
            )
        return error
