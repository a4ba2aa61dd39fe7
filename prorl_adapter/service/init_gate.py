"""Back-pressure between the init and run stages: a sandbox is made only when the run stage can take its episode.

Without it the init workers make a sandbox for every queued job as fast as they can: with a backlog of thousands
of jobs, hundreds of sandboxes sit idle in the run queue (measured: 292 alive 5 s after 300 jobs were submitted
with 8 run workers), exhausting the runtimes' disk and memory, and a job that waits there longer than its
sandbox's TTL loses the sandbox it was given.

The rule: an init worker takes a job only while

    jobs ahead of the run stage + episodes in it + episodes waiting for an eval worker  <  run limit + margin

where a job is *ahead* from the moment an init worker takes it until it gets a run slot (or ends before). Every
job counted there holds (or is making) a sandbox, so the live sandboxes of this service stay within the run
stage's limit, plus the margin, plus the eval workers' (those being graded), whatever the backlog. The margin is
what keeps the run stage fed while the next sandboxes are made; the run limit is the adaptive one where it moves
(adaptive_concurrency.py). A slow eval stage holds init back too: what the run stage finishes waits for an eval
worker holding its sandbox, and counts. Warm sandboxes (warm_sandboxes.py) are the way to run ahead of demand;
they are made apart from this gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..models import InitGateState
from .adaptive_concurrency import RunLimiter


class InitGate:
    def __init__(self, limiter: RunLimiter, margin: int | None, waiting_for_eval: Callable[[], int]) -> None:
        self._limiter = limiter
        self._margin = margin  # None: a quarter of the run limit, at least 1
        self._waiting_for_eval = waiting_for_eval
        self.ahead = 0  # jobs counted: taken by init, or about to be (`reserved`)
        self.reserved = 0  # init workers past the gate and waiting for a job in the queue: room kept for it
        self.waiting = 0
        self._changed = asyncio.Event()
        limiter.on_change = self.changed

    def margin(self) -> int:
        return self._margin if self._margin is not None else max(1, self._limiter.limit // 4)

    def bound(self) -> int:
        """The most jobs ahead of the run stage, in it and waiting for eval, together."""
        return self._limiter.limit + self.margin()

    def counted(self) -> int:
        return self.ahead + self._limiter.held + self._waiting_for_eval()

    def _has_room(self) -> bool:
        return self.counted() < self.bound()

    async def enter(self) -> None:
        """Wait for room, then keep it for the caller's next job (`taken` once it has it, `leave` if it never
        comes)."""
        self.waiting += 1
        try:
            while not self._has_room():
                await self._changed.wait()
        finally:
            self.waiting -= 1
        self.ahead += 1
        self.reserved += 1

    def taken(self) -> None:
        """The room kept is a job's now."""
        self.reserved -= 1

    def cancel(self) -> None:
        """The room kept was never used (the worker stopped)."""
        self.reserved -= 1
        self.leave()

    def leave(self) -> None:
        """One job is no longer ahead: it got its run slot, or it ended (or never came)."""
        self.ahead -= 1
        self.changed()

    def changed(self) -> None:
        """Something the rule reads changed (a run slot freed, the limit moved, eval took a job): ask again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def describe(self) -> InitGateState:
        return InitGateState(
            bound=self.bound(),
            margin=self.margin(),
            ahead=self.ahead - self.reserved,
            running=self._limiter.held,
            waiting_for_eval=self._waiting_for_eval(),
            waiting=self.waiting,
        )
