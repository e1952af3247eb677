"""rlnode checkpoint-server: the checkpoint index, file serving and OpenAI-compatible inference on checkpoints."""
