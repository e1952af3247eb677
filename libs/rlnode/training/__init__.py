"""Training, apart from Kafka and HTTP: GRPO-family advantages and loss (`grpo`), the trainer
with micro-batches and data parallelism (`trainer`, `distributed`; the ranks other hosts
lend: `rank_hosts`, `rank_host`), one job's loop (`loop.JobRunner`) behind a transport
(`transport`: the bus in the learner, memory in tests and benchmarks), and the in-process
generator that feeds it without a node (`inprocess`)."""
