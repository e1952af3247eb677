"""rlnode rollout-generator: the inference engine, per-rollout OpenAI endpoints and trajectory capture."""
