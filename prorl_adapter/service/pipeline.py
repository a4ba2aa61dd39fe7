"""The rollout pipeline: a job goes init -> run -> eval, each stage served by its own pool of workers.

    submit ──> [init queue] ──init workers──> [run queue] ──run workers──> [eval queue] ──eval workers──> done
                 sandbox + task set-up          multi-turn agent loop          score, release the sandbox

Separate pools mean a slow evaluation never holds a generation slot, and sandbox start-up overlaps with
other episodes' generation. Everything is asyncio: a job in flight is a few objects, not a thread.

Each stage runs as its own asyncio task, so that cancelling a job stops the stage at once, and so that a
stage overrunning the job's time budget (stage time only; queueing is free) can be stopped the same way.
A failure never reaches the trainer as an exception: the job ends with a trajectory carrying an error class
and `filter: true`, and its sandbox is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sandbox_runtime.client import SandboxAPIError, SandboxUnreachable
from server_kit.errors import ProrlError

from ..hooks.plugin_set import PluginSet, RewardComponentConflict
from ..models import BudgetCut, ErrorClass, JobError, JobRequest, JobState, JobStatus, StageTimings, Trajectory
from ..tasks import Environment, TaskConfigError, TaskHandler
from .adaptive_concurrency import AdaptiveConfig, RunConcurrency
from .agent import Episode, PromptTooLong, run_episode
from .agent_program import ProgramFailed, run_program
from .chat import ChatTokenizer
from .gateway import SANDBOX_PORT, Gateway
from .init_gate import InitGate
from .job_runner import JobConflict, UnknownTask
from .llm import LLMPool, LLMRequestError, LLMUnavailable
from .sandboxes import RuntimeFailed, SandboxPool
from .storage.coordination import Coordination, MemoryCoordination
from .weight_barrier import WeightBarrier

log = logging.getLogger(__name__)


@dataclass
class PipelineConfig:
    max_init_workers: int = 32
    max_run_workers: int = 256
    max_eval_workers: int = 32
    # Jobs init may make ready beyond the run stage's limit (init_gate.py); None: a quarter of the limit, at least 1.
    init_ahead: int | None = None
    default_timeout_s: float = 1800.0
    max_init_attempts: int = 2
    keep_finished: int = 100_000  # finished jobs kept for their results; the oldest are forgotten first
    # HOST:PORT at which the sandbox runtimes reach this service's LLM gateway (agent programs); None: none can.
    gateway_address: str | None = None
    # With a target engine batch, the run stage's limit follows the LLM servers' load (adaptive_concurrency.py);
    # max_run_workers is its ceiling.
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)


SANDBOX_TTL_MARGIN_S = 600.0
# A sandbox's creation may take the job's time budget left, and this: the stage's own deadline ends it first, as
# the job's budget running out (a cut recorded as such), not as a runtime that failed to create.
CREATE_GRACE_S = 5.0
# How long a finished job's result waits for its sandbox's delete: a runtime that never answers one must not hold
# the result back for the sandbox client's whole timeout. The delete goes on in the background (the pipeline waits
# for it at stop), and the sandbox's TTL reaps what a delete never reaches.
RELEASE_WAIT_S = 10.0


class StageFailed(ProrlError):
    def __init__(self, error_class: ErrorClass, message: str, outage: bool = False):
        super().__init__(message)
        self.error_class = error_class
        self.outage = outage  # an LLM outage failed it (JobError.outage)


class RuntimeLost(StageFailed):
    """The episode's sandbox runtime went mid-episode (it stopped answering, or left and took its sandbox with
    it): the episode starts again from init on another runtime, while init attempts are left."""

    def __init__(self, stage: ErrorClass, url: str, cause: SandboxAPIError):
        super().__init__(stage, f"sandbox runtime {url} lost: {cause}")
        self.url = url


@dataclass
class Job:
    id: str
    request: JobRequest
    handler: TaskHandler | None  # None only for a job that never runs here (`not_run`)
    submitted_at: float = field(default_factory=time.time)
    submitted_mono: float = field(default_factory=time.monotonic)
    state: JobState = JobState.queued
    timings: StageTimings = field(default_factory=StageTimings)
    error: JobError | None = None
    attempts: int = 0
    env: Environment | None = None
    episode: Episode | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    result: Trajectory | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    stage_task: asyncio.Task | None = None
    lost_runtimes: set[str] = field(default_factory=set)  # runtimes this job's episode was lost on
    partial: Episode | None = None  # the agent loop's episode while it runs: kept if the time budget cuts it
    paused_s: float = 0.0  # of its run stage, spent while the weight-update barrier held generation
    ahead: bool = False  # counted by the init gate: taken by init, not yet given a run slot

    def budget(self, default_timeout: float) -> float:
        return self.request.timeout_s or default_timeout

    def spent_s(self) -> float:
        """Its stages' time, where a weight update's pause does not count."""
        return self.timings.init_s + self.timings.run_s + self.timings.eval_s - self.paused_s

    def budget_left(self, default_timeout: float) -> float:
        return self.budget(default_timeout) - self.spent_s()

    def keep_partial(self, episode: Episode) -> None:
        self.partial = episode

    def status(self) -> JobStatus:
        return JobStatus(
            job_id=self.id,
            task=self.request.task,
            state=self.state,
            submitted_at=self.submitted_at,
            timings=self.timings,
            error=self.error,
            attempts=self.attempts,
        )


_STAGE_NAMES = {JobState.init: "init", JobState.running: "run", JobState.evaluating: "eval"}


class RolloutPipeline:
    """The job runner of the service (`job_runner.JobRunner`): its clients submit, cancel and wait through that
    protocol; the sandbox pool, the LLM pool and the chat tokenizer are the service's, lent to it."""

    def __init__(
        self,
        plugins: PluginSet,
        tasks: dict[str, TaskHandler],
        sandboxes: SandboxPool,
        llm: LLMPool,
        chat: ChatTokenizer,
        config: PipelineConfig | None = None,
        coordination: Coordination | None = None,
    ) -> None:
        self.plugins = plugins
        self.tasks = tasks
        self.sandboxes = sandboxes
        self.llm = llm
        self.chat = chat
        self.config = config or PipelineConfig()
        # The owner of the policy version (set through the API at any replica); the pipeline only reads it, and
        # tells plugins when it changes.
        self._coordination = coordination or MemoryCoordination("prorl-rollout")
        self._coordination.on_policy_version(self._version_changed)
        self._told_version = 0  # the version plugins last heard of
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.counts = {state: 0 for state in (JobState.done, JobState.failed, JobState.cancelled)}
        self._finish_times: deque[float] = deque(maxlen=10_000)
        self._queues = {name: asyncio.Queue() for name in ("init", "run", "eval")}
        self._workers: list[asyncio.Task] = []
        self._releases: set[asyncio.Task[None]] = set()  # sandbox deletes that outlived RELEASE_WAIT_S: awaited at stop
        # How many episodes the run workers hold at once: max_run_workers, or what the engines' load says.
        self.run_concurrency = RunConcurrency(
            self.config.adaptive, self.config.max_run_workers, llm, queued=lambda: self._queued()["run"]
        )
        # Init makes a sandbox only when the run stage can take its episode soon (back-pressure).
        self.init_gate = InitGate(
            self.run_concurrency.limiter,
            self.config.init_ahead,
            waiting_for_eval=self._queues["eval"].qsize,
        )
        # Every generation request, the agent loop's and the gateway's, passes the weight-update barrier.
        self.barrier = WeightBarrier(self._coordination, llm)
        self.gateway = Gateway(llm, chat, self.barrier)

    @property
    def policy_version(self) -> int:
        """The version new turns are tagged with: the coordination's, as this process last heard it."""
        return self._coordination.version

    def _version_changed(self, version: int) -> None:
        if version != self._told_version:
            self._told_version = version
            self.plugins.notify("prorl_policy_version_changed", version=version)

    # -- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        # The shared state may have a version already (a Redis the replicas kept using), read before this pipeline
        # listened: plugins hear of it now.
        self._version_changed(self.policy_version)
        with contextlib.suppress(ProrlError):  # the shared state away: the coordination hears of it on reconnecting
            await self.barrier.start()
        c = self.config
        stages = [
            ("init", JobState.init, self._init, "run", c.max_init_workers),
            ("run", JobState.running, self._run, "eval", c.max_run_workers),
            ("eval", JobState.evaluating, self._eval, None, c.max_eval_workers),
        ]
        for name, state, work, following, count in stages:
            for _ in range(count):
                self._workers.append(asyncio.create_task(self._worker(name, state, work, following)))
        if self.run_concurrency.adaptive:
            self._workers.append(asyncio.create_task(self.run_concurrency.poll_forever()))

    async def stop(self) -> None:
        """Cancel every unfinished job, all at once: a graceful stop with thousands queued and hundreds holding
        sandboxes must release them all before the operator's patience (or the TTL) runs out."""
        unfinished = [job.id for job in self.jobs.values() if not job.state.finished]
        await asyncio.gather(*(self.cancel(job_id) for job_id in unfinished), return_exceptions=True)
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers.clear()
        await asyncio.gather(*self._releases, return_exceptions=True)  # bounded by the sandbox client's timeout
        await self.barrier.close()

    # -- the API ----------------------------------------------------------------------------------------
    def submit(self, request: JobRequest) -> tuple[Job, bool]:
        """Queue a job; with a known job_id and the same request, return that job instead (idempotent): a
        client that retries a submission whose answer it lost gets the job it made. (job, created)"""
        known = self._known_job(request)
        if known is not None:
            return known, False
        handler = self._handler(request)
        job = Job(request.job_id or uuid.uuid4().hex, request, handler)
        self.jobs[job.id] = job
        self._forget_old_jobs()
        self._queues["init"].put_nowait(job)
        return job, True

    def check(self, request: JobRequest) -> None:
        self._handler(request)

    def _handler(self, request: JobRequest) -> TaskHandler:
        """The request's task handler; a 400 for a task this service does not have, or cannot run this way."""
        handler = self.tasks.get(request.task)
        if handler is None:
            raise UnknownTask(f"unknown task {request.task!r}; known: {', '.join(sorted(self.tasks))}")
        if request.agent is not None and not handler.supports_agent_programs:
            raise UnknownTask(
                f"task {request.task!r} cannot be run by an agent program (its eval grades what only the built-in "
                "agent loop records)"
            )
        return handler

    def submit_samples(self, request: JobRequest) -> list[tuple[Job, bool]]:
        """Queue every sample a request asks for (`num_samples`), or none: a conflict or an unknown task in any
        of them refuses the whole submission before one is queued."""
        samples = request.samples()
        for sample in samples:
            self._known_job(sample)
        return [self.submit(sample) for sample in samples]

    def not_run(self, request: JobRequest, submitted_at: float, state: JobState, error: JobError) -> Job:
        """A job that ended without running here (cancelled before it started anywhere, or one this replica
        cannot run, of a queue shared with others): final, with its trajectory; not kept among this pipeline's
        jobs. Its task may be unknown here, and its instance unreadable."""
        job = Job(request.job_id or uuid.uuid4().hex, request, self.tasks.get(request.task), submitted_at=submitted_at)
        job.state, job.error = state, error
        try:
            job.result = self._trajectory(job)
        except Exception:  # the handler cannot read the instance (its id): the job ends all the same
            log.exception("job %s: its task cannot read its instance", job.id)
            job.handler = None
            job.result = self._trajectory(job)
        return job

    def _known_job(self, request: JobRequest) -> Job | None:
        """The job already made for this request's id, if any; a 409 where the id holds another request."""
        job = self.jobs.get(request.job_id) if request.job_id else None
        if job is not None and job.request != request:
            raise JobConflict(f"job id {request.job_id!r} is taken by a different request; use a new id")
        return job

    def job(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def capacity(self) -> int:
        return self.config.max_init_workers + self.config.max_run_workers

    def can_generate(self) -> bool:
        return self.llm.any_healthy()

    async def cancel(self, job_id: str) -> Job:
        job = self.jobs[job_id]
        if job.state.finished:
            return job
        error = JobError(error_class="cancelled", message="cancelled by request")
        task = job.stage_task
        graded = job.state is JobState.evaluating and task is not None and task.done() and not task.cancelled()
        if graded and task.exception() is None:  # its worker delivers it as done in a moment
            await job.finished.wait()
            return job
        if job.stage_task is not None and not job.stage_task.done():
            job.stage_task.cancel()  # the stage's worker sees it and finishes the job
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job.stage_task
        if not job.state.finished:  # queued between stages, or the worker has not resumed yet
            await self._finish(job, JobState.cancelled, error)
        return job

    def forget(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None and job.state.finished:
            del self.jobs[job_id]

    async def wait(self, job_id: str, timeout: float) -> Job:
        job = self.jobs[job_id]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(job.finished.wait(), timeout)
        return job

    def status(self) -> dict:
        now = time.monotonic()
        recent = [t for t in self._finish_times if now - t <= 60.0]
        active = {state.value: 0 for state in JobState if not state.finished}
        for job in self.jobs.values():
            if not job.state.finished:
                active[job.state.value] += 1
        return {
            "policy_version": self.policy_version,
            "queues": self._queued(),
            "active": active,
            "finished": {state.value: count for state, count in self.counts.items()},
            "episodes_per_s_last_60s": round(len(recent) / 60.0, 3),
            "workers": {
                "init": self.config.max_init_workers,
                "run": self.config.max_run_workers,
                "eval": self.config.max_eval_workers,
            },
            "run_concurrency": self.run_concurrency.describe(),
            "init_gate": self.init_gate.describe(),
        }

    def _queued(self) -> dict[str, int]:
        """Jobs waiting for each stage: in its queue, and (run) taken by a worker that waits for a slot."""
        queued = {name: queue.qsize() for name, queue in self._queues.items()}
        queued["run"] += self.run_concurrency.limiter.waiting
        return queued

    # -- the stages -------------------------------------------------------------------------------------
    async def _init(self, job: Job) -> None:
        spec = job.handler.sandbox_spec(job.request.instance)
        spec.setdefault("labels", {}).update({"job_id": job.id, "task": job.request.task})
        # The runtime reaps it even if this service dies with the job. The margin is wide (the budget again,
        # and ten minutes): the budget counts stage time, while the sandbox also lives through queue waits.
        budget = job.budget_left(self.config.default_timeout_s)
        spec.setdefault("ttl_s", 2 * budget + SANDBOX_TTL_MARGIN_S)
        if job.request.agent is not None:  # its program reaches the gateway, and nothing else
            if self.config.gateway_address is None:
                raise StageFailed("init", "this service has no gateway address for agent programs (--gateway-address)")
            spec["forwards"] = [{"port": SANDBOX_PORT, "target": self.config.gateway_address}]
        failed_on: set[str] = set(job.lost_runtimes)
        last_error = ""
        for _ in range(self.config.max_init_attempts):
            job.attempts += 1
            try:
                create_s = job.budget_left(self.config.default_timeout_s) + CREATE_GRACE_S
                job.env = await self.sandboxes.acquire(spec, exclude=failed_on, timeout_s=create_s)
                await job.handler.init(job.env.for_task(), job.request.instance)
                for path, content in (job.request.agent.files if job.request.agent else {}).items():
                    await job.env.write_file(path, content)
                return
            except TaskConfigError as exc:
                raise StageFailed("init", f"task set-up failed: {exc}") from exc
            except (RuntimeFailed, SandboxAPIError) as exc:
                last_error = str(exc)
                failed_on.add(exc.url if isinstance(exc, RuntimeFailed) else job.env.server_url)
                await self._release(job)
                log.warning("job %s: init attempt %d failed: %s", job.id, job.attempts, exc)
        raise StageFailed("init", f"no sandbox after {job.attempts} attempts: {last_error}")

    async def _run(self, job: Job) -> None:
        try:
            if job.request.agent is not None:
                budget = job.budget_left(self.config.default_timeout_s)
                job.episode = await run_program(job.id, job.request, job.handler, job.env, self.gateway, budget)
            else:
                job.episode = await run_episode(
                    job.request, job.handler, job.env, self.chat, self.llm, self.barrier, started=job.keep_partial
                )
        except ProgramFailed as exc:
            raise StageFailed("run", str(exc), outage=exc.outage) from exc
        except LLMUnavailable as exc:
            raise StageFailed("run", f"LLM: {exc}", outage=exc.outage) from exc
        except LLMRequestError as exc:
            raise StageFailed("run", f"LLM: {exc}") from exc
        except PromptTooLong as exc:
            raise StageFailed("run", str(exc)) from exc
        except SandboxAPIError as exc:
            raise await self._sandbox_failure(job, "run", exc) from exc
        job.timings.generate_s = job.episode.generate_s
        job.timings.tools_s = job.episode.tools_s

    async def _eval(self, job: Job) -> None:
        try:
            # Nothing the agent started may run on while it is graded (a loop rewriting the tests, say).
            await job.env.end_processes()
            components = await job.handler.evaluate(job.env.for_task(), job.request.instance, job.episode.state)
        except SandboxAPIError as exc:
            raise await self._sandbox_failure(job, "eval", exc) from exc
        if "outcome" not in components:
            raise StageFailed("eval", f"task {job.request.task!r} returned no 'outcome': {components}")
        job.reward_components = {name: float(value) for name, value in components.items()}
        await self._shape_reward(job)  # the job is done once the stage's time is counted (_conclude_stage)

    async def _sandbox_failure(self, job: Job, stage: ErrorClass, exc: SandboxAPIError) -> StageFailed:
        """What a failed sandbox call means: its runtime lost (no answer, or the sandbox gone with a runtime that
        is gone too, as the pool and a health check confirm) starts the episode again elsewhere; anything else,
        a slow call or a sandbox reaped on a live runtime, fails the stage."""
        url = job.env.server_url
        if (isinstance(exc, SandboxUnreachable) or exc.status == 404) and await self.sandboxes.lost(url):
            return RuntimeLost(stage, url, exc)
        return StageFailed(stage, f"sandbox: {exc}")

    async def _shape_reward(self, job: Job) -> None:
        """Reward plugins add components beside the task's own; the shaped total is what the trainer gets.
        Plugins are user code: they run on a thread, so a slow one never stalls the event loop. When every one
        vouches for its hooks (`quick_reward_hooks`), they run here: the hand-off to a thread and back wakes
        both threads, and dropping it took bench_rollout's context switches from 4.9 to 3.3 per turn."""
        shape = functools.partial(
            self.plugins.shaped_reward, self._trajectory(job), job.request.instance, job.reward_components
        )
        try:
            job.reward_components, job.reward = (
                await asyncio.to_thread(shape) if self.plugins.reward_on_thread else shape()
            )
        except RewardComponentConflict as exc:
            raise StageFailed("eval", str(exc)) from exc

    # -- the machinery ----------------------------------------------------------------------------------
    async def _worker(
        self, name: str, state: JobState, work: Callable[[Job], Awaitable[None]], following: str | None
    ) -> None:
        queue = self._queues[name]
        # A run job also waits for a slot of the limit on episodes in the run stage, in the order the jobs came
        # (a lowered limit stops new episodes from starting; it never interrupts one).
        limiter = self.run_concurrency.limiter if state is JobState.running else None
        while True:
            job = await self._next_job(name, queue)
            if limiter is not None:
                await limiter.acquire()
                self._not_ahead(job)  # it holds a run slot now
            try:
                if job.state.finished:  # cancelled while it waited in the queue (or for a slot)
                    self._not_ahead(job)
                    continue
                if state is JobState.init:
                    job.timings.queued_s = time.monotonic() - job.submitted_mono
                try:
                    await self._run_stage(job, state, work)
                except Exception as exc:  # a bug of ours or a plugin's: it fails this job, never the worker
                    log.exception("job %s: %s stage failed unexpectedly", job.id, name)
                    error = JobError(error_class=_STAGE_NAMES[state], message=f"{type(exc).__name__}: {exc}")
                    await self._finish(job, JobState.failed, error)
                if job.state is JobState.queued:  # its runtime was lost: from the start, elsewhere
                    self._queues["init"].put_nowait(job)
                elif not job.state.finished and following:
                    self._queues[following].put_nowait(job)
            finally:
                if limiter is not None:
                    limiter.release()

    async def _next_job(self, name: str, queue: asyncio.Queue[Job]) -> Job:
        """The next job of a stage's queue; an init worker first waits for room at the init gate, which counts the
        job it gets as ahead of the run stage."""
        if name != "init":
            job = await queue.get()
            if name == "eval":
                self.init_gate.changed()  # the eval queue shrank
            return job
        await self.init_gate.enter()
        try:
            job = await queue.get()
        except asyncio.CancelledError:
            self.init_gate.cancel()
            raise
        self.init_gate.taken()
        job.ahead = True
        return job

    def _not_ahead(self, job: Job) -> None:
        if job.ahead:
            job.ahead = False
            self.init_gate.leave()

    async def _run_stage(self, job: Job, state: JobState, work: Callable[[Job], Awaitable[None]]) -> None:
        job.state = state
        stage = _STAGE_NAMES[state]
        self._stage_event(job, stage, "start", 0.0)
        budget = job.budget_left(self.config.default_timeout_s)
        started = time.monotonic()
        job.stage_task = task = asyncio.ensure_future(work(job))
        done, job.paused_s = await self._within_budget(task, started + budget, state is JobState.running, job.paused_s)
        seconds = time.monotonic() - started
        setattr(job.timings, f"{stage}_s", getattr(job.timings, f"{stage}_s") + seconds)
        job.stage_task = None
        try:
            await self._conclude_stage(job, state, task, done)
        finally:
            self._stage_event(
                job, stage, {JobState.failed: "failed", JobState.cancelled: "cancelled"}.get(job.state, "end"), seconds
            )

    async def _within_budget(
        self, task: asyncio.Task, deadline: float, paused_too: bool, paused_s: float
    ) -> tuple[set[asyncio.Task], float]:
        """Wait for `task` until `deadline`, moved on (where `paused_too`) by however long the weight-update barrier
        held generation meanwhile: an episode is not timed out for a pause it could do nothing about. Returns what
        is done, and `paused_s` plus that pause."""
        held_before = self.barrier.held_s()

        def paused() -> float:
            return self.barrier.held_s() - held_before if paused_too else 0.0

        while True:
            if paused_too and self.barrier.closed():  # the deadline moves on while it is closed: wait for either
                gate = asyncio.ensure_future(self.barrier.wait_open())
                done, _ = await asyncio.wait({task, gate}, return_when=asyncio.FIRST_COMPLETED)
                gate.cancel()
                if task in done:
                    return {task}, paused_s + paused()
                continue
            before = paused()
            done, _ = await asyncio.wait({task}, timeout=max(deadline + before - time.monotonic(), 0.0))
            if done or paused() == before:  # no hold since: the deadline stands
                return done, paused_s + paused()

    def _stage_event(self, job: Job, stage: str, event: str, seconds: float) -> None:
        self.plugins.notify(
            "prorl_stage_event",
            job_id=job.id,
            task=job.request.task,
            stage=stage,
            event=event,
            seconds=seconds,
            error=job.error,
        )

    async def _conclude_stage(self, job: Job, state: JobState, task: asyncio.Task, done: set) -> None:
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            message = f"time budget of {job.budget(self.config.default_timeout_s):g} s spent in {state.value}"
            if state is JobState.running and job.episode is None:
                # What the agent loop had made when the budget cut it: the trajectory (filtered all the same) shows
                # how long an episode ran before it was cut, which the truncation metric counts by length.
                job.episode = job.partial
            # A run cut while the LLM fleet is out was cut by the outage (its turn waits for a server: llm._choose).
            outage = state is JobState.running and self.llm.outage() is not None
            await self._finish(job, JobState.failed, JobError(error_class="timeout", message=message, outage=outage))
        elif task.cancelled():
            await self._finish(job, JobState.cancelled, JobError(error_class="cancelled", message="cancelled"))
        elif (exc := task.exception()) is not None:
            if isinstance(exc, RuntimeLost) and job.attempts < self.config.max_init_attempts:
                await self._start_again(job, exc)
                return
            if isinstance(exc, StageFailed):
                error = JobError(error_class=exc.error_class, message=str(exc), outage=exc.outage)
            else:
                log.error("job %s: unexpected error in %s", job.id, state.value, exc_info=exc)
                error = JobError(error_class=_STAGE_NAMES[state], message=f"{type(exc).__name__}: {exc}")
            await self._finish(job, JobState.failed, error)
        elif state is JobState.evaluating:  # graded, and eval_s counted: what the observers and records see
            # Shielded: a worker cancelled at stop while the sandbox is released must not leave the job marked
            # done but never delivered (its waiters, observers and records served).
            await asyncio.shield(self._finish(job, JobState.done))

    async def _start_again(self, job: Job, lost: RuntimeLost) -> None:
        """The episode is gone with its runtime: drop what it recorded and queue the job for init, away from
        that runtime. What the lost episode spent stays spent (the time budget counts it)."""
        log.warning("job %s: %s; starting it again on another runtime", job.id, lost)
        job.lost_runtimes.add(lost.url)
        await self._release(job)
        job.episode, job.partial, job.reward_components, job.reward = None, None, {}, 0.0
        job.state = JobState.queued

    async def _release(self, job: Job) -> None:
        """Delete the job's sandbox, waiting RELEASE_WAIT_S at most: past that it goes on in the background. A
        cancelled caller does not cancel the delete either."""
        env, job.env = job.env, None
        if env is None:
            return
        delete = asyncio.ensure_future(self.sandboxes.release(env))
        self._releases.add(delete)
        delete.add_done_callback(self._releases.discard)
        done, _ = await asyncio.wait({delete}, timeout=RELEASE_WAIT_S)
        if delete in done:
            delete.result()
        else:
            log.warning(
                "job %s: the delete of sandbox %s at %s has not answered in %g s; the job goes on without it",
                job.id,
                env.sandbox_id,
                env.server_url,
                RELEASE_WAIT_S,
            )

    async def _finish(self, job: Job, state: JobState, error: JobError | None = None) -> None:
        if job.state.finished:
            return
        job.state, job.error, job.partial = state, error, None  # what a cut run made is job.episode by now
        self._not_ahead(job)
        try:
            await self._release(job)
        except Exception:  # the job's result must still be delivered: never leave a waiter hanging
            log.exception("job %s: releasing its sandbox failed", job.id)
        try:
            job.result = self._trajectory(job)
        except Exception as exc:  # what the episode recorded is unusable: deliver the failure without it
            log.exception("job %s: its trajectory could not be built", job.id)
            job.state = JobState.failed
            job.error = JobError(
                error_class=job.error.error_class if job.error else "eval",
                message=f"the trajectory could not be built: {type(exc).__name__}: {exc}",
            )
            job.episode, job.reward, job.reward_components = None, 0.0, {}
            job.result = self._trajectory(job)
        self.counts[job.state] += 1
        self._finish_times.append(time.monotonic())
        job.finished.set()
        self.plugins.notify("prorl_job_finished", trajectory=job.result, state=job.state)

    def _trajectory(self, job: Job) -> Trajectory:
        episode = job.episode or Episode(prompt_ids=[])
        versions = [v for turn in episode.turns for v in turn.versions()] or [self.policy_version]
        return Trajectory(
            job_id=job.id,
            task=job.request.task,
            instance_id=job.handler.instance_id(job.request.instance) if job.handler else None,
            prompt_ids=episode.prompt_ids,
            response_ids=episode.response_ids,
            response_mask=episode.response_mask,
            response_logprobs=episode.response_logprobs,
            turns=episode.turns,
            num_turns=len(episode.turns),
            finish_reason=episode.finish_reason if job.error is None else "error",
            reward=job.reward,
            reward_components=job.reward_components,
            policy_version_min=min(versions),
            policy_version_max=max(versions),
            timings=job.timings.model_copy(),  # a copy: a delivered trajectory never changes afterwards
            error=job.error,
            filter=job.error is not None,
            labels=job.request.labels,
            group=job.request.group,
            attempt=job.request.attempt,
            retry_of=job.request.retry_of,
            artifacts=episode.state.artifacts,
            segments=episode.segments,
            prompt_messages=episode.prompt_messages,
            prompt_tools=episode.prompt_tools,
            cut=self._cut(job, episode),
        )

    def _cut(self, job: Job, episode: Episode) -> BudgetCut | None:
        """Which budget cut the episode short, if one did, and how far in (metrics count them by length)."""
        request, timings = job.request, job.timings
        if job.error is not None:
            if job.error.error_class != "timeout":
                return None
            # The stage it ran out in: the last that took time (a stage's time is counted before the job ends).
            stage = "eval" if timings.eval_s > 0 else "run" if timings.run_s > 0 else "init"
            limit, used = job.budget(self.config.default_timeout_s), round(job.spent_s(), 3)
            return BudgetCut(budget=f"{stage}_timeout", setting="timeout_s", limit=limit, used=used)
        if episode.finish_reason == "max_turns":
            return BudgetCut(budget="max_turns", setting="max_turns", limit=request.max_turns, used=len(episode.turns))
        if episode.finish_reason == "max_context":
            limit = request.max_context_tokens
            return BudgetCut(
                budget="max_context", setting="max_context_tokens", limit=limit, used=episode.context_length
            )
        if episode.finish_reason == "agent_timeout":
            limit = episode.state.time_limit_s
            return BudgetCut(
                budget="agent_timeout", setting="the agent's time", limit=limit, used=round(timings.run_s, 3)
            )
        return None

    def _forget_old_jobs(self) -> None:
        excess = len(self.jobs) - self.config.keep_finished
        for job_id in list(self.jobs)[: max(excess, 0)]:
            if self.jobs[job_id].state.finished:
                del self.jobs[job_id]
