"""`python -m credential_vault`: run the credential-vault until SIGTERM."""

from __future__ import annotations

import sys

from credential_vault.app import create_app
from credential_vault.settings import SERVICE_NAME, VaultSettings
from rlnode.service import serve


def main() -> int:
    return serve(SERVICE_NAME, VaultSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
