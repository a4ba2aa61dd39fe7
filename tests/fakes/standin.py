"""What the HTTP stand-ins share: an aiohttp app served on 127.0.0.1 (port 0) by the test's own event loop, a way
to wait until the stand-in has seen something (no polling, no sleeping), and the cues that make a request fail
(`Fail`) or wait (`HANG`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from aiohttp import web


@dataclass(frozen=True)
class Hang:
    """Hold the request until the test calls `release()` (or the stand-in stops), then answer `then` (the LLM
    stand-in: a turn's text, by default a call of `finish`; the sandbox stand-in: what it would have answered)."""

    then: Any = None


HANG = Hang()


@dataclass(frozen=True)
class Fail:
    """Answer the request with this HTTP error status instead."""

    status: int = 500
    message: str = "injected failure"


class StandIn:
    def __init__(self) -> None:
        self.app = web.Application()
        self.url = ""
        self.held = 0  # requests held now
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Event()
        self._released = asyncio.Event()

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        """Stop serving: from now on connections to `url` are refused."""
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def changed(self) -> None:
        """Wake whoever waits in `until`; called on every request the stand-in sees."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition()` holds; it is checked again after each request."""
        while not condition():
            await self._changed.wait()

    async def hold(self) -> None:
        self.held += 1
        self.changed()
        try:
            await self._released.wait()
        finally:
            self.held -= 1

    def release(self) -> None:
        """Let every held request go on."""
        self._released.set()
        self._released = asyncio.Event()
