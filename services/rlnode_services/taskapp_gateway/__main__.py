"""`python -m taskapp_gateway`: run the taskapp-gateway until SIGTERM."""

from __future__ import annotations

import sys

from rlnode.service.app import serve
from rlnode_services.taskapp_gateway.app import create_app
from rlnode_services.taskapp_gateway.settings import SERVICE, GatewaySettings


def main() -> int:
    return serve(SERVICE, GatewaySettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
