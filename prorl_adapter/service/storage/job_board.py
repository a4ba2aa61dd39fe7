"""The job board: where the API's jobs (`POST /v1/jobs` and what follows) are recorded, and which replica runs them.

    client ── POST /v1/jobs ─> JobBoard ─> a replica's pipeline (init -> run -> eval) ─> JobBoard ── result ─> client

`MemoryJobBoard` (with `memory://`) is the one-process service as it always was: the pipeline's own jobs are the
record. `RedisJobBoard` (`redis_job_board.py`, with a Redis URL) records every job in Redis, so that replicas
share them: a job waits in one shared queue, the first replica with room takes it, and any replica answers for
it (its state, its result, a cancel). A replica that dies with jobs in hand loses none: a survivor puts them
back at the head of the queue (`take_over`), and they run again, at least once.
"""

from __future__ import annotations

import abc

from server_kit.errors import ApiError

from ...models import JobRequest, JobStatus, Trajectory
from ..job_runner import JobRunner


class UnknownJob(ApiError, KeyError):
    status = 404

    def __str__(self) -> str:
        return f"no job {self.args[0]!r}"


class JobBoard(abc.ABC):
    @abc.abstractmethod
    async def submit(self, request: JobRequest) -> tuple[list[JobStatus], bool]:
        """Record and queue every sample of the request (`num_samples`), or none (a 400 or 409 for any refuses
        them all). Idempotent by job id. Returns (each sample's status, whether any was new)."""

    @abc.abstractmethod
    async def status(self, job_id: str) -> JobStatus:
        """The job's state and timings; `UnknownJob` (404) for an id never seen or long forgotten."""

    @abc.abstractmethod
    async def result(self, job_id: str, wait: float) -> Trajectory | JobStatus:
        """The trajectory once the job has finished, waiting up to `wait` seconds; its status if not yet."""

    @abc.abstractmethod
    async def cancel(self, job_id: str) -> JobStatus:
        """Cancel the job wherever it runs (its sandbox is deleted); its final status."""

    async def take_over(self, replica_id: str) -> int:
        """Queue again the jobs a dead replica held; returns how many."""
        return 0

    def disown_all(self) -> None:
        """This replica was taken for dead: drop the jobs it held (they run elsewhere now)."""
        return None

    def fence(self) -> None:
        """This replica cannot beat and may be taken over: stop running its jobs, and write nothing, until
        `unfence` (a board with no other replicas has nothing to fence)."""
        return None

    def unfence(self) -> None:
        """This replica beats again (told first, by `disown_all`, if it was taken over): act again."""
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class MemoryJobBoard(JobBoard):
    """One process: the pipeline's jobs are the record."""

    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    async def submit(self, request: JobRequest) -> tuple[list[JobStatus], bool]:
        submitted = self.runner.submit_samples(request)
        return [job.status() for job, _ in submitted], any(new for _, new in submitted)

    def _job(self, job_id: str):
        job = self.runner.job(job_id)
        if job is None:
            raise UnknownJob(job_id)
        return job

    async def status(self, job_id: str) -> JobStatus:
        return self._job(job_id).status()

    async def result(self, job_id: str, wait: float) -> Trajectory | JobStatus:
        job = await self.runner.wait(self._job(job_id).id, wait)
        return job.result if job.result is not None else job.status()

    async def cancel(self, job_id: str) -> JobStatus:
        return (await self.runner.cancel(self._job(job_id).id)).status()
