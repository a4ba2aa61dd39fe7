"""The queue of upcoming prompts of decoupled mode, and the record of the ones admitted but not yet delivered.

A prompt moves `push` -> upcoming -> `pop` (admitted: it now runs as a job, under its job id) -> running ->
`done` (its trajectory is in the experience buffer, or it failed and was counted). What is running when the
service dies is handed back by `recover` to the next incarnation, which runs it again: with a queue that
outlives the process (`prompts_redis.RedisPromptQueue`), every prompt enqueued is delivered at least once.
`MemoryPromptQueue` (the default, with the memory buffer) lives and dies with the process, like that buffer.
"""

from __future__ import annotations

import abc
import uuid
from collections import deque

from ...models import JobRequest


def with_job_id(request: JobRequest) -> JobRequest:
    """The request with a job id: it names the prompt while it runs, and again if it must run again."""
    return request if request.job_id else request.model_copy(update={"job_id": uuid.uuid4().hex})


class PromptQueue(abc.ABC):
    @abc.abstractmethod
    async def push(self, requests: list[JobRequest]) -> int:
        """Append prompts (each given a job id if it has none); returns how many are upcoming now."""

    @abc.abstractmethod
    async def pop(self) -> JobRequest | None:
        """The next upcoming prompt, now recorded as running; None when there is none."""

    @abc.abstractmethod
    async def done(self, job_id: str) -> None:
        """The prompt's trajectory was delivered (or its failure counted): forget it."""

    @abc.abstractmethod
    async def recover(self) -> list[JobRequest]:
        """Every prompt recorded as running (popped, not yet done): what an earlier incarnation of the service
        left, or one whose pop reply was lost; the producer runs again those it is not running."""

    @abc.abstractmethod
    async def size(self) -> int:
        """How many prompts are upcoming."""

    async def close(self) -> None:
        return None


class MemoryPromptQueue(PromptQueue):
    def __init__(self) -> None:
        self._upcoming: deque[JobRequest] = deque()

    async def push(self, requests: list[JobRequest]) -> int:
        self._upcoming.extend(with_job_id(r) for r in requests)
        return len(self._upcoming)

    async def pop(self) -> JobRequest | None:
        return self._upcoming.popleft() if self._upcoming else None

    async def done(self, job_id: str) -> None:
        return None

    async def recover(self) -> list[JobRequest]:
        return []  # nothing of an earlier process survives in memory

    async def size(self) -> int:
        return len(self._upcoming)
