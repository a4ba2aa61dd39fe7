"""The queue of upcoming prompts of decoupled mode, and the record of the ones admitted but not yet delivered.

A prompt moves `push` -> upcoming -> `pop` (admitted by one replica, at a policy version: it now runs as a job,
under its job id) -> running -> `done` (its trajectory is in the experience buffer, or it failed and was
counted). What a replica was running when it died is handed back by `recover` to its next incarnation (same
id), or by `take_over` to the replica that takes over for it, which runs it again: with a queue that outlives
the process (`redis_prompts.RedisPromptQueue`), every prompt enqueued is delivered at least once.
`running_versions` counts the running prompts of every replica by the version they were admitted at: what
admission control weighs. `MemoryPromptQueue` (the default, with the memory buffer) lives and dies with the
process, like that buffer.
"""

from __future__ import annotations

import abc
import uuid
from collections import Counter, deque

from ...models import JobRequest


def with_job_id(request: JobRequest) -> JobRequest:
    """The request with a job id: it names the prompt while it runs, and again if it must run again."""
    return request if request.job_id else request.model_copy(update={"job_id": uuid.uuid4().hex})


class PromptQueue(abc.ABC):
    @abc.abstractmethod
    async def push(self, requests: list[JobRequest]) -> int:
        """Append prompts (each given a job id if it has none); returns how many are upcoming now."""

    @abc.abstractmethod
    async def pop(self, version: int) -> JobRequest | None:
        """The next upcoming prompt, now recorded as running here, admitted at `version`; None when there is
        none."""

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

    async def pop(self, version: int) -> JobRequest | None:
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
