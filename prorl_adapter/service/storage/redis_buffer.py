"""The experience buffer on Redis Streams: shared by processes and machines, and a trainer crash loses nothing.

Layout (every key starts with `prefix`, default `prorl:buffer`; one consumer group per prefix):

- `{prefix}:v{version}`: one stream per policy version (`trajectory.policy_version_min`); each entry holds one
  trajectory as JSON (field `t`). Consumer group `group` (default `trainer`) is created with the stream.
  A stream holds exactly the unconsumed entries of its version: ready ones (not yet delivered to the group)
  and pending ones (delivered, in the group's pending entries list, not yet acknowledged).
- `{prefix}:versions`: a sorted set of the versions that have a stream (score = version).
- `{prefix}:events`: a short stream (capped at ~1000) that every `put`, `reclaim` and `release` appends to, only
  to wake consumers blocked in `take` (one `XREAD BLOCK` covers every version, including versions not seen yet).
- `{prefix}:acked`, `{prefix}:expired`: the numbers of entries acknowledged and expired, for `stats`.

Operations (each multi-key step is one Lua script, so it is atomic):

- `put`: `XADD` to the version's stream, create the group on it (id 0: it sees every entry), register the
  version, append a wake-up event.
- `take(n, timeout, order)`: counts what is ready; while fewer than n are, blocks on the events stream (from
  the last event id read *before* counting, so no wake-up is missed) until a `put` or the timeout, and counts
  again; then reads, for each version, newest first (`order="oldest"`: oldest first): this consumer's
  reclaimed entries of that version (see `reclaim`), then `XREADGROUP ... >` (new entries, oldest first),
  until n are found (`timeout=0`: one look, what there is). Nothing is taken while it waits, so a waiting take
  holds no entry from other consumers. Another consumer may take some between the count and the read: what was
  read then stays taken while the take waits for the rest, and the batch is put in `order` at the end. Entries
  read are pending for this consumer at once, so if the caller is cancelled or Redis fails mid-take, they are
  not lost: `reclaim` recovers them. Like the memory buffer, a take of n waits until n are ready at once: a
  large take among small ones may wait for its timeout.
- `ack(ids)`: `XACK` and then `XDEL` in one script; the entry leaves Redis for good. When a version's
  stream is empty it is deleted and the version unregistered, in the same script (a concurrent `put` is
  either before, and the stream is not empty, or after, and recreates both).
- `reclaim(idle_s)`: `XAUTOCLAIM` (min idle `idle_s`) over every version: entries pending for another
  (crashed) consumer, or for this one, move to this consumer. They are remembered by this object and served
  by its next `take` in their original place (before the new entries of their version). A Redis stream has
  no way to put a delivered entry back among the undelivered ones; claiming it is the standard pattern,
  and nothing is lost if this consumer crashes too: the entries are in its pending list, and the next
  `reclaim` by anyone finds them. When served, an entry is claimed once more (`XCLAIM`, which resets its
  idle time and counts a delivery) only if it is still pending for this consumer, so an entry that its slow
  first consumer acknowledged meanwhile is not delivered again.
- `release(ids)`: `reclaim` for exactly these ids. This object is the buffer's one consumer (the service), so
  an entry whose lease expired is still pending for it: a script checks with `XPENDING` which of the ids are
  (one call per version), and those are remembered and served by the next `take` as reclaimed ones are.
- `expire(before_version)`: one script per registered version below `before_version` deletes the stream's
  ready entries: those not in the group's pending list (never delivered; the whole stream at once when
  nothing is pending) and those this object holds as reclaimed or released (`XACK` first). It counts them
  in `{prefix}:expired` and, when the stream is left empty, deletes it and unregisters the version (as `ack`).
- `version_counts()`: each registered version with its stream's length (`XLEN`, one pipeline);
  `buffered_versions()` expands it.
- `stats()`: ready = `XLEN` - pending; pending from `XPENDING`; this object's reclaimed-but-not-served
  entries count as ready (as with `MemoryBuffer`), although Redis holds them as pending. `ready_counts()`: the
  same, per version (one pipeline).

Delivery is at least once (as with every buffer here): besides a slow consumer overtaken by `reclaim`, a
command retried after a connection error may have run twice (a `put` stored twice, an entry read but its
reply lost: pending, so `reclaim` hands it out again).

Failures: a Redis that cannot be reached raises `BufferUnavailable`, whose message names the Redis URL
(password hidden) and the operation that failed; a command Redis refuses raises `ExperienceBufferError`.
The client reconnects on the next call, so the same object works again once Redis is back. Durability is
Redis's own: run it with `appendonly yes` (and `appendfsync always` or `everysec`) for trajectories to
survive a Redis restart. Unlike `MemoryBuffer`, there is no `max_size`: bound the buffer by pacing (the
versions in `version_counts` feed admission control) and `expire`, and give Redis a `maxmemory` with
`noeviction`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterable
from functools import partial
from typing import Any

from pydantic import ValidationError

from ...models import BatchItem, Trajectory
from .buffer import (
    BufferStats,
    BufferUnavailable,
    ExperienceBuffer,
    ExperienceBufferError,
    MalformedEntryId,
    check_n,
    check_order,
    check_trajectory,
    id_list,
)
from .redis_connection import RedisConnection, default_consumer_name, redis_errors

_PUT = """
-- KEYS: the version's stream, the version registry, the events stream; ARGV: version, trajectory JSON, group
local id = redis.call('XADD', KEYS[1], '*', 't', ARGV[2])
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[3], '0')  -- BUSYGROUP when it exists: fine
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', '1000', '*', 'put', ARGV[1])
return id
"""

# The end of a script that removed `n` entries of a version's stream (KEYS[1]): an empty stream is deleted and
# its version (ARGV[1]) unregistered from KEYS[2] in the same step; `n` is added to the counter KEYS[3].
_RETIRE = """
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
if n > 0 then redis.call('INCRBY', KEYS[3], n) end
return n
"""

_ACK = (
    """
-- KEYS: the version's stream, the version registry, the acked counter; ARGV: version, group, stream ids...
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = 0
for i = 3, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[2], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
"""
    + _RETIRE
)

_RECLAIM = """
-- KEYS: the version's stream; ARGV: group, consumer, min idle ms. Returns the ids claimed.
local ids = {}
if redis.call('EXISTS', KEYS[1]) == 0 then return ids end
local cursor = '0-0'
repeat
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], cursor, 'COUNT', 1000, 'JUSTID')
  cursor = r[1]
  for _, id in ipairs(r[2]) do ids[#ids + 1] = id end
until cursor == '0-0'
return ids
"""

_SERVE_RECLAIMED = """
-- KEYS: the version's stream; ARGV: group, consumer, stream ids... Returns {id, fields, deliveries} for each
-- id still pending for this consumer (claimed again: idle time reset, delivery counted).
local out = {}
if redis.call('EXISTS', KEYS[1]) == 0 then return out end
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    local e = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i])
    if #e == 1 and e[1] then
      local q = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
      out[#out + 1] = {e[1][1], e[1][2], q[1][4]}
    end
  end
end
return out
"""

_TAKE_OVER = """
-- KEYS: the version's stream; ARGV: group, a dead consumer, this consumer. Moves the dead one's pending entries
-- here (JUSTID: not counted as a delivery, which serving them counts); returns their ids.
local ids = {}
if redis.call('EXISTS', KEYS[1]) == 0 then return ids end
for _, entry in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000000, ARGV[2])) do
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, entry[1], 'JUSTID')
  ids[#ids + 1] = entry[1]
end
return ids
"""

_PENDING_HERE = """
-- KEYS: the version's stream; ARGV: group, consumer, stream ids... Returns those pending for this consumer.
local out = {}
if redis.call('EXISTS', KEYS[1]) == 0 then return out end
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then out[#out + 1] = ARGV[i] end
end
return out
"""

_EXPIRE = (
    """
-- KEYS: the version's stream, the version registry, the expired counter; ARGV: version, group, consumer,
-- the stream ids this consumer holds as reclaimed or released... Deletes the ready entries: those not in the
-- group's pending list, and those of the given ids still pending for this consumer. Returns how many.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local owner = {}  -- stream id -> consumer, of the pending entries: they stay
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[2])  -- no group: nothing is pending
if summary.err == nil and summary[1] > 0 then
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[2], '-', '+', summary[1])) do owner[p[1]] = p[2] end
end
for i = 4, #ARGV do
  if owner[ARGV[i]] == ARGV[3] then
    redis.call('XACK', KEYS[1], ARGV[2], ARGV[i])
    owner[ARGV[i]] = nil
  end
end
local n = 0
if next(owner) == nil then
  n = redis.call('XLEN', KEYS[1])
  redis.call('DEL', KEYS[1])
else
  -- In slices: an entry holds a whole trajectory, and XRANGE has no way to return ids alone.
  local from = '-'
  repeat
    local slice = redis.call('XRANGE', KEYS[1], from, '+', 'COUNT', 100)
    local ready = {}
    for _, e in ipairs(slice) do
      if owner[e[1]] == nil then ready[#ready + 1] = e[1] end
    end
    if #ready > 0 then n = n + redis.call('XDEL', KEYS[1], unpack(ready)) end
    if #slice > 0 then from = '(' .. slice[#slice][1] end
  until #slice < 100
end
"""
    + _RETIRE
)

# An entry id as `_entry_id` writes it: VERSION:MS-SEQ, ASCII digits only (Redis refuses others, and `\d` alone
# would let other scripts' digits through), each part of a stream id below 2**64 (Redis's own bound), and not so
# long that int() refuses the version (Python converts at most 4300 digits).
_ENTRY_ID = re.compile(r"(-?[0-9]+):([0-9]{1,20})-([0-9]{1,20})")
_U64 = 2**64
_MAX_ID_CHARS = 4096


def _sid_key(sid: str) -> tuple[int, int]:
    ms, seq = sid.split("-")
    return int(ms), int(seq)


class RedisBuffer(ExperienceBuffer):
    """`ExperienceBuffer` on Redis Streams; see the module's docstring for the design.

    `url`: e.g. `redis://127.0.0.1:6379/0` (`rediss://` for TLS, `unix:///path.sock`). `prefix`: the keys'
    namespace (one buffer per prefix). `group`: the consumer group, the same for every trainer process of
    one buffer. `consumer`: this object's name in the group (default: host-pid-random); a restarted trainer
    may reuse its name, and its `reclaim` then finds its own old pending entries too. `socket_timeout`:
    seconds before a silent Redis counts as unavailable (a blocked `take` waits in slices shorter than this).
    `retries`: how often a command is retried after a connection error (with a short backoff) before
    `BufferUnavailable` is raised.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "prorl:buffer",
        group: str = "trainer",
        consumer: str | None = None,
        socket_timeout: float = 5.0,
        retries: int = 2,
        **redis_kwargs: Any,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self._block_s = max(0.05, socket_timeout / 2)
        self._connection = RedisConnection(url, socket_timeout=socket_timeout, retries=retries, **redis_kwargs)
        self._where = self._connection.where
        self._redis = self._connection.redis
        self._put = self._redis.register_script(_PUT)
        self._ack = self._redis.register_script(_ACK)
        self._reclaim = self._redis.register_script(_RECLAIM)
        self._serve = self._redis.register_script(_SERVE_RECLAIMED)
        self._pending_here = self._redis.register_script(_PENDING_HERE)
        self._take_over = self._redis.register_script(_TAKE_OVER)
        self._expire = self._redis.register_script(_EXPIRE)
        # version -> stream ids claimed by reclaim or handed back by release, not yet served
        self._reclaimed: dict[int, set[str]] = {}

    def __repr__(self) -> str:
        return f"RedisBuffer({self._where!r}, prefix={self.prefix!r}, group={self.group!r}, consumer={self.consumer!r})"

    # -- keys and ids ------------------------------------------------------------------------------------
    def _stream(self, version: int) -> str:
        return f"{self.prefix}:v{version}"

    @property
    def _versions_key(self) -> str:
        return f"{self.prefix}:versions"

    @property
    def _events_key(self) -> str:
        return f"{self.prefix}:events"

    @property
    def _acked_key(self) -> str:
        return f"{self.prefix}:acked"

    @property
    def _expired_key(self) -> str:
        return f"{self.prefix}:expired"

    @staticmethod
    def _entry_id(version: int, sid: str) -> str:
        return f"{version}:{sid}"

    @staticmethod
    def _split_id(entry_id: str) -> tuple[int, str]:
        text = str(entry_id)
        match = _ENTRY_ID.fullmatch(text) if len(text) <= _MAX_ID_CHARS else None
        if match is None or int(match[2]) >= _U64 or int(match[3]) >= _U64:
            shown = text if len(text) <= 80 else f"{text[:80]}..."
            raise MalformedEntryId(f"not an entry id of this buffer: {shown!r} (expected VERSION:MS-SEQ)")
        return int(match[1]), f"{int(match[2])}-{int(match[3])}"  # as Redis writes it: no leading zeros

    def _by_version(self, ids: Iterable[str]) -> dict[int, list[str]]:
        by_version: dict[int, list[str]] = {}
        for entry_id in id_list(ids):
            version, sid = self._split_id(entry_id)
            by_version.setdefault(version, []).append(sid)
        return by_version

    # -- errors ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        self._connection.check_open()

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self._connection.errors(what)

    async def ping(self) -> None:
        """Check that Redis answers; raises `BufferUnavailable` if not."""
        with self._errors("PING"):
            await self._redis.ping()

    # -- the interface -----------------------------------------------------------------------------------
    async def put(self, trajectory: Trajectory) -> str:
        check_trajectory(trajectory)
        version = trajectory.policy_version_min
        stream = self._stream(version)
        with self._errors(f"adding a trajectory to {stream}"):
            sid = await self._put(
                keys=[stream, self._versions_key, self._events_key],
                args=[version, trajectory.model_dump_json(), self.group],
            )
        return self._entry_id(version, sid)

    async def put_many(self, trajectories: list[Trajectory]) -> list[str]:
        for trajectory in trajectories:
            check_trajectory(trajectory)
        # One MULTI/EXEC transaction: Redis runs every put or, failing before EXEC, none.
        async with self._redis.pipeline(transaction=True) as pipe:
            for trajectory in trajectories:
                version = trajectory.policy_version_min
                keys = [self._stream(version), self._versions_key, self._events_key]
                await self._put(keys=keys, args=[version, trajectory.model_dump_json(), self.group], client=pipe)
            with self._errors(f"adding {len(trajectories)} trajectories"):
                sids = await pipe.execute()
        return [self._entry_id(t.policy_version_min, sid) for t, sid in zip(trajectories, sids, strict=True)]

    async def take(self, n: int, timeout: float | None = None, order: str = "newest") -> list[BatchItem]:
        check_n(n)
        check_order(order)
        self._check_open()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        got: list[BatchItem] = []
        while True:
            with self._errors(f"reading {self._events_key}"):
                last = await self._redis.xrevrange(self._events_key, count=1)
            mark = last[0][0] if last else "0-0"
            remaining = None if deadline is None else deadline - loop.time()
            timed_out = remaining is not None and remaining <= 0
            # Read once enough are ready (or the time is up), not as they come: the n are the first n in `order`
            # of all there are then, and nothing is held while the take waits (unless a read came up short).
            if timed_out or sum((await self.ready_counts()).values()) >= n - len(got):
                got += await self._read(n - len(got), order)
                if len(got) >= n or timed_out:  # short only when another consumer took some meanwhile
                    return sorted(got, key=partial(self._place, newest_first=order == "newest"))
            block_s = self._block_s if remaining is None else min(self._block_s, remaining)
            with self._errors(f"waiting for new entries on {self._events_key}"):
                await self._redis.xread({self._events_key: mark}, count=1, block=max(1, int(block_s * 1000)))

    def _place(self, item: BatchItem, newest_first: bool) -> tuple[int, tuple[int, int]]:
        """Where an entry comes in a take: by version (newest or oldest first), then in the order it was put."""
        version, sid = self._split_id(item.id)
        return (-version if newest_first else version, _sid_key(sid))

    async def _read(self, k: int, order: str) -> list[BatchItem]:
        """Up to k entries, in `order` by version, without waiting."""
        with self._errors(f"reading {self._versions_key}"):
            registered = await self._redis.zrange(self._versions_key, 0, -1)
        versions = {int(v) for v in registered} | {v for v, ids in self._reclaimed.items() if ids}
        out: list[BatchItem] = []
        for version in sorted(versions, reverse=order == "newest"):
            if len(out) >= k:
                break
            if self._reclaimed.get(version):
                out += await self._serve_reclaimed(version, k - len(out))
            if len(out) < k:
                out += await self._read_new(version, k - len(out))
        return out

    async def _serve_reclaimed(self, version: int, k: int) -> list[BatchItem]:
        held = self._reclaimed[version]
        sids = sorted(held, key=_sid_key)[:k]
        held.difference_update(sids)
        if not held:
            del self._reclaimed[version]
        stream = self._stream(version)
        try:
            with self._errors(f"claiming reclaimed entries of {stream}"):
                rows = await self._serve(keys=[stream], args=[self.group, self.consumer, *sids])
        except BufferUnavailable:
            self._reclaimed.setdefault(version, set()).update(sids)  # still pending for us: try again later
            raise
        return [self._decode(version, sid, fields, int(deliveries)) for sid, fields, deliveries in rows]

    async def _read_new(self, version: int, k: int) -> list[BatchItem]:
        stream = self._stream(version)
        what = f"XREADGROUP on {stream}"
        for _ in range(2):
            try:
                with self._errors(what):
                    reply = await self._redis.xreadgroup(self.group, self.consumer, {stream: ">"}, count=k)
                break
            except ExperienceBufferError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # The stream was emptied and deleted since the registry was read, or lacks the group.
                with contextlib.suppress(ExperienceBufferError), self._errors(f"creating group on {stream}"):
                    await self._redis.xgroup_create(stream, self.group, id="0")
        else:
            return []
        if isinstance(reply, dict):  # RESP3
            reply = list(reply.items())
        out = []
        for _, entries in reply or []:
            for sid, fields in entries:
                out.append(self._decode(version, sid, fields, 1))
        return out

    def _decode(self, version: int, sid: str, fields: Any, deliveries: int) -> BatchItem:
        if isinstance(fields, list):  # from a script: a flat list of field, value
            fields = dict(zip(fields[::2], fields[1::2]))
        entry_id = self._entry_id(version, sid)
        try:
            trajectory = Trajectory.model_validate_json(fields["t"])
        except (KeyError, ValidationError) as exc:
            raise ExperienceBufferError(
                f"entry {entry_id} in {self._stream(version)} on Redis at {self._where} is not a trajectory "
                f"(written by another version of prorl_adapter?): {exc}"
            ) from None
        return BatchItem(id=entry_id, trajectory=trajectory, deliveries=deliveries)

    async def ack(self, ids: Iterable[str]) -> int:
        done = 0
        for version, sids in self._by_version(ids).items():
            stream = self._stream(version)
            with self._errors(f"acknowledging {len(sids)} entries of {stream}"):
                done += int(
                    await self._ack(
                        keys=[stream, self._versions_key, self._acked_key], args=[version, self.group, *sids]
                    )
                )
            self._forget(version, sids)
        return done

    def _hold(self, version: int, sids: Iterable[str]) -> int:
        """Remember entries pending for this consumer as handed back, for the next `take`; returns how many
        were not already."""
        held = self._reclaimed.setdefault(version, set())
        new = set(sids) - held
        held.update(new)
        if not held:
            del self._reclaimed[version]
        return len(new)

    def _forget(self, version: int, sids: Iterable[str]) -> None:
        held = self._reclaimed.get(version)
        if held is not None:
            held.difference_update(sids)
            if not held:
                del self._reclaimed[version]

    async def _wake(self, why: str, count: int) -> None:
        with self._errors(f"adding to {self._events_key}"):  # wake this consumer's waiting takes
            await self._redis.xadd(self._events_key, {why: count}, maxlen=1000, approximate=True)

    async def reclaim(self, idle_s: float) -> int:
        idle_ms = max(0, int(idle_s * 1000))
        with self._errors(f"reading {self._versions_key}"):
            versions = [int(v) for v in await self._redis.zrange(self._versions_key, 0, -1)]
        count = 0
        for version in versions:
            stream = self._stream(version)
            with self._errors(f"XAUTOCLAIM on {stream}"):
                sids = await self._reclaim(keys=[stream], args=[self.group, self.consumer, idle_ms])
            count += self._hold(version, sids)
        if count:
            await self._wake("reclaim", count)
        return count

    async def take_over(self, consumer: str) -> int:
        """Hand back the entries another consumer (a dead replica of the service) had taken and not
        acknowledged (its own earlier incarnation's, too: same name): they are served again by this one's
        next takes, in their original place."""
        with self._errors(f"reading {self._versions_key}"):
            versions = [int(v) for v in await self._redis.zrange(self._versions_key, 0, -1)]
        count = 0
        for version in versions:
            stream = self._stream(version)
            with self._errors(f"taking over the pending entries of {consumer} on {stream}"):
                sids = await self._take_over(keys=[stream], args=[self.group, consumer, self.consumer])
            count += self._hold(version, sids)
        if count:
            await self._wake("take_over", count)
        return count

    async def release(self, ids: Iterable[str]) -> int:
        count = 0
        for version, sids in self._by_version(ids).items():
            stream = self._stream(version)
            with self._errors(f"releasing {len(sids)} entries of {stream}"):
                pending = await self._pending_here(keys=[stream], args=[self.group, self.consumer, *sids])
            count += self._hold(version, pending)
        if count:
            await self._wake("release", count)
        return count

    async def expire(self, before_version: int) -> int:
        with self._errors(f"reading {self._versions_key}"):
            registered = await self._redis.zrangebyscore(self._versions_key, "-inf", f"({before_version}")
        # Held ids of a version whose stream is gone are not pending any more: the script returns 0, and they
        # are dropped all the same.
        versions = {int(v) for v in registered} | {v for v in self._reclaimed if v < before_version}
        removed = 0
        for version in sorted(versions):
            stream = self._stream(version)
            # Taken out first, so that a concurrent take cannot serve them while the script expires them.
            held = self._reclaimed.pop(version, set())
            try:
                with self._errors(f"expiring the ready entries of {stream}"):
                    removed += int(
                        await self._expire(
                            keys=[stream, self._versions_key, self._expired_key],
                            args=[version, self.group, self.consumer, *held],
                        )
                    )
            except BaseException:
                self._hold(version, held)  # maybe still pending for us; take serves only those that are
                raise
        return removed

    async def _registered(self) -> list[int]:
        with self._errors(f"reading {self._versions_key}"):
            return [int(v) for v in await self._redis.zrange(self._versions_key, 0, -1)]

    async def version_counts(self) -> dict[int, int]:
        versions = await self._registered()
        with self._errors("XLEN of the version streams"):
            async with self._redis.pipeline(transaction=True) as pipe:
                for version in versions:
                    pipe.xlen(self._stream(version))
                lengths = await pipe.execute()
        return {v: int(length) for v, length in zip(versions, lengths) if int(length)}

    async def _counts(self) -> tuple[int, int, dict[int, tuple[int, int]]]:
        """The acked and expired counters, and each registered version's (length, pending), where this object's
        reclaimed-but-not-served entries count as ready, not pending (one pipeline)."""
        versions = await self._registered()
        with self._errors("reading the buffer's counts"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(self._acked_key)
                pipe.get(self._expired_key)
                for version in versions:
                    pipe.xlen(self._stream(version))
                    pipe.xpending(self._stream(version), self.group)
                replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, (redis_errors.ConnectionError, redis_errors.TimeoutError)):
                raise BufferUnavailable(f"Redis at {self._where} is unavailable: reading the buffer's counts failed")
        acked, expired = (int(reply or 0) for reply in replies[:2])
        by_version = {}
        for version, length, summary in zip(versions, replies[2::2], replies[3::2]):
            if isinstance(length, Exception):
                continue
            pending = int(summary.get("pending") or 0) if isinstance(summary, dict) else 0
            held = min(pending, len(self._reclaimed.get(version, ())))
            by_version[version] = (int(length), pending - held)
        return acked, expired, by_version

    async def ready_counts(self) -> dict[int, int]:
        _, _, by_version = await self._counts()
        counts = {version: length - pending for version, (length, pending) in by_version.items()}
        return {version: n for version, n in sorted(counts.items()) if n > 0}

    async def stats(self) -> BufferStats:
        acked, expired, by_version = await self._counts()
        total = sum(length for length, _ in by_version.values())
        pending = sum(p for _, p in by_version.values())
        return BufferStats(ready=total - pending, pending=pending, acked=acked, expired=expired)

    async def close(self) -> None:
        """Close the connections. Unacknowledged entries stay in Redis (pending ones: for `reclaim`)."""
        await self._connection.close()
