"""The seam between running episodes and serving them: what the pipeline's clients need of whatever runs jobs.

    job boards (memory | Redis) ──┐
    decoupled producer ───────────┼── JobRunner ──> RolloutPipeline (init -> run -> eval)
    ProRL's legacy API ───────────┘                  or a test's / benchmark's simulated episodes

Clients submit, cancel and wait on jobs, and read the policy version new turns carry (the coordination owns it;
the runner only reads it), how many episodes the runner's workers hold at once, and whether it can generate
at all. Nothing else of the pipeline (its queues, LLM pool, sandbox pool) is theirs to reach: those are the
service's resources of their own. Tests and benchmarks that simulate episodes (tests/test_producer.py,
bench/bench_decoupled.py) implement this protocol rather than imitating the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from server_kit.errors import ApiError

from ..models import JobError, JobRequest, JobState, JobStatus, Trajectory

if TYPE_CHECKING:
    from ..hooks.plugin_set import PluginSet


class UnknownTask(ApiError, ValueError):
    """A request for a task the runner does not have, or cannot run that way."""

    status = 400


class JobConflict(ApiError, ValueError):
    """A job id already taken by a different request: the id is an idempotency key, not a name to reuse."""

    status = 409


class RunnerJob(Protocol):
    """A submitted job as clients read it. Its `result` is set once it has ended and its trajectory is built: a
    client waits for `result`, not for a final `state`, which comes first (while its sandbox is released)."""

    id: str
    request: JobRequest
    state: JobState
    result: Trajectory | None

    def status(self) -> JobStatus: ...


@runtime_checkable
class JobRunner(Protocol):
    plugins: PluginSet  # the plugin set its jobs run with: clients that weigh, admit or observe use the same one

    @property
    def policy_version(self) -> int:
        """The version new turns are tagged with: the shared version as this process last heard it."""
        ...

    def check(self, request: JobRequest) -> None:
        """Refuse (ApiError, 400) a request this runner cannot run, before anything is queued anywhere."""
        ...

    def submit(self, request: JobRequest) -> tuple[RunnerJob, bool]:
        """Queue one job; a known job id with the same request gives back that job (idempotent), with a
        different request a 409. (job, created)"""
        ...

    def submit_samples(self, request: JobRequest) -> list[tuple[RunnerJob, bool]]:
        """Every sample the request asks for (`num_samples`), or none of them."""
        ...

    def not_run(self, request: JobRequest, submitted_at: float, state: JobState, error: JobError) -> RunnerJob:
        """A job ended in `state` (cancelled, or failed) with `error`, for a request that never ran here (a
        shared queue's), with its trajectory: not kept. Its task may be one this runner does not have."""
        ...

    def job(self, job_id: str) -> RunnerJob | None:
        """The job of this id that this runner holds (running, or finished and not yet forgotten)."""
        ...

    async def cancel(self, job_id: str) -> RunnerJob:
        """Stop the job (its sandbox released); a finished job is left as it is."""
        ...

    def forget(self, job_id: str) -> None:
        """Forget a finished job: submitted again, its id runs anew (a replica runs again the jobs its fence
        stopped) instead of answering with the ended run."""
        ...

    async def wait(self, job_id: str, timeout: float) -> RunnerJob:
        """The job once finished, or as it is after `timeout` seconds."""
        ...

    def capacity(self) -> int:
        """Episodes the runner's workers hold at once (set-up and generation): what a replica takes on."""
        ...

    def can_generate(self) -> bool:
        """Whether any LLM server can take a turn now (a replica without one leaves shared work to others)."""
        ...

    def status(self) -> dict:
        """The runner's figures as GET /v1/status shows them: at least `active` (unfinished jobs by state) and
        `episodes_per_s_last_60s`."""
        ...
