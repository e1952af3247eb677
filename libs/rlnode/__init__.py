"""rlnode: online RL for language models against your own Task App, on one GPU node.

This package is the shared library every service imports: message contracts,
the bus, settings, storage helpers and the embedded local broker.
"""

__version__ = "0.1.0"
