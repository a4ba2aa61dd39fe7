"""prorl_adapter: rollout-as-a-service for RL training of multi-turn LLM agents, split by the process each part
runs in:

- `service/`: the rollout service (`prorl-rollout serve`): HTTP API, init/run/eval pipeline, agent loop, LLM
  pool, sandboxes, decoupled mode and its storage;
- `trainer/`: what runs in the trainer's process: the client and the driver every training backend goes through;
- `hooks/`: the hook specifications, plugin loading and the calls of the hooks, used by both;
- `models.py` (every type crossing a process or plugin boundary) and `tasks.py` (the task plugin contract);
- `dev/`: the local stack launcher for demos, tests and benchmarks.

The sandbox runtime the service drives is `sandbox_runtime`; the plugins (tasks, staleness, reward shaping and
the trainer backends) are `prorl_plugins`. docs/architecture.md shows how they fit.
"""

__version__ = "0.1.0"
