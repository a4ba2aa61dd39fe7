"""One sandbox: its directories, its backend, its named bash sessions and its one-shot runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from .backends.base import ONESHOT_ARGV, Backend, SandboxDirs
from .files import SandboxFiles
from .models import RunRequest, RunResult, SandboxInfo, SandboxSpec, SessionInfo
from .oneshot import run_once, run_script
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
        self._runs: set[asyncio.Task[RunResult]] = set()
        self.workdir = backend.workdir(dirs, spec)
        owner = None if dirs.uid is None else (dirs.uid, dirs.uid)
        self.files = SandboxFiles(backend.visible_paths(dirs, spec), self.workdir, owner=owner)

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

    async def run(self, request: RunRequest, timeout: float, max_output: int) -> RunResult:
        """A one-shot run (oneshot.py): a fresh process whose exit status comes from waitpid."""
        if self.closing:
            raise SessionError(f"sandbox {self.id} is being deleted", status=404)
        self.touch()
        argv = request.argv or ["bash", "--norc", "--noprofile", "-c", request.script or ""]
        launch = self.backend.launch(self.dirs, self.spec, ONESHOT_ARGV)
        script = run_script(launch, request.cwd or self.workdir, request.env, argv)
        task = asyncio.ensure_future(run_once(launch, script, timeout, max_output))
        self._runs.add(task)  # a delete cancels it, and its process with it
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._runs.discard(task)
            self.touch()

    async def end_processes(self) -> list[str]:
        """End every process of the sandbox: each session (a daemon it started too) and each one-shot run.
        The sandbox stays; a later command starts a fresh session. Returns the names of the sessions ended."""
        ended = await self._stop_sessions_and_runs()
        await self.backend.end_processes(self.dirs, self.spec)
        self.write_record()
        return ended

    async def _stop_sessions_and_runs(self) -> list[str]:
        for task in list(self._starting.values()):
            await asyncio.gather(task, return_exceptions=True)
        sessions, self._sessions = self._sessions, {}
        runs, self._runs = list(self._runs), set()
        for task in runs:
            task.cancel()
        await asyncio.gather(*(s.close() for s in sessions.values()), *runs, return_exceptions=True)
        return sorted(sessions)

    async def wipe(self) -> list[str]:
        """End every process, then empty the workspace and /tmp: the sandbox is as it was when created."""
        ended = await self.end_processes()
        for directory in (self.dirs.workspace, self.dirs.tmp):
            await asyncio.to_thread(empty_directory, directory)
        return ended

    async def close(self) -> None:
        """Kill every session and run (each waits until its processes are gone), then the backend's own state."""
        self.closing = True
        await self._stop_sessions_and_runs()
        await self.backend.destroy(self.dirs, self.spec)

    def write_record(self) -> None:
        """What a restarted server needs to reap this sandbox's processes: pids with their start times."""
        record = {
            "id": self.id,
            "backend": self.backend.name,
            "spec": self.spec.model_dump(mode="json"),
            "uid": self.dirs.uid,
            "sessions": {n: [s.pid, s.started_at] for n, s in self._sessions.items() if not s.dead},
        }
        tmp = self.dirs.root / (RECORD + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.chmod(0o600)
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


def empty_directory(directory: Path) -> None:
    """Remove everything inside `directory`, never following a link (shutil.rmtree works on fds here), also
    entries whose owner made them unwritable (an unprivileged server owns its sandboxes' files: it makes each
    directory writable again and retries). Call it only once every process that could write there is gone."""

    def writable_again(func, path, _exc_info):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(path)

    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, onerror=writable_again)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
