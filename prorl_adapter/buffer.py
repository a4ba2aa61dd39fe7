"""The experience buffer between the rollout service (producer) and the trainer (consumer).

The rollout service `put`s every finished trajectory; the trainer `take`s batches, trains on them and then
`ack`s them. Until it is acknowledged a taken entry is *pending*: a trainer that crashes between take and ack
loses nothing, because `reclaim(idle_s)` hands entries pending for at least `idle_s` seconds back to the queue
(the next `take` delivers them again, with a higher delivery count), and `release(ids)` does the same for
exactly the entries given (the caller knows their lease expired). Delivery is therefore at least once: a
trainer slower than `idle_s` may see an entry twice, and `BufferedTrajectory.deliveries > 1` says so.

Order ("prioritised by recency and policy version"): entries of the newest policy version first, where an
entry's version is `trajectory.policy_version_min` (the version of its oldest turn, the one staleness is
measured from). Within one version the oldest entry comes first (FIFO). All entries of one version have the
same staleness, so serving the newest of them first would buy no freshness, while FIFO bounds how long an
entry waits among its peers (newest-first would starve the early ones of a version for as long as the
producer keeps adding to it). Entries handed back by `reclaim` or `release` keep their original place.
Entries of older versions wait while newer ones keep coming: that is the point (fresher data first), and two
things keep it bounded. Pacing: `version_counts()` (the entries per version, in O(versions); or
`buffered_versions()`, the same as one version per entry) feeds `AdmissionState.buffered`, so
admission control stops new episodes before the buffer holds data staler than the trainer accepts. And
`expire(before_version)` removes the ready entries of older versions for good (counted in `stats().expired`):
too stale to train on, newest-first takes would never reach them, and they would pile up without bound.

`take(n, timeout)` waits until n entries are ready or the timeout passes, then returns what there is (up to
n, possibly fewer, possibly none). `timeout=None` waits for all n; `timeout=0` never waits.

Backends: `MemoryBuffer` (here; the default, one process, asyncio) and `RedisBuffer`
(`prorl_adapter.buffer_redis`: Redis Streams with a consumer group, shared by processes and machines,
surviving a trainer crash). `prorl_adapter.storage.open_storage(url)` picks one from a URL.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .models import Trajectory


class ExperienceBufferError(Exception):
    """Base class of the buffer's errors."""


class BufferClosed(ExperienceBufferError):
    """The buffer was closed; raised by every call after `close()`, and by calls waiting when it happened."""


class BufferUnavailable(ExperienceBufferError):
    """The buffer's storage cannot be reached (e.g. Redis is down). The message names where and what failed.

    Nothing acknowledged is lost and nothing pending is dropped by the error itself; the same buffer object
    works again once the storage is back."""

    status = 503  # what the service's API answers with: try again later


class MalformedEntryId(ExperienceBufferError, ValueError):
    """An entry id that this buffer never hands out (a client's mistake: the API answers 400)."""

    status = 400


@dataclass(frozen=True)
class BufferedTrajectory:
    """One delivered entry: `id` is what `ack` takes; `deliveries` counts deliveries, 1 the first time."""

    id: str
    trajectory: Trajectory
    deliveries: int = 1

    @property
    def version(self) -> int:
        return self.trajectory.policy_version_min


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
    async def take(self, n: int, timeout: float | None = None) -> list[BufferedTrajectory]:
        """Wait until `n` entries are ready or `timeout` seconds pass, then return up to `n` of them, in
        priority order (newest version first, FIFO within a version). They stay pending until `ack`ed.
        `timeout=None` waits for all `n`; `timeout=0` returns at once with what is ready."""

    @abc.abstractmethod
    async def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge taken entries (the trainer consumed them): they leave the buffer for good. Returns how
        many were acknowledged now; ids already acknowledged, unknown or never taken count 0."""

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


def _check_n(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"take(n): n must be a positive integer, got {n!r}")


def _check_trajectory(trajectory: Any) -> None:
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"put() takes a Trajectory, got {type(trajectory).__name__}")


def _id_list(ids: Iterable[str]) -> list[str]:
    return [ids] if isinstance(ids, str) else list(ids)  # one id alone is a string, not its characters


@dataclass(eq=False)
class _Entry:
    id: str
    seq: int
    trajectory: Trajectory
    deliveries: int = 0
    taken_at: float | None = None  # set while pending

    @property
    def version(self) -> int:
        return self.trajectory.policy_version_min

    @property
    def key(self) -> tuple[int, int, str]:  # heap order: newest version first, then FIFO
        return (-self.version, self.seq, self.id)


class MemoryBuffer(ExperienceBuffer):
    """The in-process buffer (the default): asyncio, no busy waiting, no threads; not shared by processes.

    `max_size` bounds the unconsumed entries (ready + pending: a taken entry holds memory until it is
    acknowledged). When the buffer is full, `put` waits for room (backpressure on the rollout service) rather
    than raising: an episode already paid for is never thrown away, and the producer slows to the trainer's
    pace. Only `ack` and `expire` make room; `take` alone does not.

    `clock` (seconds, monotonic) measures how long entries are pending, for `reclaim`; tests inject one.
    The buffer keeps the trajectory objects it is given (no copy): do not change one after `put`.
    """

    def __init__(self, max_size: int | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_size is not None and (not isinstance(max_size, int) or max_size < 1):
            raise ValueError(f"max_size must be a positive integer or None, got {max_size!r}")
        self.max_size = max_size
        self._clock = clock
        self._entries: dict[str, _Entry] = {}  # every unconsumed entry: ready or pending
        self._pending: dict[str, _Entry] = {}
        self._ready: list[tuple[int, int, str]] = []  # heap of _Entry.key; stale keys (acked, expired) are skipped
        # The ready ids again, by version, so that `expire` finds the old ones without looking at the others;
        # `_ready_versions` holds its keys, ascending.
        self._ready_by_version: dict[int, set[str]] = {}
        self._ready_versions: list[int] = []
        self._counts: dict[int, int] = {}  # unconsumed entries per version, kept as they change: for pacing
        self._seq = itertools.count(1)
        self._acked = 0
        self._expired = 0
        self._closed = False
        self._cond = asyncio.Condition()

    def _ready_count(self) -> int:
        return len(self._entries) - len(self._pending)

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosed("the experience buffer is closed")

    def _mark_ready(self, entry: _Entry) -> None:
        ids = self._ready_by_version.get(entry.version)
        if ids is None:
            ids = self._ready_by_version[entry.version] = set()
            bisect.insort(self._ready_versions, entry.version)
        ids.add(entry.id)
        heapq.heappush(self._ready, entry.key)

    def _unmark_ready(self, entry: _Entry) -> None:  # its heap key stays, skipped when popped
        ids = self._ready_by_version[entry.version]
        ids.remove(entry.id)
        if not ids:
            del self._ready_by_version[entry.version]
            self._ready_versions.remove(entry.version)

    def _count(self, version: int, delta: int) -> None:
        left = self._counts.get(version, 0) + delta
        if left:
            self._counts[version] = left
        else:
            del self._counts[version]

    async def put(self, trajectory: Trajectory) -> str:
        _check_trajectory(trajectory)
        async with self._cond:
            self._check_open()
            if self.max_size is not None:
                await self._cond.wait_for(lambda: self._closed or len(self._entries) < self.max_size)
                self._check_open()
            seq = next(self._seq)
            entry = _Entry(f"m{seq}", seq, trajectory)
            self._entries[entry.id] = entry
            self._mark_ready(entry)
            self._count(entry.version, 1)
            self._cond.notify_all()
            return entry.id

    async def take(self, n: int, timeout: float | None = None) -> list[BufferedTrajectory]:
        _check_n(n)
        async with self._cond:
            self._check_open()

            def enough() -> bool:
                return self._closed or self._ready_count() >= n

            if timeout is None:
                await self._cond.wait_for(enough)
            elif timeout > 0 and not enough():
                with contextlib.suppress(asyncio.TimeoutError):  # then return what there is
                    await asyncio.wait_for(self._cond.wait_for(enough), timeout)
            self._check_open()
            return self._pop(n)

    def _pop(self, n: int) -> list[BufferedTrajectory]:
        out: list[BufferedTrajectory] = []
        now = self._clock()
        while self._ready and len(out) < n:
            _, _, entry_id = heapq.heappop(self._ready)
            entry = self._entries.get(entry_id)
            if entry is None or entry_id in self._pending:
                continue  # acknowledged while it waited (after a reclaim) or expired
            self._unmark_ready(entry)
            entry.deliveries += 1
            entry.taken_at = now
            self._pending[entry_id] = entry
            out.append(BufferedTrajectory(entry.id, entry.trajectory, entry.deliveries))
        return out

    async def ack(self, ids: Iterable[str]) -> int:
        ids = _id_list(ids)
        async with self._cond:
            self._check_open()
            done = 0
            for entry_id in ids:
                entry = self._entries.get(entry_id)
                # Pending, or handed back after a delivery (its slow consumer did consume it).
                if entry is None or entry.deliveries == 0:
                    continue
                del self._entries[entry_id]
                if self._pending.pop(entry_id, None) is None:
                    self._unmark_ready(entry)
                self._count(entry.version, -1)
                done += 1
            self._acked += done
            if done:
                self._cond.notify_all()  # room for waiting puts
            return done

    async def reclaim(self, idle_s: float) -> int:
        async with self._cond:
            self._check_open()
            now = self._clock()
            stale = [e for e in self._pending.values() if e.taken_at is not None and now - e.taken_at >= idle_s]
            return self._hand_back(stale)

    async def release(self, ids: Iterable[str]) -> int:
        ids = _id_list(ids)
        async with self._cond:
            self._check_open()
            pending = {entry_id: self._pending[entry_id] for entry_id in ids if entry_id in self._pending}
            return self._hand_back(list(pending.values()))

    def _hand_back(self, entries: list[_Entry]) -> int:
        for entry in entries:
            del self._pending[entry.id]
            entry.taken_at = None
            self._mark_ready(entry)  # back in its original place: the key orders by version and put order
        if entries:
            self._cond.notify_all()
        return len(entries)

    async def expire(self, before_version: int) -> int:
        async with self._cond:
            self._check_open()
            cut = bisect.bisect_left(self._ready_versions, before_version)
            old = self._ready_versions[:cut]
            del self._ready_versions[:cut]
            removed = 0
            for version in old:
                ids = self._ready_by_version.pop(version)
                for entry_id in ids:
                    del self._entries[entry_id]
                self._count(version, -len(ids))
                removed += len(ids)
            if removed:
                self._expired += removed
                self._compact_ready()
                self._cond.notify_all()  # room for waiting puts
            return removed

    def _compact_ready(self) -> None:
        # Keys of removed entries are skipped when popped, but expired ones are the oldest, at the bottom of a
        # newest-first heap, and might never be popped. Rebuilding once they are the majority costs O(1)
        # amortised per removed entry.
        if len(self._ready) > 2 * self._ready_count():
            self._ready = [k for k in self._ready if k[2] in self._entries and k[2] not in self._pending]
            heapq.heapify(self._ready)

    async def version_counts(self) -> dict[int, int]:
        self._check_open()
        return dict(sorted(self._counts.items()))

    async def stats(self) -> BufferStats:
        self._check_open()
        return BufferStats(
            ready=self._ready_count(), pending=len(self._pending), acked=self._acked, expired=self._expired
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._cond:
            self._cond.notify_all()  # waiting take/put raise BufferClosed
