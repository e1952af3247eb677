"""`python -m checkpoint_server`: run the checkpoint-server until SIGTERM."""

from __future__ import annotations

import sys

from checkpoint_server.app import create_app
from checkpoint_server.settings import SERVICE_NAME, CheckpointServerSettings
from rlnode.service import serve


def main() -> int:
    return serve(SERVICE_NAME, CheckpointServerSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
