"""Python SDK: what the CLI does, as functions."""

from rlnode.sdk.checkpoints import CheckpointClient, CheckpointError
from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.sdk.jobs import JobError, JobsClient, load_config
from rlnode.sdk.vault import VaultClient, VaultError

__all__ = [
    "CheckpointClient",
    "CheckpointError",
    "GatewayClient",
    "GatewayError",
    "JobError",
    "JobsClient",
    "VaultClient",
    "VaultError",
    "load_config",
]
