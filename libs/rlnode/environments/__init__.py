"""Environments written for other libraries, run as rlnode Task Apps unchanged: one small
module per library, each a translation from the library's own objects to a
`TaskAppDefinition` (rlnode.taskapp), started as `python -m rlnode.environments.<module>`.

Libraries whose dependencies collide with the node's run from venvs of their own
(requirements/environments/, tools/environment-venv); the README's "Bring your environment"
shows one registration per library."""
