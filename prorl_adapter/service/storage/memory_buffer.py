"""The in-process experience buffer (the default): asyncio, one process. The contract is `buffer.ExperienceBuffer`."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...models import BatchItem, Trajectory
from .buffer import (
    BufferClosed,
    BufferStats,
    ExperienceBuffer,
    MalformedEntryId,
    check_n,
    check_order,
    check_trajectory,
    id_list,
)


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

    @property
    def oldest_key(self) -> tuple[int, int, str]:  # heap order: oldest version first, then FIFO
        return (self.version, self.seq, self.id)


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
        # The ready entries once per take order: heaps of _Entry.key (newest first) and _Entry.oldest_key. Stale
        # keys (of entries acknowledged, expired, or taken through the other heap) are skipped when popped.
        self._ready: list[tuple[int, int, str]] = []
        self._ready_oldest: list[tuple[int, int, str]] = []
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
        heapq.heappush(self._ready_oldest, entry.oldest_key)

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
        [entry_id] = await self.put_many([trajectory])
        return entry_id

    async def put_many(self, trajectories: list[Trajectory]) -> list[str]:
        for trajectory in trajectories:
            check_trajectory(trajectory)
        n = len(trajectories)
        if self.max_size is not None and n > self.max_size:
            raise ValueError(f"{n} trajectories cannot fit a buffer of at most {self.max_size} entries")
        async with self._cond:
            self._check_open()
            if self.max_size is not None:  # room for all of them at once: none goes in before the others
                await self._cond.wait_for(lambda: self._closed or len(self._entries) + n <= self.max_size)
                self._check_open()
            ids = []
            for trajectory in trajectories:
                seq = next(self._seq)
                entry = _Entry(f"m{seq}", seq, trajectory)
                self._entries[entry.id] = entry
                self._mark_ready(entry)
                self._count(entry.version, 1)
                ids.append(entry.id)
            self._cond.notify_all()
            return ids

    async def take(self, n: int, timeout: float | None = None, order: str = "newest") -> list[BatchItem]:
        check_n(n)
        check_order(order)
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
            return self._pop(n, self._ready if order == "newest" else self._ready_oldest)

    def _pop(self, n: int, heap: list[tuple[int, int, str]]) -> list[BatchItem]:
        out: list[BatchItem] = []
        now = self._clock()
        while heap and len(out) < n:
            _, _, entry_id = heapq.heappop(heap)
            entry = self._entries.get(entry_id)
            if entry is None or entry_id in self._pending:
                continue  # acknowledged while it waited (after a reclaim) or expired
            self._unmark_ready(entry)
            entry.deliveries += 1
            entry.taken_at = now
            self._pending[entry_id] = entry
            out.append(BatchItem(id=entry.id, trajectory=entry.trajectory, deliveries=entry.deliveries))
        self._compact_ready()  # what was taken left its keys in the other heap
        return out

    async def ack(self, ids: Iterable[str]) -> int:
        ids = _checked_ids(ids)
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
        ids = _checked_ids(ids)
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
        # Keys of removed entries are skipped when popped, but some might never be popped: expired ones are the
        # oldest, at the bottom of the newest-first heap, and the keys of entries taken in one order stay in the
        # other order's heap. Rebuilding a heap once they are the majority (a set: an entry handed back has its
        # key twice) costs O(1) amortised per stale key.
        limit = 2 * self._ready_count() + 16
        if len(self._ready) > limit:
            self._ready = self._fresh(self._ready)
        if len(self._ready_oldest) > limit:
            self._ready_oldest = self._fresh(self._ready_oldest)

    def _fresh(self, heap: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
        fresh = list({k for k in heap if k[2] in self._entries and k[2] not in self._pending})
        heapq.heapify(fresh)
        return fresh

    async def version_counts(self) -> dict[int, int]:
        self._check_open()
        return dict(sorted(self._counts.items()))

    async def ready_counts(self) -> dict[int, int]:
        self._check_open()
        return {version: len(self._ready_by_version[version]) for version in self._ready_versions}

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


_ENTRY_ID = re.compile(r"m[0-9]{1,20}")  # what `put` hands out: m<sequence number>


def _checked_ids(ids: Iterable[str]) -> list[str]:
    """The ids, each of the form this buffer hands out: another is a client's mistake (400), not an entry that
    was acknowledged already (which counts 0), as in the Redis buffer."""
    ids = id_list(ids)
    for entry_id in ids:
        if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id):
            shown = str(entry_id) if len(str(entry_id)) <= 80 else f"{str(entry_id)[:80]}..."
            raise MalformedEntryId(f"not an entry id of this buffer: {shown!r} (expected m<number>)")
    return ids
