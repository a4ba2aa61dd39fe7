"""Requests to a peer that their owner can end at once, from outside, without cancelling the callers that wait for
them. A peer whose node vanished without a reset never answers, and nothing else ends a request before its own
timeout (a command's, or a whole turn's): the owner, having taken the peer for gone by its own signs (missed
heartbeats, failed health checks), ends them (`InFlight.end_all`) and each caller gets `CallEnded`, to fail over.

asyncio has no way to interrupt an awaited request but cancellation, and cancelling the caller's task would end
the caller (the episode) too: each request runs as a task of its own, which the owner cancels."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from .errors import ProrlError

T = TypeVar("T")


class CallEnded(ProrlError):
    """The request's owner ended it (`InFlight.end_all`); the message says why."""


class InFlight:
    """The requests in flight to one peer."""

    def __init__(self) -> None:
        self._calls: dict[asyncio.Future[Any], str | None] = {}  # each request -> why its owner ended it

    def __len__(self) -> int:
        return len(self._calls)

    async def run(self, request: Coroutine[Any, Any, T]) -> T:
        """Await `request` as a task of its own: its answer, or `CallEnded` once `end_all` ended it. A caller
        cancelled meanwhile cancels its request too."""
        call = asyncio.ensure_future(request)
        self._calls[call] = None
        try:
            return await call
        except asyncio.CancelledError:
            reason, current = self._calls.get(call), asyncio.current_task()
            if reason is not None and call.cancelled() and (current is None or not current.cancelling()):
                raise CallEnded(reason) from None
            call.cancel()  # the caller was cancelled: so is its request
            raise
        finally:
            del self._calls[call]

    def end_all(self, reason: str) -> None:
        """End every request in flight now: their callers get `CallEnded(reason)`."""
        for call in self._calls:
            self._calls[call] = reason
            call.cancel()
