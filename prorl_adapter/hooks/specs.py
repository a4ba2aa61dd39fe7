"""Every hook the rollout service calls, grouped by the phase that calls it.

Plugins implement them with `@hookimpl` (from this module); the core only ever calls `pm.hook.<name>(...)`
and imports no plugin. Each spec says when it is called, what it gets, what it returns, and whether the first
non-None result wins (`firstresult`) or all results are combined, and how. docs/plugins.md has an example per
hook.

Implementations may accept any subset of a hook's arguments (pluggy passes only those they name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

# A hook's return type, defined beside the wire models (a batch item carries it); importable from here too.
from ..models import TrajectoryWeight

if TYPE_CHECKING:
    from ..models import JobError, JobRequest, Trajectory
    from ..tasks import TaskHandler

PROJECT = "prorl_adapter"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginConfigError(ValueError):
    """A plugin's configuration is wrong; the message names the plugin, the key and what is expected."""


@dataclass(frozen=True)
class AdmissionState:
    """What admission control sees before a new episode starts (decoupled mode), as counts by policy version:
    it is asked once per admission, so it costs O(versions), never O(episodes or trajectories)."""

    current_version: int
    in_flight: Mapping[int, int]  # policy version -> episodes running that started at it
    buffered: Mapping[int, int]  # oldest-turn version -> trajectories in the buffer (ready or leased)

    @property
    def running(self) -> int:
        return sum(self.in_flight.values())

    @property
    def pending(self) -> int:
        """Episodes that may still be consumed: running ones and buffered ones."""
        return self.running + sum(self.buffered.values())

    @property
    def oldest_version(self) -> int:
        """The oldest version among pending episodes and the one that would start now."""
        return min([self.current_version, *self.in_flight, *self.buffered])


# -- start-up --------------------------------------------------------------------------------------------
@hookspec
def prorl_register_tasks() -> list[TaskHandler]:
    """Called once when the service starts. Return a list of `TaskHandler` instances.

    All results are combined; two handlers with the same `name` are a start-up error naming both plugins.
    """


@hookspec
def prorl_configure(config: dict[str, Any]) -> list[str] | None:
    """Called once at start-up with the whole plugin configuration (a mapping of section name to settings,
    e.g. `{"staleness": {"mode": "linear", "max_staleness": 4}, "reward": {...}}`).

    Each plugin reads and validates its own section and raises `PluginConfigError` naming the bad key, so that
    a wrong config fails at start-up, not mid-training; it returns the names of the sections it reads. All
    implementations are called, and a section that none of them names is an error (a typo, or a plugin that is
    not installed).
    """


# -- the training backend (one backend plugin is active at a time) ----------------------------------------
@hookspec(firstresult=True)
def prorl_backend_requests(batch: Any, config: dict[str, Any]) -> list[JobRequest] | None:
    """Turn a training backend's generation request (a verl `DataProto`, a SkyRL `GeneratorInput`, ...) into
    rollout job requests, one per episode. The first non-None result wins."""


@hookspec(firstresult=True)
def prorl_backend_batch(trajectories: list[Trajectory], weights: list[TrajectoryWeight], batch: Any) -> Any:
    """Turn finished trajectories and their weights into the backend's batch type (padded tensors, masks,
    rewards on the last token, version tags). `batch` is the request they answer. The first non-None result wins."""


@hookspec(firstresult=True)
def prorl_backend_policy_version() -> int | None:
    """The trainer's current policy version, where the backend knows it (e.g. verl's global step).
    The first non-None result wins; with none, the version set through the API is used."""


@hookspec
def prorl_policy_version_changed(version: int) -> None:
    """Called after a new policy version is published (API or backend). All implementations are called."""


# -- episodes --------------------------------------------------------------------------------------------
@hookspec
def prorl_admit_episode(state: AdmissionState) -> bool | None:
    """Called before a new episode starts in decoupled mode. Return False to hold it back for now (it is
    asked again when an episode finishes, a batch is consumed or the version changes); None or True admit.
    All results are combined: any False holds the episode back."""


@hookspec
def prorl_stage_event(job_id: str, task: str, stage: str, event: str, seconds: float, error: JobError | None) -> None:
    """Called when a job starts (`event="start"`) or leaves (`"end"`, `"failed"`, `"cancelled"`) a stage
    (`"init"`, `"run"`, `"eval"`); `seconds` is the stage's duration on leaving. For metrics and logs; it runs
    on the event loop, so it must not block. All implementations are called."""


# -- trajectories ----------------------------------------------------------------------------------------
@hookspec
def prorl_reward_components(trajectory: Trajectory, instance: dict[str, Any]) -> dict[str, float] | None:
    """Called after the task's eval, when `trajectory.reward_components` holds the task's own (at least
    "outcome"). Return extra components as signed contributions to the reward (e.g. `{"safety": -1.0}`).
    All results are merged into `reward_components`; a name given twice is an error."""


@hookspec(firstresult=True)
def prorl_combine_reward(trajectory: Trajectory, components: dict[str, float]) -> float | None:
    """Combine the components into the shaped reward the trainer optimises. The first non-None result wins;
    with none, the reward is the sum of the components."""


@hookspec
def prorl_expired_before(current_version: int) -> int | None:
    """Called before the trainer takes a batch. Return a version V such that a buffered trajectory whose oldest
    turn is older than V is worth nothing now (its weight would be 0): the buffer removes such trajectories
    at once, instead of keeping ones that newest-first takes never reach. All results are combined: the
    largest V wins; None has no opinion."""


@hookspec
def prorl_trajectory_weight(
    trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None
) -> TrajectoryWeight | None:
    """Called when the trainer consumes a trajectory produced at `trajectory.policy_version_min` while the
    policy is at `current_version`; `current_logprobs` are the trainer's logprobs of the response tokens when
    it has them. Return a weight (staleness control, importance correction). All results are combined: sample
    weights multiply, token weights multiply element-wise; a sample weight of 0 drops the trajectory."""
