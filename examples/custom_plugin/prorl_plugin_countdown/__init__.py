"""prorl-plugin-countdown: an example third-party plugin for prorl-adapter.

- `task.py`: the `countdown` task handler (init writes the puzzle into the sandbox, the agent computes with
  bash there, eval checks the expression it gives to `finish`);
- `plugin.py`: the hook implementations on `CountdownPlugin`, the class the entry point names (created with
  the plugin's configuration section).
"""
