"""Python SDK: what the CLI does, as functions."""

from rlnode.sdk.vault import VaultClient, VaultError

__all__ = ["VaultClient", "VaultError"]
