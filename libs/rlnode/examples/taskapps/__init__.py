"""Example Task Apps on the SDK; each module runs as `python -m rlnode.examples.taskapps.NAME`."""
