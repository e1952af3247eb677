"""rlnode learner: the job owner: policy updates, reference model, weight publishing and checkpoints."""
