"""Registration: a runtime that announces itself to rollout services instead of being listed in their flags.

Started with `--register URL` (one or more rollout services, or replicas of one), the runtime sends a heartbeat
(`PUT /v1/runtimes/{name}` on the service's API: its URL, capacity and load) to every one of them every
`interval_s` seconds, and a last one saying it is leaving when it shuts down cleanly. A service places
sandboxes only on runtimes it has heard from lately, so a runtime that dies simply stops being used, and one
that starts on a new node is used within one interval. Replicas sharing their state (Redis) share what any of
them heard, so reaching one of them is enough; the heartbeat still goes to each, as nothing here knows whether
they share.

Registering needs the services' registration token (`token`), whatever else they require: whatever registers is
sent episodes' files and believed about their rewards. It is presented only to register: every registered runtime
holds it. Each heartbeat carries the runtime's own API token (`api_token`: its --token, or a random one made at
start-up), and a service calls the runtime with that token alone, so no registered runtime can open another's
sandboxes. A service keeps a name bound to the URL it registered with until it leaves or lapses (409 otherwise).

The runtime knows nothing about RL: this is one periodic HTTP call, and the service owns what it means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from .models import RuntimeHeartbeat

log = logging.getLogger(__name__)


@dataclass
class RegistrationConfig:
    services: list[str]  # rollout service URLs
    name: str  # how the services know this runtime: stable across restarts on the same node and port
    url: str  # where the services reach it
    token: str | None = None  # the services' registration token (not their API token)
    interval_s: float = 2.0
    api_token: str | None = None  # this runtime's own token, which the services call it with


class Registration:
    """The heartbeat loop of one runtime; `load()` says what it holds now: (capacity, sandboxes)."""

    def __init__(self, config: RegistrationConfig, load: Callable[[], tuple[int, int]], backend: str, version: str):
        self.config = config
        self._load = load
        self._backend = backend
        self._version = version
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._reached: dict[str, bool] = {}  # service -> whether the last heartbeat got through (logged on change)

    def heartbeat(self, leaving: bool = False) -> RuntimeHeartbeat:
        capacity, sandboxes = self._load()
        return RuntimeHeartbeat(
            url=self.config.url,
            capacity=capacity,
            sandboxes=sandboxes,
            backend=self._backend,
            version=self._version,
            interval_s=self.config.interval_s,
            leaving=leaving,
            token=self.config.api_token,
        )

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        timeout = aiohttp.ClientTimeout(total=max(self.config.interval_s, 1.0))
        self._http = aiohttp.ClientSession(headers=headers, timeout=timeout)
        self._task = asyncio.create_task(self._beat_forever())

    async def stop(self) -> None:
        """Stop beating and tell every service that this runtime is leaving (best effort: a service that does
        not hear it stops using the runtime after three intervals anyway)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._send_all(self.heartbeat(leaving=True))
            await self._http.close()

    async def _beat_forever(self) -> None:
        while True:
            await self._send_all(self.heartbeat())
            await asyncio.sleep(self.config.interval_s)  # a period, not a synchronisation

    async def _send_all(self, beat: RuntimeHeartbeat) -> None:
        await asyncio.gather(*(self._send(service, beat) for service in self.config.services))

    async def _send(self, service: str, beat: RuntimeHeartbeat) -> None:
        assert self._http is not None
        url = f"{service.rstrip('/')}/v1/runtimes/{self.config.name}"
        problem = None
        try:
            async with self._http.put(url, json=beat.model_dump(mode="json")) as reply:
                if reply.status >= 300:
                    problem = f"answered {reply.status}: {(await reply.text())[:300]}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            problem = f"unreachable: {type(exc).__name__}: {exc}"
        reached = problem is None
        if self._reached.get(service) != reached:  # say it once per change, not every interval
            if reached:
                log.info("registered with %s as %s", service, self.config.name)
            else:
                log.warning("cannot register with %s: %s", service, problem)
        self._reached[service] = reached
