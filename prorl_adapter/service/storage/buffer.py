"""The experience buffer between the rollout service (producer) and the trainer (consumer).

The rollout service `put`s every finished trajectory; the trainer `take`s batches, trains on them and then
`ack`s them. Until it is acknowledged a taken entry is *pending*: a trainer that crashes between take and ack
loses nothing, because `reclaim(idle_s)` hands entries pending for at least `idle_s` seconds back to the queue
(the next `take` delivers them again, with a higher delivery count), and `release(ids)` does the same for
exactly the entries given (the caller knows their lease expired). Delivery is therefore at least once: a
trainer slower than `idle_s` may see an entry twice, and `BatchItem.deliveries > 1` says so.

Order ("prioritised by recency and policy version"), chosen per take (`order`), where an entry's version is
`trajectory.policy_version_min` (the version of its oldest turn, the one staleness is measured from):
- `"newest"` (the default): entries of the newest policy version first. Entries of older versions wait while
  newer ones keep coming: that is the point (fresher data first), and two things keep it bounded. Pacing:
  `version_counts()` (the entries per version, in O(versions); or `buffered_versions()`, the same as one
  version per entry) feeds `AdmissionState.buffered`, so admission control stops new episodes before the buffer
  holds data staler than the trainer accepts. And `expire(before_version)` removes the ready entries of older
  versions for good (counted in `stats().expired`): too stale to train on, newest-first takes would never reach
  them, and they would pile up without bound.
- `"oldest"`: entries of the oldest policy version first, the order a take that serves deadlines needs (pace's
  `deadline-take` rule: the producer takes this way when a plugin answers `prorl_take_demands`).
Within one version the oldest entry comes first (FIFO), in both orders. All entries of one version have the
same staleness, so serving the newest of them first would buy no freshness, while FIFO bounds how long an
entry waits among its peers (newest-first would starve the early ones of a version for as long as the
producer keeps adding to it). Entries handed back by `reclaim` or `release` keep their original place.
`ready_counts()` says what a take could have now, per version.

`take(n, timeout, order)` waits until n entries are ready or the timeout passes, then returns what there is (up
to n, possibly fewer, possibly none). `timeout=None` waits for all n; `timeout=0` never waits.

Backends: `MemoryBuffer` (here; the default, one process, asyncio) and `RedisBuffer`
(`prorl_adapter.buffer_redis`: Redis Streams with a consumer group, shared by processes and machines,
surviving a trainer crash). `prorl_adapter.storage.open_storage(url)` picks one from a URL.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from server_kit.errors import ApiError, DownstreamError, ProrlError

from ...models import BatchItem, Trajectory


class ExperienceBufferError(ProrlError):
    """Base class of the buffer's errors."""


class BufferClosed(ExperienceBufferError):
    """The buffer was closed; raised by every call after `close()`, and by calls waiting when it happened."""


class BufferUnavailable(ExperienceBufferError, DownstreamError):
    """The buffer's storage cannot be reached (e.g. Redis is down). The message names where and what failed.

    Nothing acknowledged is lost and nothing pending is dropped by the error itself; the same buffer object
    works again once the storage is back."""

    answer_status = 503  # what the service's API answers with: try again later


class MalformedEntryId(ExperienceBufferError, ApiError, ValueError):
    """An entry id that this buffer never hands out (a client's mistake: the API answers 400)."""

    status = 400


@dataclass(frozen=True)
class BufferStats:
    """`ready`: waiting to be taken; `pending`: taken, not yet acknowledged; `acked`: acknowledged in total;
    `expired`: removed by `expire` in total."""

    ready: int
    pending: int
    acked: int
    expired: int = 0

    @property
    def unconsumed(self) -> int:
        return self.ready + self.pending


class ExperienceBuffer(abc.ABC):
    """The buffer's contract; every method is a coroutine. Use as `async with` to close it at the end."""

    @abc.abstractmethod
    async def put(self, trajectory: Trajectory) -> str:
        """Add one trajectory; returns its entry id."""

    @abc.abstractmethod
    async def put_many(self, trajectories: list[Trajectory]) -> list[str]:
        """Add all the trajectories or none (an import: never half of it); returns their entry ids, in order."""

    @abc.abstractmethod
    async def take(self, n: int, timeout: float | None = None, order: str = "newest") -> list[BatchItem]:
        """Wait until `n` entries are ready or `timeout` seconds pass, then return up to `n` of them, in
        `order` (`"newest"`: newest version first; `"oldest"`: oldest version first; FIFO within a version
        either way). They stay pending until `ack`ed. `timeout=None` waits for all `n`; `timeout=0` returns at
        once with what is ready. The wait is for `n` ready at once: among takes of fewer, a large take may wait
        for its timeout."""

    @abc.abstractmethod
    async def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge taken entries (the trainer consumed them): they leave the buffer for good. Returns how
        many were acknowledged now; ids of this buffer's form already acknowledged, unknown or never taken count
        0, and an id of another form is refused (`MalformedEntryId`, nothing of the call done)."""

    @abc.abstractmethod
    async def reclaim(self, idle_s: float) -> int:
        """Hand back to the queue every entry taken but not acknowledged for at least `idle_s` seconds (its
        consumer crashed or hangs). Returns how many were handed back."""

    @abc.abstractmethod
    async def release(self, ids: Iterable[str]) -> int:
        """Hand exactly these pending entries back to the queue (the caller knows their lease expired), like
        `reclaim`: they keep their original place, and the next `take` delivers them with `deliveries` one
        higher. Returns how many were handed back; ids not pending (unknown, never taken, acknowledged,
        already handed back) count 0."""

    async def take_over(self, consumer: str) -> int:
        """Hand back to the queue the entries consumer `consumer` (a dead replica of the service, or this one's
        earlier incarnation) took and never acknowledged; returns how many. A buffer of one process has no other
        consumer: 0."""
        return 0

    @abc.abstractmethod
    async def expire(self, before_version: int) -> int:
        """Remove for good every ready entry (not pending) whose `policy_version_min` is below
        `before_version`: too stale to train on. Pending entries stay for their consumer to acknowledge; if
        handed back, a later `expire` removes them. Returns how many were removed now; `stats().expired`
        counts them all."""

    @abc.abstractmethod
    async def version_counts(self) -> dict[int, int]:
        """The number of unconsumed entries (ready and pending) per `policy_version_min`, by ascending
        version, versions without any left out: for pacing, without a list item per entry."""

    @abc.abstractmethod
    async def ready_counts(self) -> dict[int, int]:
        """The number of ready entries (not pending: what a `take` could have now) per `policy_version_min`,
        by ascending version, versions without any left out."""

    async def buffered_versions(self) -> list[int]:
        """`policy_version_min` of every unconsumed entry (ready and pending), ascending: `version_counts()`
        as one item per entry."""
        counts = await self.version_counts()
        return [version for version, count in counts.items() for _ in range(count)]

    @abc.abstractmethod
    async def stats(self) -> BufferStats:
        """Counts of ready, pending, acknowledged and expired entries."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the buffer; later calls raise `BufferClosed`. Idempotent."""

    async def __aenter__(self) -> ExperienceBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_n(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"take(n): n must be a positive integer, got {n!r}")


ORDERS = ("newest", "oldest")


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"take(order): order must be one of {', '.join(ORDERS)}, got {order!r}")


def check_trajectory(trajectory: Any) -> None:
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"put() takes a Trajectory, got {type(trajectory).__name__}")


def id_list(ids: Iterable[str]) -> list[str]:
    return [ids] if isinstance(ids, str) else list(ids)  # one id alone is a string, not its characters
