"""Warm sandboxes: for each sandbox spec episodes have asked for, up to `size` sandboxes created ahead, so that an
episode's init pays only the task's own set-up; and the gate that throttles sandbox creation on each runtime.

A spec is known by its canonical JSON without what differs per episode (`ttl_s`, `labels`). `take` hands out a
warm sandbox of the spec (a hit) or None (a miss: the caller creates one as it would without warm sandboxes);
either way the spec becomes the most recently asked, and a refill loop tops it up in the background, starting at
most `refill_per_s` creations a second (this replica's, all specs together) and never holding more than `size`
ready or being created per spec. At most `max_specs` specs are kept: the least recently asked one is dropped and
its warm sandboxes deleted. A refill that fails, or finds no runtime with room, pauses that spec's refills until
an episode asks for it again.

A warm sandbox is used once: it is handed to one episode, whose release deletes it. It carries the replica's
owner label (so the leftover sweeps delete it after a crash), the label `prorl_warm` (the spec's digest) and none
of the episode's labels (labels are fixed at creation). Its TTL reaps it if the service dies, and is long enough
for the episode that takes it: `max_age_s` plus the largest TTL an episode of the spec asked for. One older than
`max_age_s` (half the spec's idle timeout, if it has one) is deleted, never handed out; one whose TTL left is
shorter than what the taking episode asks for is deleted too (later refills carry the larger TTL).

`CreateGate` bounds the creations in flight on one runtime; episodes' creations (`urgent`) go before refills, so
an episode never queues behind a refill that has not started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..models import WarmSandboxState

log = logging.getLogger(__name__)
WARM_LABEL = "prorl_warm"
PER_EPISODE_FIELDS = ("ttl_s", "labels")  # left out of a spec's key: they differ between episodes of one spec
TICK_S = 1.0  # how often the refill loop looks for warm sandboxes grown too old, with nothing else to do


@dataclass
class WarmConfig:
    size: int = 0  # warm sandboxes per spec; 0: none (off)
    refill_per_s: float = 1.0  # creations started by refills per second, all specs together
    max_specs: int = 8  # specs kept warm; the least recently asked is dropped first
    max_age_s: float = 600.0  # a warm sandbox older than this is deleted instead of handed out

    def check(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"--warm-sandboxes {self.size!r} must be an integer >= 0 (0: off)")
        if not 0 < self.refill_per_s <= 1000:
            raise ValueError(f"--warm-refill-per-s {self.refill_per_s:g} must be in (0, 1000]")
        if not isinstance(self.max_specs, int) or self.max_specs < 1:
            raise ValueError(f"--warm-max-specs {self.max_specs!r} must be an integer >= 1")
        if not 0 < self.max_age_s <= 86_400:
            raise ValueError(f"--warm-max-age-s {self.max_age_s:g} must be in (0, 86400]")


def spec_key(spec: dict[str, Any]) -> str:
    """The spec's canonical JSON without the fields that differ between its episodes."""
    kept = {name: value for name, value in spec.items() if name not in PER_EPISODE_FIELDS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)


def spec_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class CreateGate:
    """At most `limit` sandbox creations in flight (None: no limit); a waiting urgent one starts before any
    waiting background one, and a background one does not start while an urgent one waits."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.in_flight = 0
        self._waiting: dict[bool, deque[asyncio.Future[None]]] = {True: deque(), False: deque()}

    def _room(self) -> bool:
        return self.limit is None or self.in_flight < self.limit

    def waiting(self, urgent: bool) -> int:
        return sum(not f.done() for f in self._waiting[urgent])

    async def enter(self, urgent: bool) -> None:
        if self._room() and not self.waiting(True) and (urgent or not self.waiting(False)):
            self.in_flight += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting[urgent].append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: hand the slot on
                self.leave()
            else:
                granted.cancel()
            raise

    def leave(self) -> None:
        self.in_flight -= 1
        while self._room():
            queue = self._waiting[True] if self.waiting(True) else self._waiting[False]
            while queue and queue[0].done():
                queue.popleft()
            if not queue:
                return
            self.in_flight += 1
            queue.popleft().set_result(None)


@dataclass
class WarmBox:
    sandbox_id: str
    server_url: str
    workdir: str
    started: float  # the clock when its creation was asked for: no later than the runtime's start of its TTL
    ttl_s: float


@dataclass
class WarmSpec:
    key: str
    spec: dict[str, Any]  # without the per-episode fields
    ttl_need: float  # the largest TTL an episode of this spec asked for
    ready: deque[WarmBox] = field(default_factory=deque)
    creating: int = 0
    paused: bool = False  # a refill failed or found no room: none again until an episode asks
    hits: int = 0
    misses: int = 0
    created: int = 0
    expired: int = 0  # deleted unused: too old, too short a TTL, or on a runtime gone
    failures: int = 0
    create_s: float = 0.0  # the time its refills' creations took, all together

    @property
    def digest(self) -> str:
        return spec_digest(self.key)

    def max_age(self, config: WarmConfig) -> float:
        idle = self.spec.get("idle_timeout_s")
        return config.max_age_s if idle is None else min(config.max_age_s, idle / 2)


# What the sandbox pool gives: create one (its placement and throttling; None when no runtime has room), delete
# one, and whether a runtime may serve one now.
Create = Callable[[dict[str, Any]], Awaitable[WarmBox | None]]
Delete = Callable[[WarmBox], Awaitable[None]]


class WarmSandboxes:
    def __init__(
        self,
        config: WarmConfig,
        create: Create,
        delete: Delete,
        usable: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._create, self._delete, self._usable, self._clock = create, delete, usable, clock
        self.specs: OrderedDict[str, WarmSpec] = OrderedDict()  # least recently asked first
        self.refill_starts: deque[float] = deque(maxlen=10_000)  # the clock at each refill started, for the record
        self._next_start = 0.0
        self._changed = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._creations: set[asyncio.Task[None]] = set()
        self._deletes: set[asyncio.Task[None]] = set()
        self._closed = False
        self.hits = self.misses = 0  # since the start, dropped specs' included

    # -- what episodes ask ----------------------------------------------------------------------------------
    def take(self, spec: dict[str, Any], exclude: set[str]) -> WarmBox | None:
        """A warm sandbox of `spec` fit for this episode, or None; notes the spec as asked for (and starts the
        refill loop the first time). A spec asked for without a TTL is never served warm."""
        if self._closed:
            return None
        ttl = spec.get("ttl_s")
        if ttl is None:
            return None
        if self._loop is None:
            self._loop = asyncio.ensure_future(self._refill_loop())
        key = spec_key(spec)
        warm = self.specs.get(key)
        if warm is None:
            kept = {name: value for name, value in spec.items() if name not in PER_EPISODE_FIELDS}
            warm = self.specs[key] = WarmSpec(key, kept, ttl_need=ttl)
            while len(self.specs) > self.config.max_specs:
                self._drop(self.specs.popitem(last=False)[1])
        self.specs.move_to_end(key)
        warm.ttl_need, warm.paused = max(warm.ttl_need, ttl), False
        self._changed.set()
        now = self._clock()
        for box in list(warm.ready):
            if not self._usable(box.server_url):  # its runtime is gone: so is it, most likely
                self._discard(warm, box)
                continue
            if box.server_url in exclude:  # not for this episode: kept for another
                continue
            age = now - box.started
            if age > warm.max_age(self.config) or box.ttl_s - age < ttl:
                self._discard(warm, box)
                continue
            warm.ready.remove(box)
            warm.hits += 1
            self.hits += 1
            return box
        warm.misses += 1
        self.misses += 1
        return None

    def describe(self) -> dict[str, WarmSandboxState]:
        return {
            warm.digest: WarmSandboxState(
                image=warm.spec.get("image"),
                size=self.config.size,
                refill_per_s=self.config.refill_per_s,
                ready=len(warm.ready),
                creating=warm.creating,
                hits=warm.hits,
                misses=warm.misses,
                created=warm.created,
                expired=warm.expired,
                failures=warm.failures,
                paused=warm.paused,
                saved_s=round(warm.hits * warm.create_s / warm.created, 3) if warm.created else 0.0,
            )
            for warm in reversed(self.specs.values())
        }

    # -- the refills ----------------------------------------------------------------------------------------
    def _wanting(self) -> WarmSpec | None:
        """The most recently asked spec short of warm sandboxes, with refills not paused."""
        for warm in reversed(self.specs.values()):
            if not warm.paused and len(warm.ready) + warm.creating < self.config.size:
                return warm
        return None

    def _expire(self) -> None:
        now = self._clock()
        for warm in self.specs.values():
            for box in list(warm.ready):
                if now - box.started > warm.max_age(self.config) or not self._usable(box.server_url):
                    self._discard(warm, box)

    async def _refill_loop(self) -> None:
        while not self._closed:  # (and cancelled at close)
            self._expire()
            warm = self._wanting()
            wait = TICK_S if warm is None else self._next_start - self._clock()
            if wait > 0:
                self._changed.clear()
                if warm is None:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancel of close.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._changed.wait()
                else:  # the pace of refills: a period, not a wait for something to happen
                    await asyncio.sleep(wait)
                continue
            now = self._clock()
            self._next_start = now + 1.0 / self.config.refill_per_s
            self.refill_starts.append(now)
            warm.creating += 1
            task = asyncio.ensure_future(self._refill(warm))
            self._creations.add(task)
            task.add_done_callback(self._creations.discard)

    async def _refill(self, warm: WarmSpec) -> None:
        ttl = self.config.max_age_s + warm.ttl_need
        box = None
        started = self._clock()
        try:
            box = await self._create({**warm.spec, "ttl_s": ttl, "labels": {WARM_LABEL: warm.digest}})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            warm.failures += 1
            log.warning("a warm sandbox of spec %s could not be created: %s", warm.digest, exc)
        finally:
            warm.creating -= 1
            self._changed.set()
        if box is None:
            warm.paused = True
            return
        box.started = started  # the TTL's start on the runtime is no earlier
        if self._closed or self.specs.get(warm.key) is not warm:  # dropped meanwhile
            self._delete_later(box)
            return
        warm.created += 1
        warm.create_s += self._clock() - started
        warm.ready.append(box)

    # -- deleting -------------------------------------------------------------------------------------------
    def _discard(self, warm: WarmSpec, box: WarmBox) -> None:
        warm.ready.remove(box)
        warm.expired += 1
        self._delete_later(box)

    def _drop(self, warm: WarmSpec) -> None:
        while warm.ready:
            self._delete_later(warm.ready.popleft())

    def _delete_later(self, box: WarmBox) -> None:
        task = asyncio.ensure_future(self._delete(box))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def close(self) -> None:
        """Stop refilling and delete every warm sandbox, those being created included, once they are."""
        self._closed = True
        tasks = [task for task in (self._loop, *self._creations) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for warm in self.specs.values():
            self._drop(warm)
        await asyncio.gather(*self._deletes, return_exceptions=True)
