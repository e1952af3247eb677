"""`python -m credential_vault`: run the credential-vault until SIGTERM."""

from __future__ import annotations

import sys

from rlnode.service.app import serve
from rlnode_services.credential_vault.app import create_app
from rlnode_services.credential_vault.settings import SERVICE, VaultSettings


def main() -> int:
    return serve(SERVICE, VaultSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
