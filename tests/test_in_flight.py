"""Requests an owner ends from outside (server_kit/in_flight.py), as the sandbox client and the LLM pool use them
for a peer gone silent: the caller gets `CallEnded` and lives on; a cancelled caller cancels its request."""

from __future__ import annotations

import asyncio

import pytest

from server_kit.in_flight import CallEnded, InFlight


async def never_answered(started: asyncio.Event, ended: list[str]) -> None:
    started.set()
    try:
        await asyncio.Event().wait()  # a peer that vanished: no answer, no reset
    finally:
        ended.append("request")


async def test_requests_ended_by_their_owner_raise_call_ended_in_their_callers_which_live_on():
    calls, ended = InFlight(), []
    starts = [asyncio.Event(), asyncio.Event()]
    callers = [asyncio.ensure_future(calls.run(never_answered(s, ended))) for s in starts]
    for started in starts:
        await started.wait()
    assert len(calls) == 2
    calls.end_all("the peer failed its health checks")
    for caller in callers:
        with pytest.raises(CallEnded, match="health checks"):
            await caller
    assert ended == ["request", "request"] and len(calls) == 0 and not any(c.cancelled() for c in callers)
    assert await calls.run(asyncio.sleep(0, result="answered")) == "answered"  # later requests go on as ever


async def test_a_cancelled_caller_cancels_its_request():
    calls, ended, started = InFlight(), [], asyncio.Event()
    caller = asyncio.ensure_future(calls.run(never_answered(started, ended)))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert ended == ["request"] and len(calls) == 0
