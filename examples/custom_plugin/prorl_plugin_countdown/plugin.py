"""The hook implementations of the countdown plugin, on one class: `CountdownPlugin`, which the entry point
`countdown = "prorl_plugin_countdown.plugin:CountdownPlugin"` names. The service (and any other plugin set, such
as a trainer's or a test's) creates one instance of it, giving the constructor the plugin's own section of the
plugin configuration.

- configuration: `config_section = "countdown"`, e.g. `{"countdown": {"repeat_penalty": 0.05}}` (a number >= 0;
  default 0.05; 0 turns the rule off). The constructor validates it and raises `PluginConfigError` naming the
  bad key, so a wrong configuration stops the service at start-up.
- `prorl_register_tasks`: the `countdown` task handler.
- `prorl_reward_components`: the reward rule. A countdown episode gets the component `repeats`:
  -repeat_penalty for each tool call that repeats an earlier one of the episode (same tool, same arguments),
  which discourages an agent that loops. It needs the whole trajectory, which a task's eval does not see.
- `prorl_stage_event`: logs countdown jobs that fail, with the stage and the reason.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from prorl_adapter.hooks import PluginConfigError, hookimpl
from prorl_adapter.models import JobError, Trajectory

from .task import CountdownTask

SECTION = "countdown"
DEFAULT_REPEAT_PENALTY = 0.05
log = logging.getLogger(__name__)


def repeated_calls(trajectory: Trajectory) -> int:
    """The tool calls of the episode that repeat an earlier call with the same tool and arguments."""
    seen: set[str] = set()
    repeats = 0
    for turn in trajectory.turns:
        for call in turn.tool_calls:
            key = json.dumps([call.name, call.arguments], sort_keys=True)
            repeats += key in seen
            seen.add(key)
    return repeats


class CountdownPlugin:
    config_section = SECTION

    def __init__(self, section: Mapping[str, Any] | None = None) -> None:
        # Validate everything here, at start-up, and name the bad key: a wrong config must not surface mid-training.
        section = {} if section is None else section
        if not isinstance(section, Mapping) or set(section) - {"repeat_penalty"}:
            raise PluginConfigError(
                f"countdown: {SECTION} must be a mapping with the key repeat_penalty, got {section!r}"
            )
        penalty = section.get("repeat_penalty", DEFAULT_REPEAT_PENALTY)
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0 <= penalty < math.inf:
            raise PluginConfigError(f"countdown: {SECTION}.repeat_penalty must be a number >= 0, got {penalty!r}")
        self.repeat_penalty = float(penalty)

    @hookimpl
    def prorl_register_tasks(self) -> list[CountdownTask]:
        return [CountdownTask()]

    @hookimpl
    def prorl_reward_components(self, trajectory: Trajectory) -> dict[str, float] | None:
        if trajectory.task != CountdownTask.name or not self.repeat_penalty:
            return None  # no opinion on other tasks' rewards
        return {"repeats": 0.0 - self.repeat_penalty * repeated_calls(trajectory)}

    @hookimpl
    def prorl_stage_event(self, job_id: str, task: str, stage: str, event: str, error: JobError | None) -> None:
        # An observer, on the service's event loop: log and return, never wait on anything here.
        if task == CountdownTask.name and event == "failed" and error is not None:
            log.warning("countdown job %s failed in %s (%s): %s", job_id, stage, error.error_class, error.message)
