"""This process as one replica of the rollout service: it says it is alive, and takes over the work of replicas
that die. (The shared policy version is the coordination's, which every replica reads.)

Every `interval_s` a replica beats (with its figures, which `GET /v1/status` of any replica shows) and asks the
coordination for replicas whose beats lapsed; each dead one is handed to exactly one survivor, which

1. queues the dead one's jobs again, at the head of the shared queue (`JobBoard.take_over`),
2. runs its admitted prompts and serves again the entries it had leased (`Producer.take_over`),
3. deletes its sandboxes on every live runtime (they carry its id as their owner label),

and then forgets it. Beating and taking over run apart (a takeover that waits on a dead runtime must not make
the survivor miss its own beats), and each takeover is bounded: while one is under way nobody claims the dead
replica again (the claim holds for the bound), and one that fails gives its claim up, to be claimed again.
A replica that learns from its beat that it was taken for dead (it was only slow, or cut off) drops what it
held: its jobs and prompts run elsewhere now.

A replica cut off from Redis cannot learn that until the link is back, so it does not wait to: each beat that
gets through renews a lease of MISSED_BEATS beats less a margin, counted from when the beat was sent (the
survivors count the same beats from when Redis got it, later). Where the lease runs out, the replica fences itself
before any other may take it over: its episodes stop (their sandboxes go), and it delivers, writes and takes
nothing. Its next beat that gets through says whether it was taken over: if so its work runs elsewhere and it
drops the rest; if not, it runs again what it stopped. So a partitioned replica's work is never run at two
replicas at once. A replica that its last beat told of no other alive has a lease of ALONE_MISSED_BEATS: only a
replica started since may take it over, and only that much later, so a lone replica rides out a Redis outage of
a minute (at the 2 s beat) without stopping anything.
With `memory://` the replica is alone and nothing of this happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..models import ReplicaState
from .decoupled import Producer
from .job_runner import JobRunner
from .sandboxes import SandboxPool
from .storage.buffer import ExperienceBufferError
from .storage.coordination import ALONE_MISSED_BEATS, MISSED_BEATS, BeatReply, Coordination
from .storage.job_board import JobBoard

log = logging.getLogger(__name__)
TAKEOVER_S = 120.0  # a takeover that takes longer is given up, to be claimed again; the claim holds as long


# Every 2 s (the service's `RolloutConfig.heartbeat_s`): a replica is taken for dead after three missed beats, 6 s,
# and fences itself at 5 s. At 1 s (3 s), a replica whose process was starved of CPU for a few seconds (vLLM
# reloading weights on the same two cores, in a CI run) was taken for dead and dropped the episode it was running;
# a real death is noticed 3 s later instead.
BEAT_INTERVAL_S = 2.0
# The lease a beat renews falls short of the survivors' MISSED_BEATS by this many beat intervals: time for the
# fence to stop the episodes (a cancellation, milliseconds) with room for an event loop running late.
FENCE_MARGIN_BEATS = 0.5
# Where the lease ends while a beat is on its way, the fence waits this many intervals more for its answer: a
# process starved of CPU for seconds (vLLM beside it on two cores) finds the answer read only after the lease's
# timer has fired. Fenced all the same, it would stop every episode for nothing; the survivors still wait longer.
FENCE_GRACE_BEATS = 0.25


class Replica:
    def __init__(
        self,
        coordination: Coordination,
        runner: JobRunner,
        board: JobBoard,
        producer: Producer,
        sandboxes: SandboxPool,
        url: str | None,
        interval_s: float = BEAT_INTERVAL_S,
    ) -> None:
        self.coordination = coordination
        self.runner = runner
        self.board = board
        self.producer = producer
        self.sandboxes = sandboxes
        self.url = url
        self.interval_s = interval_s
        self.taken_over = 0  # dead replicas this one took over
        self.fences = 0  # times this replica fenced itself
        self.fenced = False
        self._lapse: asyncio.TimerHandle | None = None  # the lease's end, renewed by each beat that gets through
        self._lease_s = 0.0
        self._others_alive = 0
        self._beating = False  # a beat is on its way
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def id(self) -> str:
        return self.coordination.replica_id

    async def start(self) -> None:
        with contextlib.suppress(ExperienceBufferError):  # Redis away: the coordination hears of it later
            await self.coordination.policy_version()  # what it reads is the version this replica tags turns with
        for loop in (self._beat_forever, self._watch_forever):
            self._spawn(loop())

    async def stop(self) -> None:
        if self._lapse is not None:
            self._lapse.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def figures(self) -> dict:
        status = self.runner.status()
        return {
            "active": sum(status["active"].values()),
            "episodes_per_s_last_60s": status["episodes_per_s_last_60s"],
            "taken_over": self.taken_over,
            "fences": self.fences,
            # Replicas alive besides this one at its last beat: those that may take it over (its lease's length).
            "others_alive": self._others_alive,
        }

    async def _beat_forever(self) -> None:
        while True:
            sent = asyncio.get_running_loop().time()  # the clock of the lease's timer
            self._beating = True
            try:
                # A beat later than the lease renews nothing: given up then, whatever redis-py would still try.
                async with asyncio.timeout(MISSED_BEATS * self.interval_s):
                    reply = await self.coordination.beat(self.url, self.figures(), self.interval_s)
            except Exception as exc:  # Redis away, or a bug: the beats must go on
                log.warning("replica %s cannot beat (%s: %s)", self.id, type(exc).__name__, exc)
            else:
                self._beat_heard(sent, reply)
            finally:
                self._beating = False
            await asyncio.sleep(self.interval_s)  # a period, not a synchronisation

    def _beat_heard(self, sent: float, reply: BeatReply) -> None:
        """A beat sent at `sent` got through: the lease runs from then, as long as the replicas alive then (told by
        the beat) wait before they may take this one over; a fence ends (after the drop, if taken). A reply that
        came after that lease would have ended (a beat held up by the partition) renews nothing."""
        if reply.taken:
            self._taken_for_dead()
        self._others_alive = reply.others_alive
        self.producer.replicas_alive = reply.others_alive + 1  # admission takes turns with them
        beats = MISSED_BEATS if reply.others_alive else ALONE_MISSED_BEATS
        lease_s = (beats - FENCE_MARGIN_BEATS) * self.interval_s
        loop = asyncio.get_running_loop()
        if sent + lease_s <= loop.time():
            return  # the lease lapsed, or is about to (its timer fences): the next beat renews it
        if self._lapse is not None:
            self._lapse.cancel()
        self._lease_s = lease_s
        self._lapse = loop.call_at(sent + lease_s, self._lease_lapsed)
        if self.fenced:
            self.fenced = False
            log.warning(
                "replica %s beats again%s: it acts again",
                self.id,
                "" if reply.taken else " and was not taken over; what its fence stopped runs again here",
            )
            self.board.unfence()
            self.producer.unfence()

    def _lease_lapsed(self, graced: bool = False) -> None:
        self._lapse = None
        if self._beating and not graced:  # its answer may be read in a moment (FENCE_GRACE_BEATS)
            grace_s = FENCE_GRACE_BEATS * self.interval_s
            self._lapse = asyncio.get_running_loop().call_later(grace_s, self._lease_lapsed, True)
            return
        self.fenced = True
        self.fences += 1
        log.error(
            "replica %s has not beaten for %g s; fencing itself before another may take it over: it stops what "
            "it runs and acts again once it beats",
            self.id,
            self._lease_s,
        )
        self.board.fence()
        self.producer.fence()

    async def _watch_forever(self) -> None:
        while True:
            try:
                for dead in await self.coordination.claim_dead(hold_s=TAKEOVER_S):
                    self._spawn(self._take_over_bounded(dead))
            except Exception as exc:
                log.warning("replica %s cannot look for dead replicas: %s", self.id, exc)
            await asyncio.sleep(self.interval_s)  # a period, not a synchronisation

    def _taken_for_dead(self) -> None:
        log.error(
            "replica %s was taken for dead by another (its beats lapsed): what it ran runs elsewhere now; "
            "dropping it here",
            self.id,
        )
        self.board.disown_all()
        self.producer.disown_all()

    async def _take_over_bounded(self, dead: str) -> None:
        try:
            async with asyncio.timeout(TAKEOVER_S):
                await self.take_over(dead)
        except Exception as exc:  # given up: the next look, here or at another survivor, claims it again
            log.warning("replica %s: taking over %s failed (%s: %s)", self.id, dead, type(exc).__name__, exc)
            with contextlib.suppress(Exception):  # Redis away: the claim runs out by itself after TAKEOVER_S
                await self.coordination.release_claim(dead)

    async def take_over(self, dead: str) -> None:
        """Run again what `dead` held, and delete its sandboxes; then forget it."""
        jobs = await self.board.take_over(dead)
        prompts = await self.producer.take_over(dead)
        sandboxes = await self.sandboxes.delete_owned_by(dead)
        await self.coordination.forget_replica(dead)
        self.taken_over += 1
        log.warning(
            "replica %s took over for dead replica %s: %d jobs queued again, %d prompts run again, %d sandboxes "
            "deleted",
            self.id,
            dead,
            jobs,
            prompts,
            sandboxes,
        )

    async def describe(self) -> list[ReplicaState]:
        now, records = await self.coordination.replicas()
        return [
            ReplicaState(
                id=r.id,
                url=r.url,
                alive=r.alive(now),
                seen_s_ago=round(max(now - r.seen_at, 0.0), 3),
                figures=r.figures,
            )
            for r in sorted(records, key=lambda r: r.id)
        ]
