"""`python -m learner`: run the learner until SIGTERM."""

from __future__ import annotations

import sys

from rlnode.service.app import serve
from rlnode_services.learner.app import create_app
from rlnode_services.learner.settings import SERVICE, LearnerSettings


def main() -> int:
    return serve(SERVICE, LearnerSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
