"""Sandboxes for episodes, spread over one or more sandbox runtime servers.

A new sandbox goes to the server holding the fewest of this service's sandboxes; a server that fails to
create one is skipped for the next attempt of the same episode, which is how init retries elsewhere.

Nothing is leaked: every sandbox carries the service's label (`prorl_service`) and a TTL from the caller (the
job's budget plus a margin), so the runtime reaps it even if this service dies; an episode cancelled while its
sandbox is being created deletes the sandbox once the creation returns; and a service starting with the same
id deletes whatever sandboxes its previous incarnation left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from sandbox_runtime.client import SandboxAPIError, SandboxClient
from sandbox_runtime.models import SandboxInfo

from ..tasks import Environment

log = logging.getLogger(__name__)
OWNER_LABEL = "prorl_service"


class SandboxServerError(Exception):
    """A runtime server could not create or prepare a sandbox; `url` names it so a retry can avoid it."""

    def __init__(self, url: str, message: str):
        super().__init__(f"{url}: {message}")
        self.url = url


@dataclass
class RuntimeServer:
    url: str
    client: SandboxClient
    active: int = 0
    failures: int = 0


class SandboxPool:
    def __init__(self, urls: list[str], token: str | None = None, owner: str = "prorl-rollout") -> None:
        if not urls:
            raise ValueError("at least one sandbox runtime URL is needed")
        self.owner = owner
        self.servers = [RuntimeServer(url.rstrip("/"), SandboxClient(url, token=token, timeout=120)) for url in urls]
        self._late_deletes: set[asyncio.Task[None]] = set()

    async def acquire(self, spec: dict[str, Any], exclude: set[str]) -> Environment:
        candidates = [s for s in self.servers if s.url not in exclude] or self.servers
        server = min(candidates, key=lambda s: (s.active, s.failures))
        spec = {**spec, "labels": {**spec.get("labels", {}), OWNER_LABEL: self.owner}}
        server.active += 1  # counted before the request, so concurrent inits spread over the servers
        creation = asyncio.ensure_future(server.client.create_sandbox(**spec))
        try:
            # Shielded: a cancel here must not abandon a sandbox the runtime goes on creating.
            info = await asyncio.shield(creation)
        except asyncio.CancelledError:
            server.active -= 1
            creation.add_done_callback(lambda done: self._delete_when_created(server, done))
            raise
        except SandboxAPIError as exc:
            server.active -= 1
            server.failures += 1
            raise SandboxServerError(server.url, f"cannot create a sandbox: {exc}") from exc
        return Environment(server.client, info.id, server.url, info.workdir)

    def _delete_when_created(self, server: RuntimeServer, creation: asyncio.Future[SandboxInfo]) -> None:
        if creation.cancelled() or creation.exception() is not None:
            return
        task = asyncio.ensure_future(self._delete_quietly(server, creation.result().id))
        self._late_deletes.add(task)
        task.add_done_callback(self._late_deletes.discard)

    async def _delete_quietly(self, server: RuntimeServer, sandbox_id: str) -> None:
        with contextlib.suppress(SandboxAPIError):
            await server.client.delete_sandbox(sandbox_id)

    async def delete_leftovers(self) -> int:
        """Delete every sandbox labelled with this service's id: a previous incarnation's, left by a crash."""
        deleted = 0
        for server in self.servers:
            try:
                mine = [b for b in await server.client.list_sandboxes() if b.labels.get(OWNER_LABEL) == self.owner]
                for box in mine:
                    await self._delete_quietly(server, box.id)
            except SandboxAPIError as exc:  # a runtime that is down took its sandboxes with it (or reaps them)
                log.warning("could not look for leftover sandboxes on %s: %s", server.url, exc)
                continue
            deleted += len(mine)
        if deleted:
            log.warning("deleted %d sandboxes left by an earlier run of %s", deleted, self.owner)
        return deleted

    async def release(self, env: Environment) -> None:
        """Delete the episode's sandbox. A server that is gone took its sandboxes with it."""
        server = next(s for s in self.servers if s.url == env.server_url)
        server.active -= 1
        with contextlib.suppress(SandboxAPIError):
            await server.client.delete_sandbox(env.sandbox_id)

    async def close(self) -> None:
        await asyncio.gather(*self._late_deletes, return_exceptions=True)
        for server in self.servers:
            await server.client.aclose()
