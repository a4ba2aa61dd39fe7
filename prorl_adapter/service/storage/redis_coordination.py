"""The replicas' shared state on Redis (the contract: `coordination.Coordination`).

Keys (prefix default `prorl`):
- `{prefix}:replicas`: a hash, replica id -> JSON {url, figures, seen_at, interval_s, taken_by};
- `{prefix}:runtimes`: a hash, runtime name -> JSON {heartbeat, seen_at};
- `{prefix}:policy_version`: the version, as a string, and `{prefix}:policy_version_change`: how many times it
  changed (each change's number travels with it, so that news of it heard out of order is put in order);
- `{prefix}:admission`: the admission lock (redis-py's `Lock`: it expires if its holder dies), holding its holder's
  token, a new one per hold: the prompt queue's pop moves a prompt only while the lock still holds the token of the
  hold it is made under (`coordination.AdmissionFence`), and renews it;
- `{prefix}:weight_barrier`: the weight-update barrier held now (JSON `BarrierNews`), expiring with it, for a replica
  that starts or reconnects while it holds;
- channel `{prefix}:events`: `KIND:PAYLOAD` messages (`version:7:<change>`, `finished:<job id>`, `cancel:<job id>`,
  `prompts:` when prompts were added to the shared queue, `barrier:<JSON BarrierNews>`, `drained:<barrier>:<replica
  id>`), each replica subscribed once.

Every time is Redis's own (`TIME`, read inside the scripts), so nodes whose clocks disagree still agree on who
is alive. Messages on the channel can be missed (a replica reconnecting); every listener here re-reads what it
cares about after a reconnection or on its own timer, so a lost message delays, never loses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from sandbox_runtime.models import RuntimeHeartbeat

from .coordination import (
    ALONE_MISSED_BEATS,
    MISSED_BEATS,
    AdmissionFence,
    BarrierNews,
    BeatReply,
    Coordination,
    ReplicaRecord,
    RuntimeRecord,
)
from .redis_connection import RedisConnection, keeping_cancellation, redis_errors

log = logging.getLogger(__name__)

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

_BEAT = (
    _NOW
    + """
-- KEYS: replicas hash; ARGV: id, JSON {url, figures, interval_s}, whether this process has beaten before (1/0),
-- this beat's own id, missed beats. Returns {taken, others}: taken is 1 when another replica took this one over
-- since its last beat (its work is no longer its own), else 0. Said again to the same beat run twice (its reply
-- lost, redis-py sent it again): the news is told once, and a lost reply must not lose it. others: the replicas
-- alive now besides this one.
-- `since` keeps the time of the beat before: a replica just back from a gap of its own (a partition, Redis
-- away) must not judge the others, who could not beat either, until it has beaten twice in a row. `born`: when
-- its record was made (the claim weighs it).
local previous = redis.call('HGET', KEYS[1], ARGV[1])
local taken = 0
local last = now
local born = now
if previous then
  local old = cjson.decode(previous)
  if old['taken_by'] and old['taken_by'] ~= ARGV[1] then taken = 1 end
  if old['taken_told'] == ARGV[4] then taken = 1 end  -- this very beat again
  last = old['seen_at']
  born = old['born'] or old['seen_at']
elseif ARGV[3] == '1' then
  taken = 1  -- forgotten: taken over and done with
end
local record = cjson.decode(ARGV[2])
if taken == 1 then
  record['taken_told'] = ARGV[4]
  born = now  -- a new life: the replicas alive now are what this one is told of
end
record['seen_at'] = now
record['since'] = last
record['born'] = born
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
local others = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local other = cjson.decode(all[i + 1])
  if all[i] ~= ARGV[1] and now - other['seen_at'] <= tonumber(ARGV[5]) * other['interval_s'] then
    others = others + 1
  end
end
return {taken, others}
"""
)

_READ = (
    _NOW
    + """
-- KEYS: a hash; ARGV: intervals of silence after which an entry is pruned (0: never). Returns {now, id, JSON...}.
local out = {tostring(now)}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local record = cjson.decode(all[i + 1])
  local interval = record['interval_s'] or record['heartbeat']['interval_s']
  if tonumber(ARGV[1]) > 0 and now - record['seen_at'] > tonumber(ARGV[1]) * interval then
    redis.call('HDEL', KEYS[1], all[i])
  else
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
"""
)

_CLAIM_DEAD = (
    _NOW
    + """
-- KEYS: replicas hash; ARGV: this replica's id, missed beats, how long a claim holds (s), missed beats of one
-- alone. Each lapsed replica that nobody holds a claim on is claimed by this one until now + that hold (the
-- takeover's own bound: a takeover still under way must not be handed out again); its id is returned to this
-- caller only. A caller whose own last two beats were further apart than the missed beats (it was cut off
-- itself) claims nobody. A replica lapses after the missed beats if this caller was there at its last beat (it
-- was told of the caller, and fences itself in time), else after the missed beats of one alone.
local out = {}
local mine = redis.call('HGET', KEYS[1], ARGV[1])
if not mine then return out end
mine = cjson.decode(mine)
if not mine['since'] or mine['seen_at'] - mine['since'] > tonumber(ARGV[2]) * mine['interval_s'] then return out end
local mine_born = mine['born'] or mine['seen_at']
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local record = cjson.decode(all[i + 1])
  local beats = tonumber(ARGV[2])
  if mine_born >= record['seen_at'] then beats = tonumber(ARGV[4]) end
  local lapsed = now - record['seen_at'] > beats * record['interval_s']
  local held = record['claimed_until'] and now <= record['claimed_until']
  if all[i] ~= ARGV[1] and lapsed and not held then
    record['claimed_until'] = now + tonumber(ARGV[3])
    record['taken_by'] = ARGV[1]
    redis.call('HSET', KEYS[1], all[i], cjson.encode(record))
    out[#out + 1] = all[i]
  end
end
return out
"""
)

_RELEASE = """
-- KEYS: replicas hash; ARGV: the replica claimed, the claimer. A takeover that failed gives its claim up, so
-- that the next look (its own or another survivor's) claims the dead replica again.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local record = cjson.decode(raw)
if record['taken_by'] ~= ARGV[2] then return 0 end
record['claimed_until'] = nil
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
return 1
"""

_RUNTIME = (
    _NOW
    + """
-- KEYS: runtimes hash; ARGV: name, heartbeat JSON, leaving (1/0).
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({heartbeat = cjson.decode(ARGV[2]), seen_at = now}))
end
return 1
"""
)

_SET_VERSION = """
-- KEYS: the version key, its change counter; ARGV: version, raise_only (1/0), channel.
-- Returns {the version in effect, its change's number}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if (ARGV[2] == '1' and wanted <= current) or wanted == current then
  return {current, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
local change = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[3], 'version:' .. ARGV[1] .. ':' .. change)
return {wanted, change}
"""

# A runtime silent this long is dropped from the records altogether (a replica only once it was taken over).
FORGET_AFTER_BEATS = 100

_FORGET = """
-- KEYS: replicas hash; ARGV: the replica taken over, the one that took it over. Only the taker forgets it.
local record = redis.call('HGET', KEYS[1], ARGV[1])
if record and cjson.decode(record)['taken_by'] == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 1
"""
# The lock expires this long after it was taken or last renewed (by a pop made under it): a holder that died
# mid-admission holds up the others no longer, and one that stalls this long finds its next pop refused.
ADMISSION_LOCK_S = 10.0


_END_BARRIER = """
-- KEYS: the barrier key; ARGV: the barrier's id. Deletes it only if it is still that barrier (not a newer one).
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['barrier'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisCoordination(Coordination):
    shared = True

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        prefix: str = "prorl",
        socket_timeout: float = 5.0,
        admission_lock_s: float = ADMISSION_LOCK_S,
    ) -> None:
        super().__init__(replica_id)
        self._connection = RedisConnection(url, socket_timeout=socket_timeout)
        self._url = url
        self.prefix = prefix
        self.channel = f"{prefix}:events"
        self._replicas_key = f"{prefix}:replicas"
        self._runtimes_key = f"{prefix}:runtimes"
        self._version_key = f"{prefix}:policy_version"
        self._change_key = f"{prefix}:policy_version_change"
        redis = self._connection.redis
        self._beat = redis.register_script(_BEAT)
        self._read = redis.register_script(_READ)
        self._claim_dead = redis.register_script(_CLAIM_DEAD)
        self._runtime = redis.register_script(_RUNTIME)
        self._set_version = redis.register_script(_SET_VERSION)
        self._forget = redis.register_script(_FORGET)
        self._release = redis.register_script(_RELEASE)
        self._beaten = False
        # Polled every 5 ms while another replica holds it (redis-py's default, 100 ms, would idle admission).
        self._admission_key = f"{prefix}:admission"
        self._admission_lock_ms = max(1, int(admission_lock_s * 1000))
        self._lock = redis.lock(self._admission_key, timeout=admission_lock_s, sleep=0.005, blocking_timeout=None)
        self._listeners: dict[str, list[Callable[[str], None]]] = {}
        self._listening: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._barrier_key = f"{prefix}:weight_barrier"
        self._end_barrier = redis.register_script(_END_BARRIER)
        # A barrier announced or waited for here -> the replicas that reported it drained.
        self._drained: dict[str, set[str]] = {}
        self._drained_news = asyncio.Event()

    @property
    def url(self) -> str:
        return self._url

    @property
    def redis_server(self) -> str:
        return self._connection.server

    @property
    def redis(self):
        """The client, for the other Redis-backed parts of one replica (the job board) to share."""
        return self._connection.redis

    def errors(self, what: str):
        return self._connection.errors(what)

    # -- replicas ---------------------------------------------------------------------------------------
    async def beat(self, url: str | None, figures: dict, interval_s: float) -> BeatReply:
        record = json.dumps({"url": url, "figures": figures, "interval_s": interval_s})
        with self.errors(f"a heartbeat in {self._replicas_key}"):
            args = [self.replica_id, record, "1" if self._beaten else "0", uuid.uuid4().hex, MISSED_BEATS]
            taken, others = await self._beat(keys=[self._replicas_key], args=args)
        self._beaten = True
        return BeatReply(taken=bool(taken), others_alive=int(others))

    async def replicas(self) -> tuple[float, list[ReplicaRecord]]:
        now, rows = await self._read_records(self._replicas_key, prune_after=0)
        replicas = [
            ReplicaRecord(name, r.get("url"), r.get("figures") or {}, r["seen_at"], r["interval_s"]) for name, r in rows
        ]
        return now, replicas

    async def claim_dead(self, hold_s: float) -> list[str]:
        with self.errors(f"looking for dead replicas in {self._replicas_key}"):
            args = [self.replica_id, MISSED_BEATS, hold_s, ALONE_MISSED_BEATS]
            return list(await self._claim_dead(keys=[self._replicas_key], args=args))

    async def release_claim(self, replica_id: str) -> None:
        with self.errors(f"giving up the claim on replica {replica_id} in {self._replicas_key}"):
            await self._release(keys=[self._replicas_key], args=[replica_id, self.replica_id])

    async def forget_replica(self, replica_id: str) -> None:
        with self.errors(f"forgetting replica {replica_id} in {self._replicas_key}"):
            await self._forget(keys=[self._replicas_key], args=[replica_id, self.replica_id])

    # -- runtimes ---------------------------------------------------------------------------------------
    async def runtime_heard(self, name: str, heartbeat: RuntimeHeartbeat) -> None:
        with self.errors(f"recording a runtime's heartbeat in {self._runtimes_key}"):
            await self._runtime(
                keys=[self._runtimes_key], args=[name, heartbeat.model_dump_json(), "1" if heartbeat.leaving else "0"]
            )

    async def runtimes(self) -> tuple[float, list[RuntimeRecord]]:
        now, rows = await self._read_records(self._runtimes_key, prune_after=FORGET_AFTER_BEATS)
        return now, [RuntimeRecord(name, RuntimeHeartbeat(**r["heartbeat"]), r["seen_at"]) for name, r in rows]

    async def _read_records(self, key: str, prune_after: int) -> tuple[float, list[tuple[str, dict]]]:
        with self.errors(f"reading {key}"):
            reply = await self._read(keys=[key], args=[prune_after])
        rows = [(reply[i], json.loads(reply[i + 1])) for i in range(1, len(reply), 2)]
        return float(reply[0]), rows

    # -- the policy version ------------------------------------------------------------------------------
    async def policy_version(self) -> int:
        asked_at = time.monotonic()
        with self.errors(f"reading {self._version_key}"):
            version, change = await self.redis.mget(self._version_key, self._change_key)
        return self._heard_version(int(version or 0), int(change or 0), asked_at)

    async def set_policy_version(self, version: int, raise_only: bool) -> int:
        asked_at = time.monotonic()  # its answer is as fresh as a read's
        with self.errors(f"setting {self._version_key}"):
            args = [version, "1" if raise_only else "0", self.channel]
            effective, change = await self._set_version(keys=[self._version_key, self._change_key], args=args)
        self._heard_version(int(effective), int(change), asked_at)  # here at once; the others through the channel
        return int(effective)

    def _version_message(self, payload: str) -> None:
        version, _, change = payload.partition(":")
        self._heard_version(int(version), int(change) if change else None)

    # -- the weight-update barrier ------------------------------------------------------------------------
    async def barrier_announce(self, news: BarrierNews) -> None:
        news = BarrierNews(news.kind, news.barrier, news.mode, news.expires_in_s, self.replica_id)
        # The others' reports may come back before this replica waits for them: kept from now until the resume.
        if news.kind == "pause":
            self._drained.setdefault(news.barrier, set())
        elif news.kind == "mark":
            self._drained.setdefault(f"{news.barrier}/mark", set())
        else:
            self._drained.pop(news.barrier, None)
            self._drained.pop(f"{news.barrier}/mark", None)
        with self.errors(f"announcing a weight-update barrier in {self._barrier_key}"):
            if news.kind == "pause":
                await self.redis.set(self._barrier_key, news.to_json(), px=max(1, int(news.expires_in_s * 1000)))
            elif news.kind == "resume":
                await self._end_barrier(keys=[self._barrier_key], args=[news.barrier])
            await self.redis.publish(self.channel, f"barrier:{news.to_json()}")

    async def barrier_report_drained(self, barrier: str) -> None:
        await self.publish("drained", f"{barrier}:{self.replica_id}")

    async def barrier_wait_drained(self, barrier: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        self._drained.setdefault(barrier, set())  # reports are kept only for what is announced or waited for
        try:
            while True:
                self._drained_news.clear()
                now, replicas = await self.replicas()
                live = {r.id for r in replicas if r.alive(now)} - {self.replica_id}
                if live <= self._drained.get(barrier, set()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "weight-update barrier %s: replicas %s did not drain in time",
                        barrier,
                        ", ".join(sorted(live - self._drained.get(barrier, set()))),
                    )
                    return False
                # A report wakes it; who is alive is read again at least every second (a replica that died while
                # the barrier held never reports, and is not waited for once its heartbeat lapses).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained_news.wait(), min(left, 1.0))
        finally:
            self._drained.pop(barrier, None)

    def _drained_message(self, payload: str) -> None:
        barrier, _, replica = payload.partition(":")
        if barrier in self._drained:
            self._drained[barrier].add(replica)
            self._drained_news.set()

    async def barrier_held_now(self) -> None:
        with self.errors(f"reading {self._barrier_key}"):
            text, left_ms = await self.redis.get(self._barrier_key), await self.redis.pttl(self._barrier_key)
        if text is not None and left_ms > 0:
            news = BarrierNews.from_json(text)
            for listener in self._barrier_listeners:  # this replica's own too: it may have restarted since
                listener(BarrierNews("pause", news.barrier, news.mode, left_ms / 1000, news.replica))

    # -- admission ---------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admission_lock(self) -> AsyncIterator[AdmissionFence]:
        token = uuid.uuid4().hex
        try:
            with self.errors(f"taking the admission lock {self._admission_key}"):
                await self._lock.acquire(token=token)
        except asyncio.CancelledError:
            # Perhaps after Redis granted it: the reply unread, or a cancellation redis-py swallowed raised once
            # the lock was ours (`keeping_cancellation`). Let go of it by its token, or it stays held until it
            # expires (ADMISSION_LOCK_S) and every replica's admission waits.
            await self._release_admission_lock(token)
            raise
        try:
            yield AdmissionFence(self.redis_server, self._admission_key, token, self._admission_lock_ms)
        finally:
            await self._release_admission_lock(token)  # a lapsed one is not ours to release: left alone

    async def _release_admission_lock(self, token: str) -> None:
        self._lock.local.token = token.encode()  # as acquire records it, which a cancelled acquire may not have
        with contextlib.suppress(redis_errors.LockError), self.errors("releasing the admission lock"):
            await self._lock.release()  # only if the lock holds this token (LockNotOwnedError otherwise)

    # -- events -------------------------------------------------------------------------------------------
    def on_event(self, kind: str, listener: Callable[[str], None]) -> None:
        """Call `listener(payload)` for every `kind:payload` message on the channel, from any replica."""
        self._listeners.setdefault(kind, []).append(listener)

    async def prompts_added(self) -> None:
        await self.publish("prompts", "")

    async def room_freed(self) -> None:
        await self.publish("room", "")

    async def publish(self, kind: str, payload: str) -> None:
        with self.errors(f"PUBLISH to {self.channel}"):
            await self.redis.publish(self.channel, f"{kind}:{payload}")

    async def start(self) -> None:
        self.on_event("version", self._version_message)
        self.on_event("prompts", lambda _: self._admission_news())
        self.on_event("room", lambda _: self._admission_news())
        self.on_event("barrier", lambda payload: self._barrier_heard(BarrierNews.from_json(payload)))
        self.on_event("drained", self._drained_message)
        self._listening = asyncio.create_task(self._listen_forever())
        with contextlib.suppress(TimeoutError):  # Redis away: the listener keeps trying; start anyway
            async with asyncio.timeout(5.0):
                await self._subscribed.wait()

    async def _listen_forever(self) -> None:
        delay = 0.2
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    with keeping_cancellation():  # this loop ends only by cancellation: it must not be lost
                        await pubsub.subscribe(self.channel)
                    self._subscribed.set()
                    await self.policy_version()  # what was missed while away (`version` follows the read)
                    await self.barrier_held_now()
                    delay = 0.2
                    while True:
                        # Polled with a timeout below the socket's: `listen()` on an idle channel would hit the
                        # client's socket timeout on redis-py < 8.1 and resubscribe, losing what came meanwhile.
                        with keeping_cancellation():
                            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is None:
                            continue
                        kind, _, payload = str(message.get("data", "")).partition(":")
                        for listener in self._listeners.get(kind, []):
                            try:
                                listener(payload)
                            except Exception:  # one listener's bug must not end the subscription
                                log.exception("a listener of %s messages failed", kind)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: subscribe again, with backoff
                log.warning("the subscription to %s broke (%s); subscribing again", self.channel, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def close(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listening
        await self._connection.close()
