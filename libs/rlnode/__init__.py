"""rlnode: online RL for language models against your own Task App, on one GPU node.

The shared library every service, the SDK and the CLI import, grouped by concern (see
docs/architecture.md §9): messages, bus, service, engine, training, taskapp, node, models,
examples, sdk, cli.
"""

__version__ = "0.1.0"
