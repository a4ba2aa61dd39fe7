"""Every hook the rollout service calls, grouped by the phase that calls it.

Plugins implement them with `@hookimpl` (from `prorl_adapter.hookspecs`); the core only ever calls
`pm.hook.<name>(...)` and imports no plugin.
"""

from __future__ import annotations

import pluggy

PROJECT = "prorl_adapter"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- start-up --------------------------------------------------------------------------------------------
@hookspec
def prorl_register_tasks() -> list:
    """Called once when the service starts. Return a list of `TaskHandler` instances.

    All results are combined; two handlers with the same `name` are a start-up error naming both plugins.
    """
