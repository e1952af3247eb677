"""A node on one machine: the GPU plan, service processes, the node itself (broker, topics,
the five services wired together), its supervisor (`rlnode up`), `rlnode doctor` and
`rlnode demo`."""
