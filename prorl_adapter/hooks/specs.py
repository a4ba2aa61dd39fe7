"""Every hook, grouped by the process that calls it and in the order a job meets them.

Specifications and markers only: the values hooks receive and return are wire types (`prorl_adapter.models`),
and the calls, with the combination of their answers, are `PluginSet`'s (`prorl_adapter.hooks.plugin_set`).
Plugins implement hooks with `@hookimpl`; an implementation may accept any subset of a hook's arguments.
docs/plugins.md has an example per hook, docs/architecture.md the order of the calls.

A plugin is a module (stateless hooks) or a class. A class is instantiated once per plugin set; if it names a
section of the plugin configuration (`config_section = "staleness"`), its constructor receives that section
(None when the configuration has none) and validates it, raising `PluginConfigError` naming the bad key.

    The rollout service (`prorl-rollout serve`)             The trainer (through `prorl_adapter.trainer`)
    start-up     prorl_register_tasks                        a request    prorl_backend_policy_version
    admission    prorl_admit_episode (decoupled mode)                     prorl_backend_requests
    each stage   prorl_stage_event                           its jobs     (run on the service)
    each turn    prorl_llm_request                           weighing     prorl_trajectory_weight (coupled)
    eval         prorl_reward_components, prorl_combine_reward           prorl_backend_batch
    finished     prorl_job_finished                          a version    prorl_policy_version_changed
    a take       prorl_expired_before, prorl_take_demands, prorl_trajectory_weight
    a version    prorl_policy_version_changed

Observers (`prorl_stage_event`, `prorl_llm_request`, `prorl_job_finished`, `prorl_policy_version_changed`) are
called one implementation at a time, on the event loop: each must return quickly, and one that raises is
logged and does not stop the others or the job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

if TYPE_CHECKING:
    from ..models import AdmissionState, BatchItem, JobError, JobRequest, JobState, Trajectory, TrajectoryWeight
    from ..tasks import TaskHandler

PROJECT = "prorl_adapter"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# == the rollout service ==================================================================================
# -- start-up ---------------------------------------------------------------------------------------------
@hookspec
def prorl_register_tasks() -> list[TaskHandler]:
    """Once, when the service starts. Return a list of `TaskHandler` instances.

    All results are combined; two handlers with the same `name` are a start-up error naming both plugins.
    """


# -- a job's life: admission, then init -> run -> eval --------------------------------------------------------
@hookspec
def prorl_admit_episode(state: AdmissionState) -> bool | None:
    """Before a new episode starts in decoupled mode. Return False to hold it back for now (it is asked again
    when an episode finishes, a batch is taken or the version changes); None or True admit. Any False holds
    the episode back."""


@hookspec
def prorl_stage_event(job_id: str, task: str, stage: str, event: str, seconds: float, error: JobError | None) -> None:
    """Observer. A job starts (`event="start"`) or leaves (`"end"`, `"failed"`, `"cancelled"`) a stage
    (`"init"`, `"run"`, `"eval"`); `seconds` is the stage's duration on leaving."""


@hookspec
def prorl_llm_request(
    server: str, started: float, seconds: float, prompt_tokens: int, response_tokens: int, error: str | None
) -> None:
    """Observer. After every HTTP request the LLM pool makes to an LLM server, answered or not: `started` is
    `time.monotonic()` at its start, `error` None when the server answered."""


@hookspec
def prorl_reward_components(trajectory: Trajectory, instance: dict[str, Any]) -> dict[str, float] | None:
    """After the task's eval, when `trajectory.reward_components` holds the task's own (at least "outcome").
    Return extra components as signed contributions to the reward (e.g. `{"safety": -1.0}`). All results
    are merged into `reward_components`; a name given twice is an error. Also called by a trainer that scores
    on its own side (verl's reward function), with the same trajectory."""


@hookspec(firstresult=True)
def prorl_combine_reward(trajectory: Trajectory, components: dict[str, float]) -> float | None:
    """Right after `prorl_reward_components`: combine the components into the shaped reward the trainer
    optimises. The first non-None result wins; with none, the reward is the sum of the components."""


@hookspec
def prorl_job_finished(trajectory: Trajectory, state: JobState) -> None:
    """Observer. A job has finished (`state` done, failed or cancelled) and `trajectory` is its result; its
    sandbox is released. The decoupled producer and the metrics observe jobs this way."""


# -- consumption (the service when a trainer takes from its buffer; the trainer's driver in coupled mode) ------
@hookspec
def prorl_expired_before(current_version: int) -> int | None:
    """Before the trainer takes a batch from the service's buffer. Return a version V such that a buffered
    trajectory whose oldest turn is older than V is worth nothing now (its weight would be 0): the buffer
    removes such trajectories at once. The largest V wins; None has no opinion."""


@hookspec
def prorl_take_demands(state: AdmissionState) -> dict[int, int] | None:
    """Before the trainer takes a batch from the service's buffer (decoupled mode), and again while that take
    waits: whenever a trajectory is buffered, a batch is acknowledged or handed back, or the version changes.
    `state` is what admission sees, except that the entries this service has leased and not yet acknowledged
    (the batch being taken and topped up, or one trained on and not yet acknowledged) count as consumed.

    Return `{j: d_j}` to make the take serve deadlines: it takes the oldest version first, and only once those
    trajectories hold at least d_j of versions <= j for every j; until then it waits (up to the take's
    timeout, after which it returns nothing unless what is ready meets every demand). `{}`: the oldest first,
    nothing to wait for now. None: no opinion (the newest version first, no waiting). **All results**
    (`PluginSet.take_demands`): any answer other than None makes the take serve deadlines, and each d_j is the
    largest any plugin demands. The staleness plugin's pace `deadline-take` rule is one (`deadline_demands`)."""


@hookspec
def prorl_trajectory_weight(
    trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None
) -> TrajectoryWeight | None:
    """When a trajectory produced at `trajectory.policy_version_min` is consumed at `current_version`:
    `current_logprobs` are the trainer's logprobs of the response tokens when it has them. Return a weight
    (staleness control, importance correction). Sample weights multiply, token weights multiply element-wise;
    a sample weight of 0 drops the trajectory."""


# -- both processes ------------------------------------------------------------------------------------------
@hookspec
def prorl_policy_version_changed(version: int) -> None:
    """Observer. A new policy version was published: in the service when its API sets it, in the trainer when
    the driver publishes it."""


# == the trainer: the backend hooks, called by `prorl_adapter.trainer.RolloutDriver` (one backend at a time) ==
@hookspec(firstresult=True)
def prorl_backend_policy_version(batch: Any) -> int | None:
    """First, for each trainer request: the trainer's policy version for `batch`, where the backend knows it
    (e.g. SkyRL's global step). The driver publishes it to the service before the jobs run. None: the
    version is managed by the trainer through the client."""


@hookspec(firstresult=True)
def prorl_backend_requests(batch: Any, config: dict[str, Any]) -> list[JobRequest] | None:
    """Turn a trainer's generation request (a SkyRL `GeneratorInput`, one verl sample, a list of rows...) into
    rollout job requests, one per episode; `config` is the driver's backend settings."""


@hookspec(firstresult=True)
def prorl_backend_batch(items: list[BatchItem], batch: Any) -> Any:
    """Last: turn the weighed trajectories into the trainer's batch type (padded tensors, masks, rewards on the
    last token, version tags). `batch` is the request they answer (None for batches taken from the buffer)."""


BACKEND_HOOKS = ("prorl_backend_policy_version", "prorl_backend_requests", "prorl_backend_batch")


@runtime_checkable
class Backend(Protocol):
    """A training backend, as the driver's plugin set holds it: one object whose `@hookimpl` methods implement
    the backend hooks above (`prorl_backend_policy_version` is optional). A plugin set holds one backend: the
    hooks are firstresult, so a second would answer instead of the first, or never, by registration order, and
    loading a second is refused (`PluginLoadError`). As with every hook, a method may take fewer of the hook's
    arguments than the specification names."""

    def prorl_backend_requests(self, batch: Any, config: dict[str, Any]) -> list[JobRequest] | None: ...

    def prorl_backend_batch(self, items: list[BatchItem], batch: Any) -> Any: ...
