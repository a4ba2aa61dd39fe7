"""This process as one replica of the rollout service: it says it is alive, follows the shared policy version,
and takes over the work of replicas that die.

Every `interval_s` a replica beats (with its figures, which `GET /v1/status` of any replica shows) and asks the
coordination for replicas whose beats lapsed; each dead one is handed to exactly one survivor, which

1. queues the dead one's jobs again, at the head of the shared queue (`JobBoard.take_over`),
2. runs its admitted prompts and serves again the entries it had leased (`Producer.take_over`),
3. deletes its sandboxes on every live runtime (they carry its id as their owner label),

and then forgets it. With `memory://` the replica is alone and nothing of this happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..models import ReplicaState
from .decoupled import Producer
from .job_board import JobBoard
from .pipeline import RolloutPipeline
from .sandboxes import SandboxPool
from .storage.buffer import ExperienceBufferError
from .storage.coordination import Coordination

log = logging.getLogger(__name__)


class Replica:
    def __init__(
        self,
        coordination: Coordination,
        pipeline: RolloutPipeline,
        board: JobBoard,
        producer: Producer,
        sandboxes: SandboxPool,
        url: str | None,
        interval_s: float = 1.0,
    ) -> None:
        self.coordination = coordination
        self.pipeline = pipeline
        self.board = board
        self.producer = producer
        self.sandboxes = sandboxes
        self.url = url
        self.interval_s = interval_s
        self.taken_over = 0  # dead replicas this one took over
        self._task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.coordination.replica_id

    async def start(self) -> None:
        self.coordination.on_policy_version(self._follow_version)
        with contextlib.suppress(ExperienceBufferError):  # Redis away: the loop keeps trying
            self._follow_version(await self.coordination.policy_version())
            await self._beat()
        self._task = asyncio.create_task(self._beat_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _follow_version(self, version: int) -> None:
        self.pipeline.policy_version = version

    def figures(self) -> dict:
        status = self.pipeline.status()
        return {
            "active": sum(status["active"].values()),
            "episodes_per_s_last_60s": status["episodes_per_s_last_60s"],
            "taken_over": self.taken_over,
        }

    async def _beat(self) -> None:
        await self.coordination.beat(self.url, self.figures(), self.interval_s)

    async def _beat_forever(self) -> None:
        while True:
            try:
                await self._beat()
                for dead in await self.coordination.claim_dead():
                    await self.take_over(dead)
            except ExperienceBufferError as exc:
                log.warning("replica %s cannot reach the shared state: %s", self.id, exc)
            await asyncio.sleep(self.interval_s)  # a period, not a synchronisation

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
