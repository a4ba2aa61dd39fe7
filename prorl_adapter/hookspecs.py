"""Every hook the rollout service calls, grouped by the phase that calls it.

Plugins implement them with `@hookimpl` (from this module); the core only ever calls `pm.hook.<name>(...)`
and imports no plugin. Each spec says when it is called, what it gets, what it returns, and whether the first
non-None result wins (`firstresult`) or all results are combined, and how. docs/plugins.md has an example per
hook.

Implementations may accept any subset of a hook's arguments (pluggy passes only those they name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .models import JobError, JobRequest, Trajectory
    from .tasks import TaskHandler

PROJECT = "prorl_adapter"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginConfigError(ValueError):
    """A plugin's configuration is wrong; the message names the plugin, the key and what is expected."""


@dataclass(frozen=True)
class AdmissionState:
    """What admission control sees before a new episode starts (decoupled mode)."""

    current_version: int
    in_flight_versions: list[int]  # the policy version each running episode started at
    buffered_versions: list[int]  # the oldest-turn version of each trajectory waiting in the buffer


@dataclass
class TrajectoryWeight:
    """A plugin's verdict on one trajectory when the trainer consumes it.

    `sample` multiplies the sample's loss (0 drops it); `tokens`, if given, multiplies each response token's
    loss (e.g. truncated importance weights), aligned with `response_ids`.
    """

    sample: float = 1.0
    tokens: list[float] | None = None
    reasons: list[str] = field(default_factory=list)

    @classmethod
    def combine(cls, weights: list[TrajectoryWeight | None], length: int) -> TrajectoryWeight:
        """Several plugins' verdicts on one trajectory of `length` response tokens: sample weights multiply,
        token weights multiply element-wise, reasons are kept in order."""
        combined = cls()
        for weight in weights:
            if weight is None:
                continue
            combined.sample *= weight.sample
            combined.reasons += weight.reasons
            if weight.tokens is not None:
                if len(weight.tokens) != length:
                    raise ValueError(f"a plugin returned {len(weight.tokens)} token weights for {length} tokens")
                base = combined.tokens or [1.0] * length
                combined.tokens = [a * b for a, b in zip(base, weight.tokens)]
        return combined


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
def prorl_trajectory_weight(
    trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None
) -> TrajectoryWeight | None:
    """Called when the trainer consumes a trajectory produced at `trajectory.policy_version_min` while the
    policy is at `current_version`; `current_logprobs` are the trainer's logprobs of the response tokens when
    it has them. Return a weight (staleness control, importance correction). All results are combined: sample
    weights multiply, token weights multiply element-wise; a sample weight of 0 drops the trajectory."""
