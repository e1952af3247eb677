"""Python SDK: what the CLI does, as functions."""

from rlnode.sdk.gateway import GatewayClient, GatewayError
from rlnode.sdk.vault import VaultClient, VaultError

__all__ = ["GatewayClient", "GatewayError", "VaultClient", "VaultError"]
