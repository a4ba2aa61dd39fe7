"""verl's `custom_reward_function`: the shaped reward, computed by the shared reward plugin on verl's side.

    reward.custom_reward_function.path=pkg://prorl_plugins.verl.reward
    reward.custom_reward_function.name=compute_score
    +prorl.reward_source=verl

With `reward_source=verl` the agent loop leaves `AgentLoopOutput.reward_score` empty and puts the service's
trajectory (turns, the task's outcome) and the task instance into `extra_fields`; verl's reward manager hands
them to this function as `extra_info`, and the shared reward plugin, configured from the same `prorl.reward`
section, gives the same number the service would have given. The task's outcome itself was measured in the
sandbox, which is gone by now: it is taken from the trajectory, never re-judged from text.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from prorl_adapter.models import Trajectory
from prorl_plugins.reward_shaping import COMPONENTS

from .config import BLOCK, plugin_set

TRAJECTORY_FIELD = "prorl_trajectory"  # extra_fields key: the service's trajectory, as JSON
INSTANCE_FIELD = "prorl_instance"  # extra_fields key: the task instance the episode ran
REWARD_SECTION_FIELD = "prorl_reward_section"  # extra_fields key: the `prorl.reward` section, as JSON


@lru_cache(maxsize=8)
def _plugins(section_json: str):
    section = json.loads(section_json)
    return plugin_set({"reward": section} if section is not None else {})


def compute_score(
    data_source: Any = None, solution_str: str = "", ground_truth: Any = None, extra_info: dict | None = None, **_: Any
) -> dict[str, float]:
    """verl's reward-function signature; returns {"score": shaped reward, <component>: value, ...}."""
    extra_info = extra_info or {}
    if TRAJECTORY_FIELD not in extra_info:
        raise ValueError(
            f"prorl_plugins.verl.reward.compute_score scores episodes of the prorl agent loop only, and needs "
            f"extra_info[{TRAJECTORY_FIELD!r}]: run with actor_rollout_ref.rollout.agent.default_agent_loop="
            f"prorl_agent and +{BLOCK}.reward_source=verl"
        )
    trajectory = Trajectory.model_validate_json(extra_info[TRAJECTORY_FIELD])
    instance = json.loads(extra_info.get(INSTANCE_FIELD) or "{}")
    plugins = _plugins(extra_info.get(REWARD_SECTION_FIELD) or "null")
    # The recorded components hold the task's outcome and the service's shaping, which is recomputed here.
    components, reward = plugins.shaped_reward(
        trajectory, instance, trajectory.reward_components, replace_recorded=True
    )
    return {"score": reward, **component_columns(components)}


def component_columns(components: dict[str, float]) -> dict[str, float]:
    """The reward components as verl's `reward_extra_info` columns: one fixed set of names for every sample
    (verl stacks the columns across the batch, and logs them), 0.0 where a component is absent."""
    return {f"prorl/{name}": float(components.get(name, 0.0)) for name in COMPONENTS}
