"""`python -m rollout_generator`: run the rollout-generator until SIGTERM."""

from __future__ import annotations

import sys

from rlnode.service.app import serve
from rlnode_services.rollout_generator.app import create_app
from rlnode_services.rollout_generator.settings import SERVICE, GeneratorSettings


def main() -> int:
    return serve(SERVICE, GeneratorSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
