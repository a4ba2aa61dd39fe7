"""The barrier a trainer holds while it pushes new weights: generation stops, the weights change, generation resumes
under the new policy version (docs/rollout.md, *Weight updates*).

    pause(mode)  ->  the trainer pushes weights  ->  resume(version)

While the barrier is held no generation request leaves this replica: a new turn, a gateway call and the rest of an
interrupted turn all wait at `generating()`. `pause` returns once none is in flight here or at any live replica, so
the weights never change under a request the service sent. How the requests in flight end is the trainer's choice:

- `drain`: they finish as they would have, with the old weights (any protocol).
- `abort`: the LLM servers are paused with their in-flight requests aborted (vLLM `/pause?mode=abort`, SGLang
  `/pause_generation`); each aborted request answers with the tokens it had sampled, and `agent.sample` continues
  the turn after the resume from its prompt plus those tokens (a partial rollout), the new tokens tagged with the
  new version. ProRL's `/generate` has no abort: `drain` only.

The barrier is shared by the replicas through the coordination: a pause at one replica closes every replica's
gate, and returns once every live replica has drained. A barrier that is never released (a trainer that died
between pause and resume) ends by itself `timeout_s` after the (last) pause, with a warning and `expired`
counted: generation resumes at the version it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from server_kit.errors import ApiError

from ..models import WeightUpdateMode, WeightUpdateState
from .llm import LLMPool, Progress
from .llm_protocols import UnsupportedRequest
from .storage.coordination import BarrierNews, Coordination

log = logging.getLogger(__name__)

# An aborted request may still be on its way to a server when the server's pause returns; it then waits, queued in
# the paused server, for a resume that only comes after the drain it holds up. What is still in flight so long
# after the pause is aborted again.
ABORT_AGAIN_S = 1.0
# How long a `keep` resume waits for the other replicas to note where their frozen requests stood.
MARK_WAIT_S = 10.0


class BarrierFailed(ApiError):
    """The barrier could not be taken as asked: it expired before generation drained."""

    status = 409


class ModeRefused(ApiError):
    """An LLM server of the pool cannot pause in the mode asked (ProRL's /generate has no abort)."""

    status = 400


@dataclass(eq=False)
class InFlight:
    """One generation request passing the barrier: the version it was sent at and, where a `keep` barrier froze
    it, from which of its tokens (counted as they arrived: `progress`) a newer version sampled (`changes`)."""

    version: int
    progress: Progress = field(default_factory=Progress)
    changes: list[tuple[int, int]] = field(default_factory=list)  # (tokens received before, version after)

    def __post_init__(self) -> None:
        self.progress.restarted = self._restarted

    def _restarted(self) -> None:
        """Sent again from its start (a retry): every token it returns now is sampled at the latest version."""
        self.version, self.changes = self.latest, []

    @property
    def latest(self) -> int:
        return self.changes[-1][1] if self.changes else self.version

    def versions(self, tokens: int) -> list[tuple[int, int]]:
        """(offset, version) where each run of its `tokens` tokens begins: the first at 0."""
        runs = [(0, self.version)]
        for received, version in self.changes:
            if received >= tokens:
                break
            if received == runs[-1][0]:
                runs[-1] = (received, version)  # nothing of the earlier version had arrived
            else:
                runs.append((received, version))
        return runs


@dataclass
class _Held:
    barrier: str
    mode: WeightUpdateMode
    paused_at: float  # wall clock, for people
    deadline: float  # monotonic: when it ends by itself


class WeightBarrier:
    """This replica's gate on generation, and its part of the replicas' shared barrier."""

    def __init__(self, coordination: Coordination, llm: LLMPool) -> None:
        self._coordination = coordination
        self._llm = llm
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._requests: set[InFlight] = set()
        self._waiting = 0  # generation requests (new turns, rests of interrupted ones) held at the gate
        self._held: _Held | None = None
        self._held_total = 0.0  # seconds the gate was closed here, before the current hold
        self._closed_since: float | None = None  # monotonic, while it is closed
        self._expiry: asyncio.Task[None] | None = None
        self._reports: set[asyncio.Task[None]] = set()
        self._changing = asyncio.Lock()  # a pause's and a release's changes to what is held, and the servers' pause
        self.pauses = 0
        self.expired = 0
        self.last_expired_at: float | None = None
        coordination.on_barrier(self._heard)

    # -- what generation sees ----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version a request sent now samples with (the coordination's)."""
        return self._coordination.version

    @property
    def _in_flight(self) -> int:
        return len(self._requests)

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[InFlight]:
        """Held around one generation request: waits while the barrier is held, then yields the request's record
        (the version it samples with). A `drain` or `abort` pause waits for every such request to end."""
        while not self._open.is_set():
            self._waiting += 1
            try:
                await self._open.wait()
            finally:
                self._waiting -= 1
        request = InFlight(self.version)
        self._requests.add(request)
        self._idle.clear()
        try:
            yield request
        finally:
            self._requests.discard(request)
            if not self._requests:
                self._idle.set()

    def closed(self) -> bool:
        """Whether the gate is closed now (a barrier is held)."""
        return not self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def held_s(self) -> float:
        """Seconds this replica's gate has been closed since it started (a running episode's time budget does not
        count them)."""
        closed = time.monotonic() - self._closed_since if self._closed_since is not None else 0.0
        return self._held_total + closed

    # -- what the trainer asks ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Hear of a barrier held now at other replicas (this one started, or restarted, while it holds)."""
        await self._coordination.barrier_held_now()

    async def pause(self, mode: WeightUpdateMode, timeout_s: float) -> WeightUpdateState:
        """Take the barrier (a second pause in the same mode renews the one held, with its deadline from now) and
        return once no generation request is in flight here or at any live replica (in `keep` mode: once the
        servers froze them). A mode some LLM server cannot pause in is refused before anything is held
        (ModeRefused), and so is another mode than the one held (BarrierFailed); a server that fails to pause
        releases the barrier (LLMRequestError)."""
        if mode != "drain":
            try:
                self._llm.check_pausable(mode)
            except UnsupportedRequest as exc:
                raise ModeRefused(str(exc)) from None
        async with self._changing:
            held = self._held
            if held is not None and held.mode != mode:
                raise BarrierFailed(f"a weight-update barrier in mode {held.mode!r} is held: resume it first")
            barrier = held.barrier if held is not None else uuid.uuid4().hex[:16]
            paused_at = held.paused_at if held is not None else time.time()
            deadline = time.monotonic() + timeout_s
            self._close(_Held(barrier, mode, paused_at, deadline))
            self.pauses += held is None
            try:
                await self._coordination.barrier_announce(BarrierNews("pause", barrier, mode, timeout_s))
                if mode != "drain":
                    await self._llm.pause_servers(mode)
            except BaseException:
                await self._release_held(barrier)
                raise
        if mode != "keep":  # keep: the requests in flight stay, frozen at the servers, until the resume
            try:
                drained = await self._drain(mode, deadline)
                left = deadline - time.monotonic()
                if not drained or not await self._coordination.barrier_wait_drained(barrier, left):
                    raise BarrierFailed(
                        f"the weight-update barrier expired ({timeout_s:g} s) before generation drained"
                    )
            except BaseException:
                await self._release(barrier)
                raise
        log.info("weight-update barrier %s held (%s): nothing is generating", barrier, mode)
        return self.state()

    async def resume(self, version: int | None, raise_only: bool) -> WeightUpdateState:
        """Set the new version (if given) before anything generates again, resume the LLM servers and open every
        replica's gate. With no barrier held here, it ends one the others hold (this replica may have restarted
        since the pause) and resumes the servers all the same: a resume sent twice is harmless."""
        if version is not None:
            await self._coordination.set_policy_version(version, raise_only)
        if self._held is None:
            await self._coordination.barrier_held_now()
        held = self._held
        if held is not None:
            await self._release(held.barrier)
            log.info("weight-update barrier %s released at version %d", held.barrier, self.version)
        else:
            await self._llm.resume_servers()
        return self.state()

    def state(self) -> WeightUpdateState:
        held = self._held
        return WeightUpdateState(
            paused=held is not None,
            barrier=held.barrier if held else None,
            mode=held.mode if held else None,
            paused_at=held.paused_at if held else None,
            expires_in_s=max(0.0, held.deadline - time.monotonic()) if held else None,
            in_flight=self._in_flight,
            waiting=self._waiting,
            policy_version=self.version,
            pauses=self.pauses,
            expired=self.expired,
            last_expired_at=self.last_expired_at,
        )

    async def close(self) -> None:
        """Stop; a barrier held by this process alone (no other replica to end it) resumes the servers it paused."""
        for task in [self._expiry, *self._reports]:
            if task is not None:
                task.cancel()
        held = self._held
        if held is not None and held.mode != "drain" and not self._coordination.shared:
            with contextlib.suppress(Exception):
                await self._llm.resume_servers()
        self._opened()

    # -- internals ---------------------------------------------------------------------------------------
    def _close(self, held: _Held) -> None:
        self._held = held
        self._open.clear()
        if self._closed_since is None:
            self._closed_since = time.monotonic()
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().create_task(self._expire(held.barrier, held.deadline))

    def _opened(self) -> None:
        self._held = None
        self._open.set()
        if self._closed_since is not None:
            self._held_total += time.monotonic() - self._closed_since
            self._closed_since = None
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = None

    async def _drain(self, mode: WeightUpdateMode, deadline: float) -> bool:
        """Until no request is in flight here: True, or False once `deadline` passed or the barrier was released.
        In `abort` mode what is still in flight is aborted again every ABORT_AGAIN_S."""
        while self._in_flight:
            left = deadline - time.monotonic()
            if left <= 0 or self._held is None:
                return False
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, ABORT_AGAIN_S) if mode == "abort" else left)
            except TimeoutError:
                if mode == "abort":
                    await self._llm.abort_all()
        return True

    async def _release(self, barrier: str) -> None:
        async with self._changing:
            await self._release_held(barrier)

    async def _release_held(self, barrier: str) -> None:
        """End `barrier` if it is the one held (called holding `_changing`)."""
        held = self._held
        if held is None or held.barrier != barrier:
            return
        try:
            if held.mode == "keep":  # before the servers go on: what each frozen request had is the old version's
                await self._mark_everywhere(barrier)
            # Resuming is idempotent: every replica whose timer ends an abandoned barrier resumes the servers, as
            # the replica that paused them may be the one that died.
            if held.mode != "drain":
                await self._llm.resume_servers()
        finally:
            if self._held is held:
                self._opened()
                with contextlib.suppress(Exception):  # if the news is lost, the others' timers open their gates
                    await self._coordination.barrier_announce(BarrierNews("resume", barrier, held.mode, 0.0))

    def _mark(self) -> None:
        """Every request in flight here samples at the current version from the token it has reached."""
        version = self.version
        for request in self._requests:
            if request.latest != version:
                request.changes.append((request.progress.received, version))

    async def _mark_everywhere(self, barrier: str) -> None:
        """Mark here, and at every other live replica before the servers resume (bounded: MARK_WAIT_S)."""
        self._mark()
        with contextlib.suppress(Exception):  # a replica that missed it tags its frozen tokens a little late
            await self._coordination.barrier_announce(BarrierNews("mark", barrier, "keep", 0.0))
            await self._coordination.barrier_wait_drained(f"{barrier}/mark", MARK_WAIT_S)

    async def _expire(self, barrier: str, deadline: float) -> None:
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # the barrier's own deadline
        held = self._held
        if held is None or held.barrier != barrier:
            return
        self._expiry = None  # from here on it releases: a new hold must not cancel it halfway
        self.expired += 1
        self.last_expired_at = time.time()
        log.warning(
            "weight-update barrier %s (%s) expired without a resume: generation resumes at version %d (did the "
            "trainer die between its pause and its resume?)",
            barrier,
            held.mode,
            self.version,
        )
        await self._release(barrier)

    def _heard(self, news: BarrierNews) -> None:
        """Another replica's news (this replica acts on its own where it makes it). A pause of another barrier than
        the one held replaces it: the resume of the one held was missed."""
        held = self._held
        if news.kind == "pause":
            paused_at = held.paused_at if held is not None else time.time()
            self._close(_Held(news.barrier, news.mode, paused_at, time.monotonic() + news.expires_in_s))
            if news.mode != "keep":
                self._report(self._report_drained(news.barrier, news.mode))
        elif held is None or held.barrier != news.barrier:
            return
        elif news.kind == "mark":
            self._mark()
            self._report(self._coordination.barrier_report_drained(f"{news.barrier}/mark"))
        else:
            self._opened()

    def _report(self, report: Coroutine[Any, Any, None]) -> None:
        async def reported() -> None:
            with contextlib.suppress(Exception):  # lost: the pausing replica's wait ends at the deadline
                await report

        task = asyncio.get_running_loop().create_task(reported())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_drained(self, barrier: str, mode: str) -> None:
        """Tell the pausing replica once nothing is in flight here. In `abort` mode, what reached a server after
        its pause (queued there) is aborted again, as the pausing replica does with its own."""
        while (held := self._held) is not None and held.barrier == barrier:
            if not self._in_flight:
                await self._coordination.barrier_report_drained(barrier)
                return
            left = held.deadline - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._idle.wait(), min(left, ABORT_AGAIN_S) if mode == "abort" else left)
            except TimeoutError:
                if mode == "abort":
                    await self._llm.abort_all()
