"""One sandbox: its directories, its backend, and its named bash sessions."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from .backends.base import Backend, SandboxDirs
from .files import SandboxFiles
from .models import SandboxInfo, SandboxSpec, SessionInfo
from .session import SessionError, ShellSession

RECORD = "record.json"


class Sandbox:
    def __init__(self, dirs: SandboxDirs, spec: SandboxSpec, backend: Backend, output_limit: int) -> None:
        self.id = dirs.id
        self.dirs = dirs
        self.spec = spec
        self.backend = backend
        self.created_at = time.time()
        self.last_used = time.monotonic()
        self.closing = False
        self.deleted = asyncio.Event()
        self._output_limit = output_limit
        self._sessions: dict[str, ShellSession] = {}
        self._starting: dict[str, asyncio.Task[ShellSession]] = {}
        self.workdir = backend.workdir(dirs, spec)
        self.files = SandboxFiles(backend.visible_paths(dirs, spec), self.workdir)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    async def session(self, name: str) -> ShellSession:
        """The live session `name`, started (or restarted after it died) on first use."""
        self.touch()
        current = self._sessions.get(name)
        if current is not None and not current.dead:
            return current
        if name not in self._starting:  # concurrent first calls share one start
            self._starting[name] = asyncio.ensure_future(self._start(name))
        try:
            return await asyncio.shield(self._starting[name])
        finally:
            self._starting.pop(name, None)

    async def _start(self, name: str) -> ShellSession:
        if self.closing:
            raise SessionError(f"sandbox {self.id} is being deleted", status=404)
        old = self._sessions.pop(name, None)
        if old is not None:
            await old.close()
        session = ShellSession(name, self.backend.launch(self.dirs, self.spec), self._output_limit)
        await session.start()
        if self.closing:  # deleted while the shell was starting
            await session.close()
            raise SessionError(f"sandbox {self.id} is being deleted", status=404)
        self._sessions[name] = session
        self.write_record()
        return session

    def existing_session(self, name: str) -> ShellSession:
        session = self._sessions.get(name)
        if session is None or session.dead:
            raise SessionError(f"sandbox {self.id} has no live session {name!r}", status=404)
        self.touch()
        return session

    async def close_session(self, name: str) -> bool:
        session = self._sessions.pop(name, None)
        if session is None:
            return False
        await session.close()
        self.write_record()
        return True

    async def close(self) -> None:
        """Kill every session (each waits until its processes are gone), then the backend's own state."""
        self.closing = True
        for task in list(self._starting.values()):
            await asyncio.gather(task, return_exceptions=True)
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions))
        await self.backend.destroy(self.dirs, self.spec)

    def write_record(self) -> None:
        """What a restarted server needs to reap this sandbox's processes: pids with their start times."""
        record = {
            "id": self.id,
            "backend": self.backend.name,
            "spec": self.spec.model_dump(mode="json"),
            "sessions": {n: [s.pid, s.started_at] for n, s in self._sessions.items() if not s.dead},
        }
        tmp = self.dirs.root / (RECORD + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.dirs.root / RECORD)

    @staticmethod
    def read_record(root: Path) -> dict | None:
        try:
            return json.loads((root / RECORD).read_text())
        except (OSError, ValueError):
            return None

    def info(self) -> SandboxInfo:
        spec = self.spec
        return SandboxInfo(
            id=self.id,
            backend=self.backend.name,
            isolated=self.backend.isolated,
            image=spec.image,
            workdir=self.workdir,
            network=spec.network,
            limits=spec.limits,
            labels=spec.labels,
            created_at=self.created_at,
            ttl_s=spec.ttl_s,
            idle_timeout_s=spec.idle_timeout_s,
            sessions=[
                SessionInfo(name=n, busy=s.busy, pid=s.pid, cwd=s.cwd) for n, s in self._sessions.items() if not s.dead
            ],
        )

    def expired(self, now_wall: float, now_mono: float) -> str | None:
        """Why the reaper should delete this sandbox now, or None."""
        if self.spec.ttl_s is not None and now_wall - self.created_at > self.spec.ttl_s:
            return "ttl"
        busy = any(s.busy for s in self._sessions.values())
        if self.spec.idle_timeout_s is not None and not busy and now_mono - self.last_used > self.spec.idle_timeout_s:
            return "idle"
        return None
