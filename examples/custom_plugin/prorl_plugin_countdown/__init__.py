"""prorl-plugin-countdown: an example third-party plugin for prorl-adapter.

- `task.py`: the `countdown` task handler (init writes the puzzle into the sandbox, the agent computes with
  bash there, eval checks the expression it gives to `finish`);
- `plugin.py`: the hook implementations and `plugin`, the object the entry point registers.
"""
