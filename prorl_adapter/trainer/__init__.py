"""The trainer's side: the rollout client, training samples, and the driver every backend goes through."""
