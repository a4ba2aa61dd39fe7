"""Virtual time for unit tests: an asyncio loop whose clock jumps to its next timer whenever nothing is runnable.

`@on_virtual_time` turns an `async def` test into a plain one that runs on such a loop. Every wait on the loop's
clock (`asyncio.sleep`, `wait_for`, `asyncio.timeout`, a long poll, a job's time budget, a lease) then takes no
real time, while the code under test runs for real and in its real order. `time.monotonic` reads the same clock
during the test, so code that measures deadlines with it (the pipeline's budget, the producer's leases, the LLM
pool's wait for a healthy server) agrees with the loop.

The clock never jumps past work in progress: it jumps only when no socket is readable, no callback is due and no
thread started through `run_in_executor` (the tokenizer thread, `asyncio.to_thread`) is still running; while one
is, time flows in real time. The in-process HTTP stand-ins talk over loopback sockets of the same loop, whose
data is there as soon as it is written, and a short real grace period before each jump covers the rest.

A test waiting for something that never happens fails at VIRTUAL_LIMIT_S of virtual time (at once, in real
time) instead of hanging; with no timer at all (only while the loop shuts down) it fails after DEADLOCK_S of
real time without a thread or a socket to wake it.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any
from unittest import mock

import pytest

VIRTUAL_LIMIT_S = 2 * 3600.0  # of virtual time per test
GRACE_S = 0.001  # real time given to the kernel before the clock jumps
DEADLOCK_S = 5.0  # real time without timers, events or threads after which a test is deadlocked

_real_monotonic = time.monotonic


class VirtualClock:
    """Real monotonic time plus every stretch the loop skipped."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return _real_monotonic() + self.skipped


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.threads = 0  # executor jobs in progress

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if self.threads:  # a thread wakes the loop through its self-pipe when it is done
            return super().select(timeout)
        if timeout is None:
            ready = super().select(DEADLOCK_S)
            if not ready:
                raise RuntimeError("deadlock: nothing is runnable, no timer is set and no thread is working")
            return ready
        ready = super().select(min(GRACE_S, timeout))
        if not ready and timeout > GRACE_S:
            self.clock.skipped += timeout - GRACE_S
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = VirtualClock()
        self._jumping = _JumpingSelector(self.clock)
        super().__init__(self._jumping)

    def time(self) -> float:
        return self.clock()

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        future = super().run_in_executor(executor, func, *args)
        self._jumping.threads += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any]) -> None:
        self._jumping.threads -= 1


def run_virtual(main: Coroutine[Any, Any, Any], limit_s: float = VIRTUAL_LIMIT_S) -> Any:
    """Run `main` to completion on a fresh virtual-time loop, with `time.monotonic` reading its clock."""
    loop = VirtualTimeLoop()

    async def bounded() -> Any:
        try:
            async with asyncio.timeout(limit_s) as limit:
                return await main
        except TimeoutError:
            if limit.expired():
                pytest.fail(f"the test was still running after {limit_s:g} s of virtual time")
            raise

    with mock.patch("time.monotonic", loop.clock), asyncio.Runner(loop_factory=lambda: loop) as runner:
        return runner.run(bounded())


def on_virtual_time(test: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    """Decorate an `async def` test to run it on virtual time (pytest sees a plain function)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        return run_virtual(test(*args, **kwargs))

    return run
