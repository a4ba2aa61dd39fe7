"""Decoupled mode: the service keeps producing trajectories for upcoming prompts into the experience buffer
while the trainer consumes batches from it; admission control bounds how far ahead it runs.

    trainer ─ POST /v1/prompts ─> [upcoming prompts] ─ admitted? ─> pipeline ─> buffer ─ POST /v1/batches ─> trainer
                                                                                 (ack after training)

Before each new episode starts, every plugin is asked `prorl_admit_episode` (the staleness plugin's pace
mode answers False while starting one more could make a trajectory staler than K). A held episode is asked
again when an episode finishes, a batch is taken or acknowledged, or the policy version changes. When the
trainer takes a batch, `prorl_trajectory_weight` weighs each trajectory; a weight of 0 drops it (it is
acknowledged as consumed, so it never comes back) and the rest go out with their weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

from .buffer import BufferedTrajectory, ExperienceBuffer
from .hookspecs import AdmissionState, TrajectoryWeight, hookimpl
from .models import JobRequest
from .pipeline import Job, RolloutPipeline

log = logging.getLogger(__name__)


@dataclass
class WeightedTrajectory:
    entry: BufferedTrajectory
    weight: TrajectoryWeight


@dataclass
class ProducerStats:
    upcoming: int = 0
    in_flight: int = 0
    held_back: bool = False
    produced: int = 0
    filtered: int = 0  # episodes that failed (infrastructure): not put into the buffer
    dropped: int = 0  # trajectories weighed 0 when taken (too stale)
    versions_in_flight: list[int] = field(default_factory=list)


class Producer:
    """Feeds admitted prompts to the pipeline and finished trajectories to the buffer.

    It is also a plugin (it implements `prorl_policy_version_changed`), registered by the service so that a
    new policy version wakes held-back episodes.
    """

    def __init__(self, pipeline: RolloutPipeline, buffer: ExperienceBuffer) -> None:
        self.pipeline = pipeline
        self.buffer = buffer
        self._upcoming: deque[JobRequest] = deque()
        self._in_flight: dict[str, int] = {}  # job id -> the policy version it was admitted at
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deliveries: set[asyncio.Task[None]] = set()
        self.stats = ProducerStats()
        pipeline.on_finished.append(self._on_finished)

    # -- life cycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._produce_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*self._deliveries, return_exceptions=True)

    @hookimpl
    def prorl_policy_version_changed(self, version: int) -> None:
        self.wake()

    def wake(self) -> None:
        self._wakeup.set()

    # -- producing --------------------------------------------------------------------------------------
    def enqueue(self, requests: list[JobRequest]) -> int:
        self._upcoming.extend(requests)
        self.wake()
        return len(self._upcoming)

    async def _produce_forever(self) -> None:
        while True:
            self._wakeup.clear()
            while self._upcoming and await self._admitted():
                job, _ = self.pipeline.submit(self._upcoming.popleft())
                self._in_flight[job.id] = self.pipeline.policy_version
            self.stats.held_back = bool(self._upcoming)
            await self._wakeup.wait()

    async def _admitted(self) -> bool:
        state = AdmissionState(
            current_version=self.pipeline.policy_version,
            in_flight_versions=sorted(self._in_flight.values()),
            buffered_versions=await self.buffer.buffered_versions(),
        )
        return all(verdict is not False for verdict in self.pipeline.hooks.prorl_admit_episode(state=state))

    def _on_finished(self, job: Job) -> None:
        if job.id in self._in_flight:
            task = asyncio.get_running_loop().create_task(self._deliver(job))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, job: Job) -> None:
        try:
            if job.result is not None and not job.result.filter:
                await self.buffer.put(job.result)
                self.stats.produced += 1
            else:
                self.stats.filtered += 1
        except Exception:
            log.exception("job %s: could not put its trajectory into the buffer", job.id)
            self.stats.filtered += 1
        finally:
            # Only now: while it was on its way to the buffer it still counted as in flight for admission.
            self._in_flight.pop(job.id, None)
            self.wake()

    # -- consuming --------------------------------------------------------------------------------------
    async def take_batch(
        self, size: int, timeout: float | None, current_logprobs: dict[str, list[float]] | None = None
    ) -> list[WeightedTrajectory]:
        """Up to `size` trajectories with their weights; the ones weighed 0 are dropped (and acknowledged)."""
        entries = await self.buffer.take(size, timeout)
        version = self.pipeline.policy_version
        kept: list[WeightedTrajectory] = []
        dropped: list[str] = []
        for entry in entries:
            logprobs = (current_logprobs or {}).get(entry.id)
            verdicts = self.pipeline.hooks.prorl_trajectory_weight(
                trajectory=entry.trajectory, current_version=version, current_logprobs=logprobs
            )
            weight = TrajectoryWeight.combine(verdicts, len(entry.trajectory.response_ids))
            if weight.sample == 0.0:
                dropped.append(entry.id)
            else:
                kept.append(WeightedTrajectory(entry, weight))
        if dropped:
            await self.buffer.ack(dropped)
            self.stats.dropped += len(dropped)
        self.wake()
        return kept

    async def ack(self, ids: list[str]) -> int:
        acknowledged = await self.buffer.ack(ids)
        self.wake()
        return acknowledged

    def snapshot(self) -> ProducerStats:
        self.stats.upcoming = len(self._upcoming)
        self.stats.in_flight = len(self._in_flight)
        self.stats.versions_in_flight = sorted(self._in_flight.values())
        return self.stats
