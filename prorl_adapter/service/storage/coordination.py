"""What replicas of the rollout service share besides the buffer and the prompts: who is alive, the runtimes
heard from, the policy version, and one lock for admission.

    replica A ──┐                       ┌── heartbeats of replicas (who is alive, their figures)
    replica B ──┼── Coordination ───────┼── heartbeats of sandbox runtimes (where sandboxes may go)
    replica C ──┘   (memory | Redis)    ├── the policy version (set through any replica, seen by all)
                                        └── the admission lock (pace holds across replicas)

`MemoryCoordination` (here, with `memory://`) is one process: it is alone, always alive, and the lock is an
asyncio lock. `RedisCoordination` (`redis_coordination.py`, with a Redis URL) is shared by every replica
given the same URL. A replica whose heartbeat lapses is *dead*: `claim_dead()` hands each dead replica to
exactly one survivor, which takes over its work (runs its jobs and prompts again, hands back its leased
entries, deletes its sandboxes). Liveness is judged on one clock (Redis's own `TIME`), so clock skew between
nodes does not kill anyone.

The admission lock on Redis expires (a holder that died must not stop admission for ever), so a holder that stalls
past its expiry (a pause, a slow Redis, retries) could decide on counts another holder has changed since. It is
*fenced*: holding it yields an `AdmissionFence`, and the prompt queue's pop moves a prompt only if the lock still
holds that fence's token, checked in the same atomic step; otherwise it refuses (`AdmissionLapsed`), and the
holder's decision is void.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

from sandbox_runtime.models import RuntimeHeartbeat
from server_kit.errors import ProrlError

# A replica or runtime that missed this many heartbeats in a row is taken for dead.
MISSED_BEATS = 3
# A replica that saw no other alive at its last beat is taken for dead only after this many, and only by a replica
# it could not have seen (one that started since): alone, it fences itself later (replica.py).
ALONE_MISSED_BEATS = 30


@dataclass(frozen=True)
class BeatReply:
    """What a heartbeat learns: whether another replica took this one over since its last beat (what it holds is
    no longer its own), and how many others were alive when it was recorded."""

    taken: bool
    others_alive: int


@dataclass
class RuntimeRecord:
    """A runtime as last heard from: its heartbeat, and when (seconds on the coordination's clock)."""

    name: str
    heartbeat: RuntimeHeartbeat
    seen_at: float

    def alive(self, now: float) -> bool:
        return not self.heartbeat.leaving and now - self.seen_at <= MISSED_BEATS * self.heartbeat.interval_s


@dataclass
class ReplicaRecord:
    """A replica as last heard from: its id, where it is reached, its figures, and when."""

    id: str
    url: str | None
    figures: dict = field(default_factory=dict)
    seen_at: float = 0.0
    interval_s: float = 1.0

    def alive(self, now: float) -> bool:
        return now - self.seen_at <= MISSED_BEATS * self.interval_s


@dataclass(frozen=True)
class AdmissionFence:
    """The admission lock as one hold of it holds it: a write made under the lock (`PromptQueue.pop`) is made only
    if `key` on the Redis server `redis_server` still holds `token`, checked in the same atomic step, and then
    renews the lock for `renew_ms`. A token is never used twice, so a lock that lapsed never holds it again."""

    redis_server: str  # host:port/db (`RedisConnection.server`): only a client of that server can check it
    key: str
    token: str
    renew_ms: int


class AdmissionLapsed(ProrlError):
    """A write under the admission lock was refused: the lock no longer held the hold's token (it expired while
    its holder stalled; another admitter may hold it now). Nothing was written; the hold's decision is void."""


@dataclass(frozen=True)
class BarrierNews:
    """A weight-update barrier taken (`pause`, renewed by a second pause), about to be released in `keep` mode
    (`mark`: note where each frozen request stands) or released (`resume`) at a replica (weight_barrier.py).
    `expires_in_s`: how long it holds unless released, from when the news was sent (a duration, not a time: the
    replicas' clocks need not agree)."""

    kind: Literal["pause", "mark", "resume"]
    barrier: str
    mode: str
    expires_in_s: float
    replica: str = ""  # who sent it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BarrierNews:
        return cls(**json.loads(text))


class Coordination(abc.ABC):
    """The shared state of the service's replicas (see the module's docstring). Every method is a coroutine
    and raises the buffer's errors (`BufferUnavailable` while Redis cannot be reached)."""

    shared = False  # whether other processes see this state
    redis_server: str | None = None  # the Redis server (host:port/db) the state is on; None: this process

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._version = 0  # the shared policy version as this process last heard it
        self._change = 0  # the shared state's number for that version's change, where it numbers them
        self._change_heard_at = 0.0  # when (monotonic) this process heard that change
        self._version_listeners: list[Callable[[int], None]] = []
        self._prompt_listeners: list[Callable[[], None]] = []
        self._barrier_listeners: list[Callable[[BarrierNews], None]] = []

    # -- replicas ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    async def beat(self, url: str | None, figures: dict, interval_s: float) -> BeatReply:
        """This replica is alive (for MISSED_BEATS more intervals), reached at `url`, with these figures. Tells
        whether another replica took it over since its last beat (it was taken for dead), and how many others
        are alive now (those that could take it over should it fall silent: `claim_dead`)."""

    @abc.abstractmethod
    async def replicas(self) -> tuple[float, list[ReplicaRecord]]:
        """(now on the coordination's clock, every replica known, alive or not yet claimed)."""

    @abc.abstractmethod
    async def claim_dead(self, hold_s: float) -> list[str]:
        """The replicas whose heartbeat lapsed, each returned to exactly one caller: that caller takes over
        their work. The claim holds for `hold_s` (as long as a takeover may take); once it passes, or is
        released, the dead replica is handed out again. Never the caller itself: a replica takes back its own
        earlier incarnation's work when it starts. A caller that was cut off itself (its own beats lapsed)
        claims nobody until it beats again. A replica is dead after MISSED_BEATS missed beats if the caller was
        alive at its last beat (that beat told it of the caller: it fences itself in time), else only after
        ALONE_MISSED_BEATS."""

    async def release_claim(self, replica_id: str) -> None:
        """A takeover of `replica_id` failed: give the claim up, so that it is handed out again at once."""
        return None

    async def forget_replica(self, replica_id: str) -> None:
        """A dead replica's work is taken over: its record goes (only the one that took it over removes it)."""
        return None

    # -- runtimes ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    async def runtime_heard(self, name: str, heartbeat: RuntimeHeartbeat) -> None:
        """A runtime's heartbeat arrived (at any replica); a leaving one is forgotten."""

    @abc.abstractmethod
    async def runtimes(self) -> tuple[float, list[RuntimeRecord]]:
        """(now on the coordination's clock, every runtime heard from and not forgotten)."""

    # -- the policy version ------------------------------------------------------------------------------
    # The coordination is the version's one owner: it is set here (`set_policy_version`, from the API at any
    # replica), and everyone else reads `version` (the pipeline tags new turns with it).
    @property
    def version(self) -> int:
        """The shared version as this process last heard it (set here, read, or announced by another replica);
        0 before any. Read without a round trip: every turn is tagged with it."""
        return self._version

    @abc.abstractmethod
    async def policy_version(self) -> int:
        """The version as set through any replica (0 before any), read afresh; `version` follows it."""

    @abc.abstractmethod
    async def set_policy_version(self, version: int, raise_only: bool) -> int:
        """Set it (with `raise_only`, only if higher); returns the version in effect. Every replica's listeners
        hear of a change."""

    def on_policy_version(self, listener: Callable[[int], None]) -> None:
        """Call `listener(version)` in this process whenever the version it knows changes."""
        self._version_listeners.append(listener)

    def _heard_version(self, version: int, change: int | None = None, asked_at: float | None = None) -> int:
        """The version as just learnt (however): `version` follows, and listeners hear of a change.

        Where the shared state numbers its changes (`change`), news can arrive out of order: a read that raced a
        change, or this replica's own message arriving after its next set. Older news is ignored, unless it is a
        read asked (`asked_at`, monotonic) after the newest change heard here: that read saw every change up to
        it, so an older number means the shared state was lost (a Redis restarted empty), and it is believed."""
        if change is not None:
            if change < self._change and (asked_at is None or asked_at < self._change_heard_at):
                return self._version
            self._change, self._change_heard_at = change, time.monotonic()
        if version != self._version:
            self._version = version
            for listener in self._version_listeners:
                listener(version)
        return version

    # -- upcoming prompts --------------------------------------------------------------------------------
    async def prompts_added(self) -> None:
        """Prompts were added to the shared queue: every replica's listeners hear of it (this one's included),
        so that each admits what its workers can run now rather than at its next look."""
        self._admission_news()

    async def room_freed(self) -> None:
        """Room under the shared bounds was freed at this replica (entries acknowledged, an episode filtered):
        every replica hears of it, so that the room goes to whichever asks under the admission lock, not to this
        one alone because it looked first."""
        self._admission_news()

    def on_admission_news(self, listener: Callable[[], None]) -> None:
        """Call `listener()` in this process when any replica adds prompts or frees room."""
        self._prompt_listeners.append(listener)

    def _admission_news(self) -> None:
        for listener in self._prompt_listeners:
            listener()

    # -- the weight-update barrier (weight_barrier.py) ------------------------------------------------------
    # One process alone has nobody to tell and nobody to wait for: these are what MemoryCoordination does.
    def on_barrier(self, listener: Callable[[BarrierNews], None]) -> None:
        """Call `listener(news)` in this process when another replica takes or releases a barrier."""
        self._barrier_listeners.append(listener)

    def _barrier_heard(self, news: BarrierNews) -> None:
        if news.replica != self.replica_id:  # a replica acts on its own news where it makes it
            for listener in self._barrier_listeners:
                listener(news)

    async def barrier_held_now(self) -> None:
        """Tell this process's listeners (the pause) of a barrier held now: one taken while it was away."""
        return None

    async def barrier_announce(self, news: BarrierNews) -> None:
        """Tell every other replica (and one that starts while the barrier holds) of a pause or a resume."""
        return None

    async def barrier_report_drained(self, barrier: str) -> None:
        """This replica has no generation in flight under `barrier`."""
        return None

    async def barrier_wait_drained(self, barrier: str, timeout_s: float) -> bool:
        """Until every other live replica has reported `barrier` drained; False if `timeout_s` passed first."""
        return True

    # -- admission ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def admission_lock(self) -> contextlib.AbstractAsyncContextManager[AdmissionFence | None]:
        """Held while one replica decides on and admits an episode, so that the counts it decided on are the
        counts it changes: pace's bound holds over all replicas together. Yields the fence every pop of the hold
        passes to the prompt queue (`PromptQueue.pop`), where the lock can expire under its holder (Redis); None
        where it cannot (one process)."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


class MemoryCoordination(Coordination):
    """One process alone (`memory://`): nothing is shared, nobody else can die."""

    def __init__(self, replica_id: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(replica_id)
        self._clock = clock
        self._me = ReplicaRecord(replica_id, None)
        self._runtimes: dict[str, RuntimeRecord] = {}
        self._lock = asyncio.Lock()

    async def beat(self, url: str | None, figures: dict, interval_s: float) -> BeatReply:
        self._me = ReplicaRecord(self.replica_id, url, figures, self._clock(), interval_s)
        return BeatReply(taken=False, others_alive=0)

    async def replicas(self) -> tuple[float, list[ReplicaRecord]]:
        return self._clock(), [self._me]

    async def claim_dead(self, hold_s: float) -> list[str]:
        return []

    async def runtime_heard(self, name: str, heartbeat: RuntimeHeartbeat) -> None:
        if heartbeat.leaving:
            self._runtimes.pop(name, None)
        else:
            self._runtimes[name] = RuntimeRecord(name, heartbeat, self._clock())

    async def runtimes(self) -> tuple[float, list[RuntimeRecord]]:
        return self._clock(), list(self._runtimes.values())

    async def policy_version(self) -> int:
        return self._version

    async def set_policy_version(self, version: int, raise_only: bool) -> int:
        if raise_only and version <= self._version:
            return self._version
        return self._heard_version(version)

    @contextlib.asynccontextmanager
    async def admission_lock(self) -> AsyncIterator[None]:
        async with self._lock:  # never expires: no fence
            yield None
