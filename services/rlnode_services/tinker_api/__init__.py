"""rlnode tinker-api: the Tinker API (the `tinker` SDK's wire protocol) on a node: sessions,
futures, training runs trained by the learner, checkpoints and samplers, org-scoped keys."""
