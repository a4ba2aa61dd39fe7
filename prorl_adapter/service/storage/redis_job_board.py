"""The job board on Redis: replicas share the API's jobs (the contract: `job_board.JobBoard`).

Keys (prefix default `prorl:jobs`):
- `{prefix}:queue`: a list of job ids no replica has taken yet, oldest first;
- `{prefix}:claimed:{replica}`: a list of the ids one replica took and has not finished;
- `{prefix}:job:{id}`: a hash: `request` (JobRequest JSON), `status` (JobStatus JSON, kept current by the replica
  running it), `result` (Trajectory JSON, once finished); it expires `result_ttl_s` after the job finished.

A submission records and queues all its samples not yet recorded in one script, after checking that the records
it read (to refuse a conflicting one with a 409) are unchanged: however Redis fails, all are queued or none, and
a retry of it gives back the jobs made.

A replica takes a job with `BLMOVE queue -> claimed:{replica}` (atomic: the id is in exactly one list at any
time) whenever it has room (fewer unfinished jobs of its own than its init and run workers together), so jobs
go to whoever is free. It finishes one with a script that writes the result and removes the id from its list,
and announces it on the coordination channel (`finished:{id}`), which wakes whoever waits for it on any replica.
A cancel for a job another replica runs goes out on the channel too (`cancel:{id}`); one still queued is
cancelled where it lies. `take_over(replica)` moves a dead replica's list back to the head of the queue.

Writes of a replica go through one writer task, in order, retried while Redis is away: a status never
overwrites a later one, and a finished job's result is never lost by an outage (it waits in memory). Both are
written only while the job is still in the replica's list: a replica taken over writes nothing over its
successor's records. While the replica is fenced (it could not beat, `Replica`) it neither takes nor writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ...hooks.specs import hookimpl
from ...models import JobError, JobRequest, JobState, JobStatus, Trajectory
from ..job_runner import JobConflict, JobRunner, RunnerJob
from .buffer import ExperienceBufferError
from .job_board import JobBoard, UnknownJob
from .prompts import with_job_id
from .redis_connection import RedisConnection
from .redis_coordination import RedisCoordination

log = logging.getLogger(__name__)

_SUBMIT = """
-- KEYS: the queue, then each sample's job hash; ARGV: for each sample, 4 values: the request recorded under its id
-- when the caller read it ('' for none), its request JSON, its status JSON, its job id. One step for a whole
-- submission: if any record differs from what the caller read (a submission beside this one), nothing is written
-- and 0 returned (the caller reads and checks again); else every sample not recorded is recorded and queued, in
-- order, and 1 returned. Every check comes before the first write: a script that fails writes nothing.
redis.call('LLEN', KEYS[1])  -- the queue is a list (or none yet)
for i = 2, #KEYS do
  if (redis.call('HGET', KEYS[i], 'request') or '') ~= ARGV[4 * (i - 2) + 1] then return 0 end
end
for i = 2, #KEYS do
  local a = 4 * (i - 2)
  if ARGV[a + 1] == '' then
    redis.call('HSET', KEYS[i], 'request', ARGV[a + 2], 'status', ARGV[a + 3])
    redis.call('RPUSH', KEYS[1], ARGV[a + 4])
  end
end
return 1
"""

_FINISH = """
-- KEYS: the job's hash, this replica's claimed list; ARGV: job id, status JSON, result JSON, ttl s, channel.
-- Only while the job is still this replica's: one taken for dead must not overwrite the rerun's record.
if redis.call('LREM', KEYS[2], 0, ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'result', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', ARGV[5], 'finished:' .. ARGV[1])
return 1
"""

_CANCEL_QUEUED = """
-- KEYS: the job's hash, the queue; ARGV: job id, status JSON, result JSON, ttl s, channel. Cancels the job if no
-- replica has taken it yet (1), else leaves it to the replica running it (0).
if redis.call('LREM', KEYS[2], 0, ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'result', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', ARGV[5], 'finished:' .. ARGV[1])
return 1
"""

_WRITE_STATUSES = """
-- KEYS: this replica's claimed list, then each job's hash; ARGV: each job's id and status JSON, in turn. A status
-- is written only while the job is still in the list: one taken over meanwhile belongs to its new runner, whose
-- record a late write from here must not overwrite.
for i = 2, #KEYS do
  if redis.call('LPOS', KEYS[1], ARGV[2 * i - 3]) then redis.call('HSET', KEYS[i], 'status', ARGV[2 * i - 2]) end
end
return 0
"""

_REQUEUE_ALL = """
-- KEYS: a dead replica's claimed list, the queue. Moves every id to the head of the queue, in its order.
local moved = 0
while redis.call('RPOPLPUSH', KEYS[1], KEYS[2]) do moved = moved + 1 end
return moved
"""

CLAIM_BLOCK_S = 1.0  # one BLMOVE waits this long, so that stopping never waits for more
CANCEL_WAIT_S = 10.0  # how long a cancel of a job on another replica waits to see it final
RECHECK_S = 2.0  # a waiter looks at the record again this often (a `finished` message may have been missed)
RECONCILE_S = 10.0  # how often a replica looks for ids in its list that it does not know of


class RedisJobBoard(JobBoard):
    """Jobs shared by the replicas of one Redis (the module's docstring). It is also a plugin of the replica's
    pipeline: its stage events and finished jobs are what it writes back."""

    def __init__(
        self,
        runner: JobRunner,
        coordination: RedisCoordination,
        *,
        prefix: str = "prorl:jobs",
        result_ttl_s: float = 86_400.0,
    ) -> None:
        self.runner = runner
        self.coordination = coordination
        self.replica = coordination.replica_id
        self.prefix = prefix
        self.result_ttl_s = int(max(result_ttl_s, 1))
        self._queue = f"{prefix}:queue"
        self._claimed = f"{prefix}:claimed:{self.replica}"
        redis = coordination.redis
        self._submit = redis.register_script(_SUBMIT)
        self._finish = redis.register_script(_FINISH)
        self._cancel_queued = redis.register_script(_CANCEL_QUEUED)
        self._requeue_all = redis.register_script(_REQUEUE_ALL)
        self._write_statuses = redis.register_script(_WRITE_STATUSES)
        # Moves go through a connection that never retries: a BLMOVE whose reply was lost and that ran again would
        # move a second id, and the first would sit in this replica's list unknown to it (`_reconcile` finds it).
        self._mover = RedisConnection(coordination.url, retries=0)
        self._mine: set[str] = set()  # ids this replica took and has not finished
        self._room = asyncio.Event()
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._writes: dict[str, JobStatus] = {}  # statuses to write, latest only
        self._finished: list[RunnerJob] = []  # finished jobs to record, in order
        self._write_wanted = asyncio.Event()
        # Clear while the replica is fenced (`fence`): it neither takes jobs nor writes until it knows whether it
        # was taken over.
        self._acting = asyncio.Event()
        self._acting.set()
        self._reconcile_soon = False
        self._stopping: set[asyncio.Task[None]] = set()  # jobs a fence is stopping
        self._tasks: list[asyncio.Task[None]] = []

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    # -- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.coordination.on_event("finished", self._wake_waiter)
        self.coordination.on_event("cancel", self._cancel_here)
        self.runner.plugins.register(self, name="redis-job-board")
        await self._retrying("queueing again what an earlier run of this replica held", self._requeue_own)
        self._room.set()
        self._tasks = [asyncio.create_task(self._claim_forever()), asyncio.create_task(self._write_forever())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._mover.close()

    def disown_all(self) -> None:
        """This replica was taken for dead: its jobs run again elsewhere. It stops them here and writes nothing
        of them (the finish script would refuse anyway: they are no longer in its list)."""
        disowned, self._mine = self._mine, set()
        self._writes.clear()
        self._finished.clear()
        for job_id in disowned:
            if self.runner.job(job_id) is not None:
                self._in_background(self.runner.cancel(job_id))
        self._room.set()

    def fence(self) -> None:
        """This replica cannot beat and may be taken over at any moment: the jobs it runs stop (their sandboxes
        go) and are written nothing of, and it takes and writes nothing until `unfence`. A result already made
        stays, to be written if its job is still this replica's then."""
        self._acting.clear()
        for job_id in list(self._mine):
            job = self.runner.job(job_id)
            if job is not None and not job.state.finished:
                self._mine.discard(job_id)
                self._writes.pop(job_id, None)
                self._in_background(self._stop(job_id), self._stopping)
        self._room.set()

    async def _stop(self, job_id: str) -> None:
        """Cancel a job the fence stopped, and forget its run: if this replica runs it again, it runs anew."""
        await self.runner.cancel(job_id)
        self.runner.forget(job_id)

    def unfence(self) -> None:
        """The replica beats again: taken over (`disown_all` came first) or not, it takes and writes again; the
        jobs its list still holds that it stopped run here again (`_reconcile`)."""
        self._acting.set()
        self._reconcile_soon = True
        self._room.set()

    def _in_background(self, work, also: set[asyncio.Task[None]] | None = None) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)
        if also is not None:
            also.add(task)
            task.add_done_callback(also.discard)

    async def _requeue_own(self) -> None:
        moved = await self.take_over(self.replica)
        if moved:
            log.warning("queued again %d jobs an earlier run of %s held", moved, self.replica)

    async def take_over(self, replica_id: str) -> int:
        with self.coordination.errors(f"queueing again the jobs of replica {replica_id}"):
            return int(await self._requeue_all(keys=[f"{self.prefix}:claimed:{replica_id}", self._queue]))

    async def _retrying(self, what: str, attempt) -> None:
        delay = 0.5
        while True:
            try:
                return await attempt()
            except ExperienceBufferError as exc:
                log.warning("%s failed (%s); retrying in %g s", what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    # -- the API ----------------------------------------------------------------------------------------
    async def submit(self, request: JobRequest) -> tuple[list[JobStatus], bool]:
        samples = request.samples()
        for sample in samples:
            self.runner.check(sample)  # 400 for a task this service cannot run, before anything is queued
        samples = [with_job_id(sample) for sample in samples]
        keys = [self._key(sample.job_id) for sample in samples]
        while True:  # until no submission of the same ids came between the read and the write (rare; records stay)
            with self.coordination.errors("reading job records"):
                pipe = self.coordination.redis.pipeline(transaction=False)
                for key in keys:
                    pipe.hget(key, "request")
                recorded = await pipe.execute()
            for sample, document in zip(samples, recorded, strict=True):
                _check_same(sample, document)  # 409 for any, before anything is queued
            statuses = [
                JobStatus(job_id=s.job_id, task=s.task, state=JobState.queued, submitted_at=time.time(), timings={})
                for s in samples
            ]
            args: list[str] = []
            for sample, document, status in zip(samples, recorded, statuses, strict=True):
                args += [document or "", sample.model_dump_json(), status.model_dump_json(), sample.job_id]
            # Every new sample in one script: a failure (Redis gone, a reply lost) leaves all queued or none.
            with self.coordination.errors(f"queueing {len(samples)} jobs"):
                if await self._submit(keys=[self._queue, *keys], args=args):
                    break
        for i, (sample, document) in enumerate(zip(samples, recorded, strict=True)):
            if document is not None:  # recorded earlier (a retry): that job
                statuses[i] = await self.status(sample.job_id)
        return statuses, any(document is None for document in recorded)

    def _local(self, job_id: str) -> RunnerJob | None:
        """The job as this replica runs it: one of the board's it holds, or one that never went through the
        board (a decoupled prompt's, ProRL's /process)."""
        return self.runner.job(job_id)

    async def status(self, job_id: str) -> JobStatus:
        job = self._local(job_id)
        if job is not None and job_id in self._mine:
            return self._status(job)
        with self.coordination.errors(f"reading job {job_id}"):
            document = await self.coordination.redis.hget(self._key(job_id), "status")
        if document is not None:
            return JobStatus.model_validate_json(document)
        if job is not None:
            return self._status(job)
        raise UnknownJob(job_id)

    async def result(self, job_id: str, wait: float) -> Trajectory | JobStatus:
        deadline = time.monotonic() + wait
        job = self._local(job_id)
        if job is not None and job_id in self._mine:
            job = await self.runner.wait(job_id, wait)
            if job_id in self._mine or job.result is None:
                return job.result if job.result is not None else self._status(job)
            # Ended because this replica gave the job up (taken over, or fenced), or finished and written: the
            # answer is the record's, written by whoever runs the job now.
        event = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(event)
        try:
            while True:
                event.clear()
                with self.coordination.errors(f"reading job {job_id}"):
                    status, result = await self.coordination.redis.hmget(self._key(job_id), ["status", "result"])
                if status is None and job is not None:  # not a job of the board: this replica's own
                    job = await self.runner.wait(job_id, max(deadline - time.monotonic(), 0.0))
                    return job.result if job.result is not None else self._status(job)
                if status is None:
                    raise UnknownJob(job_id)
                if result is not None:
                    return Trajectory.model_validate_json(result)
                left = deadline - time.monotonic()
                if left <= 0:
                    return JobStatus.model_validate_json(status)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, RECHECK_S)):
                        await event.wait()
        finally:
            waiting = self._waiters.get(job_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[job_id]

    async def cancel(self, job_id: str) -> JobStatus:
        local = self._local(job_id)
        if local is not None and (job_id in self._mine or not await self._on_board(job_id)):
            return self._status(await self.runner.cancel(job_id))
        status = await self.status(job_id)
        if status.state.finished:
            return status
        with self.coordination.errors(f"cancelling job {job_id}"):
            # Recorded first: a replica that takes the job from now on (from the queue, or from a dead replica's
            # list) finds it and cancels it there, whether or not it heard the message below.
            await self.coordination.redis.hset(self._key(job_id), "cancel", "1")
            document = await self.coordination.redis.hget(self._key(job_id), "request")
        if document is not None:
            request = JobRequest.model_validate_json(document)
            job = self.runner.not_run(request, status.submitted_at, JobState.cancelled, _cancelled())
            with self.coordination.errors(f"cancelling job {job_id}"):
                args = [job_id, self._status(job).model_dump_json(), job.result.model_dump_json()]
                done = await self._cancel_queued(
                    keys=[self._key(job_id), self._queue], args=[*args, self.result_ttl_s, self.coordination.channel]
                )
            if done:
                return self._status(job)
        await self.coordination.publish("cancel", job_id)  # the replica running it cancels it
        reply = await self.result(job_id, CANCEL_WAIT_S)
        return reply if isinstance(reply, JobStatus) else await self.status(job_id)

    async def _on_board(self, job_id: str) -> bool:
        with self.coordination.errors(f"reading job {job_id}"):
            return bool(await self.coordination.redis.exists(self._key(job_id)))

    def _status(self, job: RunnerJob) -> JobStatus:
        status = job.status()
        status.replica = self.replica
        return status

    # -- taking and running jobs --------------------------------------------------------------------------
    async def _claim_forever(self) -> None:
        reconciled = time.monotonic()
        while True:
            await self._room.wait()
            await self._acting.wait()
            try:
                if self._reconcile_soon or time.monotonic() - reconciled >= RECONCILE_S:
                    self._reconcile_soon = False
                    await self._reconcile()
                    reconciled = time.monotonic()
                await self._claim_one()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away, or a record that does not parse: never the end of claiming
                log.warning("cannot take jobs: %s", exc)
                await asyncio.sleep(1.0)  # a pause before trying again

    async def _claim_one(self) -> None:
        if not self.runner.can_generate():
            # LLM servers are each replica's own (PUT /v1/llm-servers): one without any leaves the jobs to the
            # replicas that have some, rather than failing them.
            await asyncio.sleep(CLAIM_BLOCK_S)  # a period: its servers are checked every few seconds
            return
        with self._mover.errors(f"taking a job from {self._queue}"):
            job_id = await self._mover.redis.blmove(self._queue, self._claimed, CLAIM_BLOCK_S, "LEFT", "RIGHT")
        if job_id is not None:
            await self._take(job_id)

    async def _take(self, job_id: str) -> None:
        """Run a job this replica's list holds, or drop it from the list if there is nothing to run."""
        redis = self.coordination.redis
        with self.coordination.errors(f"reading job {job_id}"):
            document, cancel = await redis.hmget(self._key(job_id), ["request", "cancel"])
            if document is None:  # its record expired while it waited: nothing to run
                await redis.lrem(self._claimed, 0, job_id)
                return
        self._run_here(JobRequest.model_validate_json(document), cancelled=cancel is not None)

    async def _reconcile(self) -> None:
        """Ids in this replica's list that it does not know of (a move whose reply was lost, or a fence stopped
        them): run them. Those a fence is still stopping are waited for (taken now, they would be the ending run)."""
        await asyncio.gather(*self._stopping, return_exceptions=True)
        with self.coordination.errors(f"reading {self._claimed}"):
            listed = await self.coordination.redis.lrange(self._claimed, 0, -1)
        for job_id in listed:
            if job_id not in self._mine:
                await self._take(job_id)

    def _run_here(self, request: JobRequest, cancelled: bool = False) -> None:
        self._mine.add(request.job_id)
        if len(self._mine) >= self.runner.capacity():
            self._room.clear()
        if cancelled:  # cancelled while it waited, or while its replica died
            self._record_finished(self.runner.not_run(request, time.time(), JobState.cancelled, _cancelled()))
            return
        try:
            job, _ = self.runner.submit(request)
        except Exception as exc:  # a request this replica cannot run (a task it lacks): finish it as failed
            log.error("job %s cannot run here: %s", request.job_id, exc)
            error = JobError(error_class="init", message=f"cannot run: {exc}")
            self._record_finished(self.runner.not_run(request, time.time(), JobState.failed, error))
            return
        self._status_changed(job)
        if job.result is not None:  # known here already, and ended: record it again
            self._record_finished(job)

    def _cancel_here(self, job_id: str) -> None:
        if job_id in self._mine and self.runner.job(job_id) is not None:
            self._in_background(self.runner.cancel(job_id))

    def _wake_waiter(self, job_id: str) -> None:
        for event in self._waiters.get(job_id, ()):
            event.set()

    @hookimpl
    def prorl_stage_event(self, job_id: str, task: str, stage: str, event: str, seconds: float, error) -> None:
        job = self.runner.job(job_id)
        if job is not None and job_id in self._mine and not job.state.finished:
            self._status_changed(job)

    @hookimpl
    def prorl_job_finished(self, trajectory: Trajectory, state: JobState) -> None:
        job = self.runner.job(trajectory.job_id)
        if job is not None and trajectory.job_id in self._mine:
            self._record_finished(job)

    def _status_changed(self, job: RunnerJob) -> None:
        self._writes[job.id] = self._status(job)
        self._write_wanted.set()

    def _record_finished(self, job: RunnerJob) -> None:
        self._writes.pop(job.id, None)
        self._finished.append(job)
        self._write_wanted.set()

    async def _write_forever(self) -> None:
        while True:
            await self._write_wanted.wait()
            await self._acting.wait()
            self._write_wanted.clear()
            await self._retrying("writing job records", self._write_all)

    async def _write_all(self) -> None:
        statuses, self._writes = self._writes, {}
        try:
            if statuses:
                with self.coordination.errors("writing job states"):
                    args = [part for job_id, status in statuses.items() for part in (job_id, status.model_dump_json())]
                    await self._write_statuses(keys=[self._claimed, *map(self._key, statuses)], args=args)
        except ExperienceBufferError:
            for job_id, status in statuses.items():  # kept unless a later one came meanwhile
                self._writes.setdefault(job_id, status)
            raise
        while self._finished:
            job = self._finished[0]
            with self.coordination.errors(f"recording the result of job {job.id}"):
                args = [job.id, self._status(job).model_dump_json(), job.result.model_dump_json()]
                await self._finish(
                    keys=[self._key(job.id), self._claimed], args=[*args, self.result_ttl_s, self.coordination.channel]
                )
            self._finished.pop(0)
            self._mine.discard(job.id)
            if len(self._mine) < self.runner.capacity():
                self._room.set()


def _check_same(request: JobRequest, document: str | None) -> None:
    if document is not None and JobRequest.model_validate_json(document) != request:
        raise JobConflict(f"job id {request.job_id!r} is taken by a different request; use a new id")


def _cancelled() -> JobError:
    return JobError(error_class="cancelled", message="cancelled by request")
