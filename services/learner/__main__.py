"""`python -m learner`: run the learner until SIGTERM."""

from __future__ import annotations

import sys

from learner.app import create_app
from learner.settings import SERVICE_NAME, LearnerSettings
from rlnode.service import serve


def main() -> int:
    return serve(SERVICE_NAME, LearnerSettings, create_app)


if __name__ == "__main__":
    sys.exit(main())
