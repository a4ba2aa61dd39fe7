"""Decoupled mode: the service keeps producing trajectories for upcoming prompts into the experience buffer
while the trainer consumes batches from it; admission control bounds how far ahead it runs.

    trainer ─ POST /v1/prompts ─> [upcoming prompts] ─ admitted? ─> pipeline ─> buffer ─ POST /v1/batches ─> trainer
                                                                                 (leased until acknowledged)

Before each new episode starts, every plugin is asked `prorl_admit_episode` (the staleness plugin's pace
mode answers False while starting one more could make a trajectory staler than K); admission also pauses while
the buffer holds `max_buffered` entries. A held episode is asked again when an episode finishes, a batch is
taken or acknowledged, or the policy version changes. When the trainer takes a batch, entries that no plugin
would weigh above 0 any more are removed first (`prorl_expired_before`), then `prorl_trajectory_weight` weighs
each taken trajectory; a weight of 0 drops it (acknowledged as consumed) and the rest go out with their weights.
The take serves the newest version first, unless a plugin answers `prorl_take_demands` (pace's `deadline-take`
rule): then it serves deadlines, the oldest version first, once the batch holds what the plugin demands
(`take_batch`).

Nothing waits forever and nothing is lost:
- A taken batch is leased (`lease_s`). Entries not acknowledged in time go back to the buffer and are
  delivered again, with their delivery count; after `max_deliveries` they are dead letters (removed, counted).
- When the buffer (Redis) is unreachable, production pauses and retries with backoff, the outage shows in
  `degraded` (GET /healthz, GET /v1/buffer), and trajectories finished meanwhile wait in order (at most
  `max_undelivered`, after which admission pauses too) until the buffer takes them.
- An admitted prompt stays recorded as running until its trajectory is in the buffer, so a service killed
  mid-run runs it again when it starts on the same prompt queue (`PromptQueue.recover`), or the replica that
  takes over for it does (`take_over`). An episode that failed for the infrastructure (sandbox, LLM server)
  runs again, up to `max_attempts` runs of its prompt.
- An LLM outage (`LLMPool.outage`: no server healthy, or an error-rate spike) is not a failing episode: admission
  pauses while it lasts (`held_back_reason` says so) and resumes when the pool tells its end, and an episode it
  failed (`JobError.outage`) runs again without its run counting against `max_attempts` (up to
  `max_outage_reruns` such runs; past them it counts like any other).

Replicas sharing one Redis share the prompts, the buffer and the counts admission weighs (every replica's
running prompts by version, `PromptQueue.running_versions`); each decision to admit is made under the
coordination's admission lock, on the shared policy version read inside it, so pace's bound holds for all of
them together. The lock is fenced: a pop made after it lapsed (its holder stalled past its expiry) is refused and
counted, never a silent breach of the bound. Replicas alive together admit in turns of one prompt, and each hears
at once of prompts added and room freed at any of them, so that they share the work about evenly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from server_kit.errors import ApiError

from ..hooks.specs import hookimpl
from ..models import AdmissionState, BatchItem, JobRequest, JobState, ProducerStats, Trajectory
from .job_runner import JobConflict, JobRunner, RunnerJob, UnknownTask
from .storage.buffer import ExperienceBuffer, ExperienceBufferError
from .storage.coordination import AdmissionLapsed, Coordination, MemoryCoordination
from .storage.prompts import MemoryPromptQueue, PromptQueue

if TYPE_CHECKING:
    from .llm import LLMPool

log = logging.getLogger(__name__)

RETRY_MAX_S = 30.0  # the longest pause between two attempts at an unreachable buffer
ADMIT_PER_LOCK = 32  # prompts one replica may admit per hold of the shared admission lock
SHARED_WAKE_S = 1.0  # with replicas, admission is asked again at least this often
# With other replicas alive, a replica admits one prompt per hold of the shared lock and then waits this long before
# it asks again: redis-py's lock is no queue (its waiters poll every 5 ms), so without the pause the replica that
# was woken first would win the lock again and again and run most episodes. Measured in bench_scale_out.
FAIR_TURN_S = 0.01


@dataclass
class ProducerConfig:
    lease_s: float = 600.0  # how long a taken batch may stay unacknowledged, unless the take asks otherwise
    max_deliveries: int = 3  # deliveries after which an entry still unacknowledged is a dead letter
    max_buffered: int = 10_000  # admission pauses while this many entries are buffered, leased or running
    max_undelivered: int = 1_000  # finished trajectories kept while the buffer is unreachable
    # Runs of one prompt whose episodes failed for the infrastructure (a sandbox, an LLM server, a service that
    # died): the prompt runs again until its trajectory is delivered or this many runs have failed.
    max_attempts: int = 5
    retry_delay_s: float = 1.0  # before the second run; doubled for each further one (at most RETRY_MAX_S)
    # Runs of one prompt an LLM outage failed that do not count against max_attempts; past them, one counts.
    max_outage_reruns: int = 20


class BadTake(ApiError, ValueError):
    """A take the service cannot weigh as asked (the API answers 400); its entries are handed back."""

    status = 400


class BufferFull(ApiError):
    """An import the buffer has no room for under max_buffered (the API answers 409)."""

    status = 409


@dataclass
class Lease:
    deadline: float
    deliveries: int
    version: int  # the entry's policy_version_min


class Producer:
    """Feeds admitted prompts to the pipeline and finished trajectories to the buffer.

    It is also a plugin, registered by the service: it observes finished jobs (`prorl_job_finished`), and a
    new policy version (`prorl_policy_version_changed`) wakes held-back episodes.
    """

    def __init__(
        self,
        runner: JobRunner,
        buffer: ExperienceBuffer,
        prompts: PromptQueue | None = None,
        config: ProducerConfig | None = None,
        coordination: Coordination | None = None,
        llm: LLMPool | None = None,
    ) -> None:
        self.runner = runner
        self.buffer = buffer
        self.prompts = prompts or MemoryPromptQueue()
        self.config = config or ProducerConfig()
        # The admission lock, and the policy version admission and takes weigh against (in the service, the same
        # coordination the runner reads the version from).
        self.coordination = coordination or MemoryCoordination("prorl-rollout")
        if self.coordination.shared and self.prompts.redis_server != self.coordination.redis_server:
            # Admission's pops are fenced by the shared lock: one Redis must hold both (`PromptQueue.pop`).
            raise ValueError(
                f"the prompt queue ({self.prompts.redis_server or 'in this process'}) and the coordination (Redis "
                f"at {self.coordination.redis_server}) must be on one Redis: give both the same URL"
            )
        self._in_flight: set[str] = set()  # job ids of the prompts this replica runs
        self._finished: deque[RunnerJob] = deque()  # waiting to be put into the buffer, in order
        self._leases: dict[str, Lease] = {}
        self._wakeup = asyncio.Event()
        self._delivery = asyncio.Event()
        self._acting = asyncio.Event()  # clear while the replica is fenced: nothing is delivered (`fence`)
        self._acting.set()
        self._lease_change = asyncio.Event()
        self._changed = asyncio.Event()  # set by `wake` and replaced: every deadline take waiting on it wakes
        self._deadline_take = asyncio.Lock()  # a deadline take's check and its take are one step
        self._tasks: list[asyncio.Task[None]] = []
        self._retries: set[asyncio.Task[None]] = set()
        self._stopping: set[asyncio.Task[None]] = set()  # episodes a fence is stopping
        self.stats = ProducerStats()
        self._dead: deque[str] = deque(maxlen=100)
        self.coordination.on_admission_news(self.wake)
        # Replicas alive (this one too), as the replica's last beat told: with others, admission takes turns.
        self.replicas_alive = 1
        # The runner's LLM servers: admission pauses during their outage, and their recovery wakes it.
        self.llm = llm
        if llm is not None:
            llm.on_outage(lambda outage: self.wake())

    # -- life cycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        for loop in (self._produce_forever, self._deliver_forever, self._expire_leases_forever):
            self._tasks.append(asyncio.create_task(loop()))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._retries, *self._stopping]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @hookimpl
    def prorl_policy_version_changed(self, version: int) -> None:
        self.wake()

    @hookimpl
    def prorl_job_finished(self, trajectory: Trajectory, state: JobState) -> None:
        job = self.runner.job(trajectory.job_id)
        if job is not None:
            self._on_finished(job)

    def wake(self) -> None:
        self._wakeup.set()
        self._changed.set()
        self._changed = asyncio.Event()

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[None]]) -> bool:
        """Run `attempt()` until it gets through: an unreachable buffer or queue is waited out, with backoff.
        Returns whether it failed at least once."""
        delay, failed = 0.5, False
        while True:
            try:
                await attempt()
            except ExperienceBufferError as exc:
                failed = True
                self._degraded(f"{what}: {exc}; retrying every {min(delay, RETRY_MAX_S):g} s at most")
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self.stats.degraded = None
            return failed

    def _degraded(self, message: str) -> None:
        if self.stats.degraded != message:
            log.warning("decoupled mode degraded: %s", message)
        self.stats.degraded = message

    # -- producing --------------------------------------------------------------------------------------
    async def enqueue(self, requests: list[JobRequest]) -> int:
        upcoming = await self.prompts.push(requests)
        self.wake()
        # The other replicas share the queue: told now, they admit alongside this one instead of at their next
        # look (SHARED_WAKE_S), by when this one may have taken every prompt its workers can run.
        with contextlib.suppress(ExperienceBufferError):  # pushed all the same; they look again anyway
            await self.coordination.prompts_added()
        return upcoming

    async def _produce_forever(self) -> None:
        await self._retrying("recovering the prompts an earlier run left running", self._resubmit_running)
        # Entries taken but never acknowledged before the restart: their leases died with that process.
        await self._retrying(
            "handing back the entries an earlier run had leased",
            partial(self.buffer.take_over, self.coordination.replica_id),
        )
        while True:
            self._wakeup.clear()
            if await self._retrying("admitting prompts", self._admit_while_allowed):
                # A pop whose reply was lost (the queue went away mid-call) moved its prompt to the running
                # record without this process knowing: take back whatever runs there and not here.
                await self._retrying("recovering prompts admitted during an outage", self._resubmit_running)
            # Shared state: what frees room may happen at another replica (an ack, a finished episode), which
            # wakes only that one; asking again every second keeps every replica admitting.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SHARED_WAKE_S if self.coordination.shared else None):
                    await self._wakeup.wait()

    async def _resubmit_running(self) -> None:
        """Prompts recorded as running that no episode here is running (an earlier incarnation admitted them,
        or a reply was lost, or a fence stopped them) run again: admission was granted. Those in flight here are
        left alone; those a fence is still stopping are waited for (submitted now, they would be the ending run)."""
        await asyncio.gather(*self._stopping, return_exceptions=True)
        for request in await self.prompts.recover():
            await self._submit(request)

    def disown_all(self) -> None:
        """This replica was taken for dead: the prompts it ran are another's now. Stop their episodes and
        deliver none of them (the other runs them; the queue refuses to end another's run anyway)."""
        disowned, self._in_flight = self._in_flight, set()  # what waits for delivery is skipped
        for job_id in disowned:
            if self.runner.job(job_id) is not None:
                task = asyncio.ensure_future(self.runner.cancel(job_id))
                self._retries.add(task)
                task.add_done_callback(self._retries.discard)
        self.wake()

    def fence(self) -> None:
        """This replica cannot beat and may be taken over at any moment: the episodes of its prompts that still
        run stop, and nothing is delivered until `unfence`. A trajectory already made waits, delivered if its
        prompt is still this replica's then."""
        self._acting.clear()
        for job_id in list(self._in_flight):
            job = self.runner.job(job_id)
            if job is not None and not job.state.finished:
                self._in_flight.discard(job_id)
                task = asyncio.ensure_future(self._stop(job_id))
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    async def _stop(self, job_id: str) -> None:
        """Cancel an episode the fence stopped, and forget its run: if its prompt runs here again, it runs anew."""
        await self.runner.cancel(job_id)
        self.runner.forget(job_id)

    def unfence(self) -> None:
        """The replica beats again (told first, by `disown_all`, if it was taken over): deliveries go on, and the
        prompts still recorded as running here that it stopped run again."""
        self._acting.set()
        again = self._retrying("running again the prompts a fence stopped", self._resubmit_running)
        task = asyncio.ensure_future(again)
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)
        self.wake()

    async def take_over(self, replica_id: str) -> int:
        """Run here the prompts a dead replica was running, and serve again the entries it had leased."""
        requests = await self.prompts.take_over(replica_id)
        for request in requests:
            await self._submit(request)
        handed_back = await self.buffer.take_over(replica_id)
        self.stats.redelivered += handed_back
        return len(requests)

    async def _admit_while_allowed(self) -> None:
        while True:
            admitted: list[JobRequest] = []
            lapsed = False
            # Alone, several per hold (the counts change with each pop); beside other replicas, turns of one each.
            per_hold = ADMIT_PER_LOCK if self.replicas_alive <= 1 else 1
            async with self.coordination.admission_lock() as fence:
                if self.coordination.shared:  # read under the lock: what another replica set a moment ago counts
                    await self.coordination.policy_version()  # `version` follows the read
                while len(admitted) < per_hold and await self._admitted(len(admitted)):
                    try:
                        request = await self.prompts.pop(self.coordination.version, fence)
                    except AdmissionLapsed as exc:
                        # The lock expired while this hold decided: another replica may have admitted on the same
                        # counts since. The pop refused; the decision is made again under a fresh lock.
                        lapsed = True
                        self.stats.admission_lock_lapses += 1
                        log.warning("%s; admission is asked again under a fresh lock", exc)
                        break
                    if request is None:
                        break
                    admitted.append(request)
            for request in admitted:
                await self._submit(request)
            if len(admitted) < per_hold and not lapsed:
                return
            if per_hold == 1:
                await asyncio.sleep(FAIR_TURN_S)  # the other replicas' turn at the lock (FAIR_TURN_S)

    async def _submit(self, request: JobRequest) -> None:
        try:
            job, _ = self.runner.submit(request)  # a known job id gives back that job (idempotent)
        except (JobConflict, UnknownTask) as exc:  # this prompt can never run; the others can
            log.error("prompt %s dropped: %s", request.job_id, exc)
            self.stats.filtered += 1
            await self.prompts.done(request.job_id)
            return
        if job.id in self._in_flight:
            return
        self._in_flight.add(job.id)
        if job.result is not None:  # a prompt enqueued again under the id of a job that has ended: deliver it
            self._on_finished(job)

    async def _admitted(self, popped: int = 0) -> bool:
        """Whether one more prompt may start now; `popped`: those popped in this hold, not yet submitted."""
        buffered = await self.buffer.version_counts()
        running = await self.prompts.running_versions()  # every replica's
        held = None
        # What runs now lands in the buffer soon: it counts against the bound too.
        if not self._acting.is_set():
            held = "this replica could not beat and is fenced until it learns whether it was taken over"
        elif sum(buffered.values()) + sum(running.values()) >= self.config.max_buffered:
            held = f"the buffer holds or is about to hold max_buffered={self.config.max_buffered} entries"
        elif len(self._finished) >= self.config.max_undelivered:
            held = f"{len(self._finished)} finished trajectories wait for the buffer"
        elif self.llm is not None and (outage := self.llm.outage()) is not None:
            # In every mode: an episode started now would only wait for a server, or fail.
            others = "; the other replicas admit" if self.coordination.shared else ""
            held = f"LLM outage: {outage.reason}; admission resumes when an LLM server is healthy again{others}"
        elif self.coordination.shared and (running_here := len(self._in_flight) + popped) >= self.runner.capacity():
            # Replicas share the upcoming prompts: each admits what its own workers can run, and the others the rest.
            held = f"this replica runs {running_here} episodes, what its workers take; the others admit"
        elif self.coordination.shared and not self.runner.can_generate():
            # Replicas share the prompts, not the LLM servers: one without any leaves them to the others.
            held = "this replica has no healthy LLM server (PUT /v1/llm-servers); the other replicas admit"
        else:
            state = AdmissionState(self.coordination.version, running, buffered)
            try:
                if not self.runner.plugins.admits(state):
                    held = "admission control (a plugin) holds new episodes back"
            except Exception as exc:  # a plugin's bug: hold (the pace guarantee stands), say why, ask again later
                log.exception("an admission plugin failed")
                held = f"admission control failed ({type(exc).__name__}: {exc}); asked again at the next event"
        self.stats.held_back_reason = held
        self.stats.held_back = held is not None and await self.prompts.size() > 0
        return held is None

    def _on_finished(self, job: RunnerJob) -> None:
        if job.id in self._in_flight:
            self._finished.append(job)
            self._delivery.set()

    async def _deliver_forever(self) -> None:
        """Finished trajectories into the buffer, one at a time and in order; an outage holds the queue."""
        while True:
            await self._delivery.wait()
            self._delivery.clear()
            while self._finished:
                await self._retrying("putting a trajectory into the buffer", self._deliver_first)

    async def _deliver_first(self) -> None:
        await self._acting.wait()
        job = self._finished[0]
        if job.id not in self._in_flight:  # disowned while it waited (this replica was taken for dead)
            self._finished.popleft()
            return
        if job.result is not None and not job.result.filter:
            await self.buffer.put(job.result)
            self.stats.produced += 1
        elif (again := self._another_attempt(job)) is not None:
            self._finished.popleft()
            self._retry_later(job, again)
            return
        else:
            self.stats.filtered += 1
        await self._settle(job)
        self._finished.popleft()
        if job.result is None or job.result.filter:  # nothing went into the buffer: its room is free now
            await self._room_freed()

    async def _settle(self, job: RunnerJob) -> None:
        """The job's prompt is done with; only now does it stop counting as in flight for admission."""
        await self.prompts.done(job.id)
        self._in_flight.discard(job.id)
        self.wake()

    def _retry_later(self, job: RunnerJob, again: JobRequest) -> None:
        """Queue the prompt anew after a backoff (an outage that failed this run may fail the next at once).
        Until then it stays recorded as running, so a restart in between runs it again."""
        counted = again.attempt - again.outage_reruns  # the backoff grows with the runs that count
        delay = min(self.config.retry_delay_s * 2 ** max(counted - 2, 0), RETRY_MAX_S)
        task = asyncio.ensure_future(self._requeue_after(job, again, delay))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _requeue_after(self, job: RunnerJob, again: JobRequest, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._retrying("queueing a failed prompt to run again", partial(self._requeue, job, again))

    async def _requeue(self, job: RunnerJob, again: JobRequest) -> None:
        await self.prompts.push([again])
        self.stats.retried += 1
        self.stats.outage_reruns += again.outage_reruns > job.request.outage_reruns
        await self._settle(job)

    def _another_attempt(self, job: RunnerJob) -> JobRequest | None:
        """The prompt of an episode that failed for the infrastructure, to run again under a job id of its own;
        None once it has failed max_attempts times, or when it was cancelled. A run an LLM outage failed does not
        count (`outage_reruns`, up to max_outage_reruns): the outage was no fault of the episode's, and admission
        holds the rerun until the outage is over."""
        error = job.result.error if job.result is not None else None
        if error is None or error.error_class == "cancelled":
            return None
        request = job.request
        attempt = request.attempt + 1
        outage_reruns = request.outage_reruns + (error.outage and request.outage_reruns < self.config.max_outage_reruns)
        if attempt - outage_reruns > self.config.max_attempts:
            return None
        first = request.retry_of or job.id
        update = {
            "job_id": f"{first[:120]}:{attempt}",
            "attempt": attempt,
            "retry_of": first,
            "outage_reruns": outage_reruns,
        }
        return request.model_copy(update=update)

    # -- consuming --------------------------------------------------------------------------------------
    async def take_batch(
        self,
        size: int,
        timeout: float | None,
        current_logprobs: dict[str, list[float]] | None = None,
        lease_s: float | None = None,
    ) -> list[BatchItem]:
        """Up to `size` trajectories with their weights, leased for `lease_s`; the ones weighed 0 are dropped
        (and acknowledged), and the ones no plugin would weigh above 0 are removed before the take.

        The newest version first, waiting up to `timeout` for `size` (then what there is), unless a plugin
        demands a deadline take (`prorl_take_demands`, e.g. pace's `deadline-take` rule): see
        `_take_serving_deadlines`."""
        plugins = self.runner.plugins
        expired_before = plugins.expired_before(self.coordination.version)
        if expired_before is not None:
            self.stats.expired += await self.buffer.expire(expired_before)
        entries = await self._take_serving_deadlines(size, timeout)
        if entries is None:
            entries = await self.buffer.take(size, timeout)
        version = self.coordination.version
        try:
            for entry in entries:
                logprobs = (current_logprobs or {}).get(entry.id)
                if logprobs is not None and len(logprobs) != len(entry.trajectory.response_ids):
                    raise BadTake(
                        f"current_logprobs[{entry.id!r}] has {len(logprobs)} values for "
                        f"{len(entry.trajectory.response_ids)} response tokens"
                    )
                entry.weight = plugins.weigh(entry.trajectory, version, logprobs)
        except Exception:  # nothing taken may be lost: hand the entries back before answering
            await self.buffer.release([entry.id for entry in entries])
            raise
        kept = [entry for entry in entries if entry.weight.sample != 0.0]
        dropped = [entry.id for entry in entries if entry.weight.sample == 0.0]
        deadline = time.monotonic() + (self.config.lease_s if lease_s is None else lease_s)
        for item in kept:
            self._leases[item.id] = Lease(deadline, item.deliveries, item.trajectory.policy_version_min)
        self._lease_change.set()
        if dropped:
            await self.buffer.ack(dropped)
            self.stats.dropped += len(dropped)
        self.wake()
        return kept

    async def _take_serving_deadlines(self, size: int, timeout: float | None) -> list[BatchItem] | None:
        """A take that serves deadlines, or None when no plugin demands one (`prorl_take_demands`).

        The oldest version first, once the `size` oldest ready trajectories hold every demand d_j (at least d_j
        of versions <= j) and `size` are ready: with `size` = the rule's batch size, pace's
        `deadline_take_ready`. Until then it waits, woken by `wake` (a trajectory buffered and settled, an ack,
        a lease run out, a new version), with replicas also every SHARED_WAKE_S (what another one buffers wakes
        only that one). When `timeout` passes first it returns what is ready if that meets every demand, else
        nothing: a batch that left a demand unmet would let a trajectory be consumed with staleness > K once
        the version moves on, whereas an empty one changes nothing (ask again). The demands are asked afresh
        each time, with the entries leased here counting as consumed, so a take topped up at one version
        counts what it took before; a demand larger than `size` asks for a take wholly of its versions, so several
        smaller takes at one version meet it together and none waits for ever. What the bound cannot cover: a batch
        whose lease runs out unacknowledged (the trainer never consumed it) comes back, and may then be taken later
        than K.

        Concurrent takes: each check and the take it allows are one step (a lock, not held while waiting)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        while True:
            changed = self._changed  # before looking: a change while we look wakes the wait below
            remaining = None if deadline is None else deadline - loop.time()
            timed_out = remaining is not None and remaining <= 0
            async with self._deadline_take:
                demands = self.runner.plugins.take_demands(await self._take_state())
                if demands is None:
                    return None
                # A demand beyond the take's size (a take smaller than the rule's batch size, or a lease run out
                # unacknowledged) could never be held: this take is then wholly of those versions, the oldest first.
                demands = {j: min(d, size) for j, d in demands.items()}
                ready = await self.buffer.ready_counts()
                if _holds(_oldest(ready, size), demands) and (sum(ready.values()) >= size or timed_out):
                    entries = await self.buffer.take(size, timeout=0, order="oldest")
                    if _holds(_counts(entries), demands):
                        return entries
                    # Overtaken between the count and the take (another consumer of a shared buffer): hand
                    # them back (their next delivery counts one more) and look again after the next change.
                    await self.buffer.release([entry.id for entry in entries])
            if timed_out:
                return []
            wait = SHARED_WAKE_S if self.coordination.shared else None
            if remaining is not None:
                wait = remaining if wait is None else min(wait, remaining)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await changed.wait()

    async def _take_state(self) -> AdmissionState:
        """What admission sees, with the entries leased here counting as consumed (`prorl_take_demands`)."""
        buffered = dict(await self.buffer.version_counts())
        for lease in self._leases.values():
            if buffered.get(lease.version, 0) > 0:
                buffered[lease.version] -= 1
        buffered = {version: n for version, n in buffered.items() if n > 0}
        return AdmissionState(self.coordination.version, await self.prompts.running_versions(), buffered)

    async def import_trajectories(self, trajectories: list[Trajectory]) -> list[str]:
        """Put imported trajectories into the buffer, all or none; the next takes deliver them. Refused (409) where
        they would take the buffer past max_buffered: an import may not grow it without bound, nor hold admission
        back for the service's own episodes beyond what the operator allowed."""
        held = sum((await self.buffer.version_counts()).values())
        if held + len(trajectories) > self.config.max_buffered:
            raise BufferFull(
                f"the buffer holds {held} entries: {len(trajectories)} more would pass max_buffered="
                f"{self.config.max_buffered}; import after the trainer has taken some"
            )
        ids = await self.buffer.put_many(trajectories)
        self.stats.imported += len(ids)
        return ids

    async def ack(self, ids: list[str]) -> int:
        acknowledged = await self.buffer.ack(ids)
        for entry_id in ids:
            self._leases.pop(entry_id, None)
        self.wake()
        await self._room_freed()
        return acknowledged

    async def _room_freed(self) -> None:
        """Tell every replica that room was freed here (an ack, a filtered episode, dead letters): the first to ask
        under the admission lock gets it, not this replica alone because it looked at once while the others
        looked at their next period (SHARED_WAKE_S), which ran most episodes where the trainer acknowledged."""
        if self.coordination.shared:
            with contextlib.suppress(ExperienceBufferError):  # the others look again anyway
                await self.coordination.room_freed()

    async def _expire_leases_forever(self) -> None:
        while True:
            self._lease_change.clear()
            now = time.monotonic()
            expired = [entry_id for entry_id, lease in self._leases.items() if lease.deadline <= now]
            if expired:
                await self._retrying("handing back entries whose lease ran out", partial(self._end_leases, expired))
                continue
            wait = min((lease.deadline for lease in self._leases.values()), default=now + 3600.0) - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0.0)):
                    await self._lease_change.wait()

    async def _end_leases(self, ids: list[str]) -> None:
        """Entries whose consumer did not acknowledge them in time: delivered again, or dead letters."""
        dead = [i for i in ids if i in self._leases and self._leases[i].deliveries >= self.config.max_deliveries]
        again = [i for i in ids if i in self._leases and i not in dead]
        if dead:
            removed = await self.buffer.ack(dead)
            self.stats.dead_letters += removed
            self._dead.extend(dead)
            log.warning("%d entries taken %d times were never acknowledged: dead letters", removed, len(dead))
        if again:
            self.stats.redelivered += await self.buffer.release(again)
        for entry_id in dead + again:
            self._leases.pop(entry_id, None)
        self.wake()
        if dead:
            await self._room_freed()

    async def snapshot(self) -> ProducerStats:
        try:
            self.stats.upcoming = await self.prompts.size()
        except ExperienceBufferError as exc:
            self._degraded(f"reading the prompt queue: {exc}")
        self.stats.in_flight = len(self._in_flight)
        try:
            running = await self.prompts.running_versions()
            self.stats.versions_in_flight = [version for version, n in running.items() for _ in range(n)]
        except ExperienceBufferError as exc:
            self._degraded(f"reading the prompt queue: {exc}")
        self.stats.leased = len(self._leases)
        self.stats.undelivered = len(self._finished)
        self.stats.recent_dead_letters = list(self._dead)
        return self.stats


def _oldest(ready: dict[int, int], size: int) -> dict[int, int]:
    """The version counts of the `size` oldest of `ready` (version -> count)."""
    chosen: dict[int, int] = {}
    for version in sorted(ready):
        if size <= 0:
            break
        chosen[version] = min(ready[version], size)
        size -= chosen[version]
    return chosen


def _counts(entries: list[BatchItem]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for entry in entries:
        version = entry.trajectory.policy_version_min
        counts[version] = counts.get(version, 0) + 1
    return counts


def _holds(batch: dict[int, int], demands: dict[int, int]) -> bool:
    """Whether a batch (version -> count) holds at least d_j of versions <= j for every demand {j: d_j}."""
    return all(sum(n for version, n in batch.items() if version <= j) >= d for j, d in demands.items())
