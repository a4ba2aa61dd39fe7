"""prorl_adapter: the rollout service (init, run and eval worker pools, the agent loop, the LLM client).

Not built yet: see the project's issues. The sandbox runtime it drives lives in `sandbox_runtime`."""

__version__ = "0.1.0"
