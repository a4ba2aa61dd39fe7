"""The CPU training backend: decoupled GRPO through the rollout service, for demonstrations and tests."""
