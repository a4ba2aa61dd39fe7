"""The queue of upcoming prompts of decoupled mode, and the record of the ones admitted but not yet delivered.

A prompt moves `push` -> upcoming -> `pop` (admitted by one replica, at a policy version: it now runs as a job,
under its job id) -> running -> `done` (its trajectory is in the experience buffer, or it failed and was
counted). What a replica was running when it died is handed back by `recover` to its next incarnation (same
id), or by `take_over` to the replica that takes over for it, which runs it again: with a queue that outlives
the process (`redis_prompts.RedisPromptQueue`), every prompt enqueued is delivered at least once.
`running_versions` counts the running prompts of every replica by the version they were admitted at: what
admission control weighs. `MemoryPromptQueue` (the default, with the memory buffer) lives and dies with the
process, like that buffer.

A pop is admission's one write, made under the coordination's admission lock; where that lock can expire under
its holder (Redis), the pop is given the hold's fence and checks it in the same atomic step (`pop`), so a holder
that stalled past the lock's expiry admits nothing on the counts it read before. The queue must then be on the
lock's Redis server (`redis_server`): only there can one step check both.
"""

from __future__ import annotations

import abc
import uuid
from collections import Counter, deque

from ...models import JobRequest
from .coordination import AdmissionFence


def with_job_id(request: JobRequest) -> JobRequest:
    """The request with a job id: it names the prompt while it runs, and again if it must run again."""
    return request if request.job_id else request.model_copy(update={"job_id": uuid.uuid4().hex})


def check_fence(queue: PromptQueue, fence: AdmissionFence | None) -> None:
    """Refuse a fence the queue cannot check: its lock is on another Redis server (or the queue on none)."""
    if fence is not None and fence.redis_server != queue.redis_server:
        where = f"Redis at {queue.redis_server}" if queue.redis_server else "this process"
        raise ValueError(
            f"the prompt queue ({where}) cannot check the admission lock on Redis at {fence.redis_server}: "
            "give the prompt queue and the coordination the same Redis URL"
        )


class PromptQueue(abc.ABC):
    redis_server: str | None = None  # the Redis server (host:port/db) the queue is on; None: this process

    @abc.abstractmethod
    async def push(self, requests: list[JobRequest]) -> int:
        """Append prompts (each given a job id if it has none), all in one step: all are upcoming or none;
        returns how many are upcoming now."""

    @abc.abstractmethod
    async def pop(self, version: int, fence: AdmissionFence | None = None) -> JobRequest | None:
        """The next upcoming prompt, now recorded as running here, admitted at `version`; None when there is
        none. With `fence` (the admission lock's, `Coordination.admission_lock`): only if the lock still holds
        its token, checked in the same step, which also renews the lock; `AdmissionLapsed` otherwise, and nothing
        moves. A fence of another Redis server than the queue's cannot be checked: ValueError."""

    @abc.abstractmethod
    async def done(self, job_id: str) -> None:
        """The prompt's trajectory was delivered (or its failure counted): forget it."""

    @abc.abstractmethod
    async def recover(self) -> list[JobRequest]:
        """Every prompt recorded as running here (popped, not yet done): what an earlier incarnation of this
        replica left, or one whose pop reply was lost; the producer runs again those it is not running."""

    async def take_over(self, replica_id: str) -> list[JobRequest]:
        """The prompts a dead replica was running, now recorded as running here."""
        return []

    @abc.abstractmethod
    async def running_versions(self) -> dict[int, int]:
        """The running prompts of every replica by the version they were admitted at (versions with none
        left out)."""

    @abc.abstractmethod
    async def size(self) -> int:
        """How many prompts are upcoming."""

    async def close(self) -> None:
        return None


class MemoryPromptQueue(PromptQueue):
    def __init__(self) -> None:
        self._upcoming: deque[JobRequest] = deque()
        self._running: dict[str, tuple[int, JobRequest]] = {}  # job id -> (version admitted at, the prompt)
        self._versions: Counter[int] = Counter()

    async def push(self, requests: list[JobRequest]) -> int:
        self._upcoming.extend(with_job_id(r) for r in requests)
        return len(self._upcoming)

    async def pop(self, version: int, fence: AdmissionFence | None = None) -> JobRequest | None:
        check_fence(self, fence)
        if not self._upcoming:
            return None
        request = self._upcoming.popleft()
        if request.job_id not in self._running:  # pushed twice (a retried push): one run, counted where it began
            self._running[request.job_id] = (version, request)
            self._versions[version] += 1
        return request

    async def done(self, job_id: str) -> None:
        version, _ = self._running.pop(job_id, (None, None))
        if version is not None:
            self._versions[version] -= 1
            if not self._versions[version]:
                del self._versions[version]

    async def running_versions(self) -> dict[int, int]:
        return dict(sorted(self._versions.items()))

    async def recover(self) -> list[JobRequest]:
        return [request for _, request in self._running.values()]

    async def size(self) -> int:
        return len(self._upcoming)
