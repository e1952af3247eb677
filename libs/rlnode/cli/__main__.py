import sys

from rlnode.cli import main

sys.exit(main())
