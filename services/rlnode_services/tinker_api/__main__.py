"""`python -m rlnode_services.tinker_api`: run the tinker-api until SIGTERM."""

from __future__ import annotations

import sys

from rlnode.service.app import serve
from rlnode_services.tinker_api.app import create_app
from rlnode_services.tinker_api.settings import SERVICE, TinkerApiSettings


def main() -> int:
    return serve(SERVICE, TinkerApiSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
