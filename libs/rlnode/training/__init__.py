"""The learner's training code, apart from Kafka and HTTP: GRPO-family advantages and loss,
the trainer (optionally data parallel), weight publishing and checkpoints. The learner
service drives it; benchmarks call it in-process."""
