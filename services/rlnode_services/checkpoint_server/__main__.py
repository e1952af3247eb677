"""`python -m checkpoint_server`: run the checkpoint-server until SIGTERM."""

from __future__ import annotations

import sys

from rlnode.service.app import serve
from rlnode_services.checkpoint_server.app import create_app
from rlnode_services.checkpoint_server.settings import SERVICE, CheckpointServerSettings


def main() -> int:
    return serve(SERVICE, CheckpointServerSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
