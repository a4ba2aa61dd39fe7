"""Reward shaping as the hooks define it, in one place: the service's eval stage and a trainer that scores on
its own side (verl's `custom_reward_function`) both call `shape_reward`, so they cannot disagree."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..models import Trajectory


class RewardComponentConflict(ValueError):
    pass


def shape_reward(
    hooks: Any,
    trajectory: Trajectory,
    instance: Mapping[str, Any],
    task_components: Mapping[str, float],
    replace_recorded: bool = False,
) -> tuple[dict[str, float], float]:
    """The reward components (the task's, then every `prorl_reward_components` plugin's) and the shaped
    reward (`prorl_combine_reward`, else their sum).

    A component name given twice is an error, except with `replace_recorded`: a trainer recomputing the
    shaping passes the trajectory's recorded components, which already hold the plugins' own.
    """
    components = dict(task_components)
    given: set[str] = set()
    for extra in hooks.prorl_reward_components(trajectory=trajectory, instance=dict(instance)):
        for name, value in (extra or {}).items():
            if name in given or (name in components and not replace_recorded):
                raise RewardComponentConflict(f"reward component {name!r} is given twice (task or plugins)")
            given.add(name)
            components[name] = float(value)
    total = hooks.prorl_combine_reward(trajectory=trajectory, components=components)
    return components, float(total) if total is not None else sum(components.values())
