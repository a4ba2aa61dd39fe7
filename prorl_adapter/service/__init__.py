"""The rollout service process: HTTP API, pipeline, agent loop, LLM pool, sandboxes, decoupled mode."""
