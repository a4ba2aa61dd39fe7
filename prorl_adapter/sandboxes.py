"""Sandboxes for episodes, spread over one or more sandbox runtime servers.

A new sandbox goes to the server holding the fewest of this service's sandboxes; a server that fails to
create one is skipped for the next attempt of the same episode, which is how init retries elsewhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from sandbox_runtime.client import SandboxAPIError, SandboxClient

from .tasks import Environment


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
    def __init__(self, urls: list[str], token: str | None = None) -> None:
        if not urls:
            raise ValueError("at least one sandbox runtime URL is needed")
        self.servers = [RuntimeServer(url.rstrip("/"), SandboxClient(url, token=token, timeout=120)) for url in urls]

    async def acquire(self, spec: dict[str, Any], exclude: set[str]) -> Environment:
        candidates = [s for s in self.servers if s.url not in exclude] or self.servers
        server = min(candidates, key=lambda s: (s.active, s.failures))
        server.active += 1  # counted before the request, so concurrent inits spread over the servers
        try:
            info = await server.client.create_sandbox(**spec)
        except SandboxAPIError as exc:
            server.active -= 1
            server.failures += 1
            raise SandboxServerError(server.url, f"cannot create a sandbox: {exc}") from exc
        return Environment(server.client, info.id, server.url, info.workdir)

    async def release(self, env: Environment) -> None:
        """Delete the episode's sandbox. A server that is gone took its sandboxes with it."""
        server = next(s for s in self.servers if s.url == env.server_url)
        server.active -= 1
        with contextlib.suppress(SandboxAPIError):
            await server.client.delete_sandbox(env.sandbox_id)

    async def close(self) -> None:
        for server in self.servers:
            await server.client.aclose()
