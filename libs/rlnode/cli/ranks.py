"""rlnode trainer-ranks: lend this host's devices to a learner's training jobs. It runs
torchrun (the c10d rendezvous on the learner's LEARNER_RENDEZVOUS, one worker per device,
`rlnode.training.rank_host`) and runs it again when it exits: torchrun ends when the
learner it joined goes away (its rendezvous store lives in the learner), and the host should
be back in the learner's next rendezvous without anyone restarting it by hand."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from rlnode.training.network import source_address, split_endpoint

RESTARTS = 1_000_000  # torchrun starts a worker again after each job that failed on it


def torchrun_command(
    join: str,
    *,
    nproc: int,
    host: str | None = None,
    device: str | None = None,
    ifname: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun command line of a rank host. One rendezvous per host (`--rdzv-id
    rlnode-HOST`, one node): torchrun restarts every node of a rendezvous when one joins or
    fails, and each job forms its own process group anyway, so hosts stay independent."""
    address, port = split_endpoint(join)
    local = source_address(address, port)
    name = host or local
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        join,
        "--rdzv-id",
        f"rlnode-{name}",
        "--rdzv-conf",
        "is_host=false",  # the learner hosts the store, even when it is on this machine
        "--local-addr",
        local,
        "--max-restarts",
        str(RESTARTS),
        "-m",
        "rlnode.training.rank_host",
        "--join",
        join,
        "--host",
        name,
    ]
    if device:
        command += ["--device", device]
    if ifname:
        command += ["--ifname", ifname]
    return command


def torchrun_environment() -> dict[str, str]:
    # Without it the agent opens a second store on all of this host's interfaces, which
    # nothing here uses.
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 1


def rendezvous_of(join: str) -> str:
    """`--join`: the learner's ADDR:PORT, or a join file that names it (written by a
    control host that runs the learner with `--rank-hosts`)."""
    from pathlib import Path

    from rlnode.node.roles import JoinInfo, RoleError

    if not join.endswith(".json") and not Path(join).is_file():
        split_endpoint(join)  # ADDR:PORT, or a ValueError that says what is wrong
        return join
    info = JoinInfo.read(Path(join))
    if not info.rendezvous:
        raise RoleError(
            f"{join} names no learner rendezvous: the host that wrote it runs no learner with "
            "rank hosts (rlnode up --role ...,training --rank-hosts THIS_HOST); give the "
            "learner's LEARNER_RENDEZVOUS as ADDR:PORT instead"
        )
    return info.rendezvous


def _run(args: argparse.Namespace) -> int:
    from rlnode.node.roles import RoleError

    try:
        join = rendezvous_of(args.join)
    except (RoleError, ValueError) as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 2
    command = torchrun_command(
        join,
        nproc=args.nproc or _default_nproc(),
        host=args.host,
        device=args.device,
        ifname=args.ifname,
    )
    print(f"rlnode: {shlex.join(command)}", flush=True)
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        child = subprocess.Popen(command, env=torchrun_environment())
        code = child.wait()
        if stopping or args.once:
            return code
        print(f"rlnode: torchrun exited ({code}); again in {args.retry_s:g} s", flush=True)
        time.sleep(args.retry_s)
        if stopping:
            return code


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "trainer-ranks",
        help="lend this host's devices to a learner's jobs (runs torchrun)",
        description=__doc__,
    )
    parser.add_argument(
        "--join",
        required=True,
        metavar="ADDR:PORT|JOIN_FILE",
        help="the learner's LEARNER_RENDEZVOUS, or the join.json of a control host that runs "
        "the learner with --rank-hosts",
    )
    parser.add_argument(
        "--nproc", type=int, help="ranks to lend (default: this host's GPUs, or 1 on the CPU)"
    )
    parser.add_argument(
        "--host",
        help="this host's name in LEARNER_RANK_HOSTS (default: its address toward the learner)",
    )
    parser.add_argument("--device", help="cpu to train on the CPU (default: cuda:LOCAL_RANK)")
    parser.add_argument(
        "--ifname",
        help="network interface of the collectives (default: the one that reaches the learner)",
    )
    parser.add_argument("--retry-s", type=float, default=5.0, help="pause before torchrun again")
    parser.add_argument("--once", action="store_true", help="run torchrun once, not again")
    parser.set_defaults(run=_run)
