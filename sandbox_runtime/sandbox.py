"""One sandbox: its directories, its backend, its named bash sessions and its one-shot runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

from server_kit.errors import ApiError

from .backends.base import ONESHOT_ARGV, SHELL_ARGV, Backend, SandboxDirs
from .cgroups import join_argv
from .files import SandboxFiles
from .host_tree import SeedError, empty_directory, seed_workspace
from .models import RunRequest, RunResult, SandboxInfo, SandboxSpec, SessionInfo
from .oneshot import run_once, run_script
from .session import Launch, SessionError, ShellSession

log = logging.getLogger(__name__)

RECORD = "record.json"
# What bash prints when its memory limit keeps it from starting (xmalloc failing while it reads its environment).
# The other limits cannot: bash opens no file and starts no process before its first command, and their
# minimums (models.Limits) leave room for that command.
OUT_OF_MEMORY = "cannot allocate"
T = TypeVar("T")


class InsufficientStorage(ApiError):
    """The server's state disk is full: what the request needed could not be written there (507)."""

    status = 507


@contextlib.contextmanager
def state_disk(what: str) -> Iterator[None]:
    """Turn a full state disk (ENOSPC, EDQUOT) met while doing `what` into a 507 that says so; other errors
    pass through as they are."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientStorage(f"no space left on the server's state disk to {what} ({exc.strerror})") from None
        raise


class Sandbox:
    def __init__(self, dirs: SandboxDirs, spec: SandboxSpec, backend: Backend, output_limit: int) -> None:
        self.id = dirs.id
        self.dirs = dirs
        self.spec = spec
        self.backend = backend
        self.created_at = time.time()
        self.last_used = time.monotonic()
        self.closing = False
        self.started = False  # a shell of it started once: with this spec, the sandbox works
        self.created = False  # its creation returned (the reaper leaves a sandbox alone until then)
        self.deleted = asyncio.Event()
        # Its memory cgroup (cgroups.py), which every process of it starts in; None where the server has none.
        self.cgroup: Path | None = None
        self._output_limit = output_limit
        self._sessions: dict[str, ShellSession] = {}
        self._starting: dict[str, asyncio.Task[ShellSession]] = {}
        self._runs: set[asyncio.Task[RunResult]] = set()
        # A reset (a wipe, an end of processes) is kept apart from everything else done in the sandbox: while
        # one is under way (`_open` clear) new commands, runs and file operations wait for its end, and it
        # starts only once the file operations in flight (`_file_ops`) are done. Resets run one at a time.
        self._open = asyncio.Event()
        self._open.set()
        self._file_ops = 0
        self._no_file_ops = asyncio.Event()
        self._no_file_ops.set()
        self._reset_lock = asyncio.Lock()
        self._resets: set[asyncio.Task[list[str]]] = set()
        self.workdir = backend.workdir(dirs, spec)
        owner = None if dirs.uid is None else (dirs.uid, dirs.uid)
        self.files = SandboxFiles(backend.visible_paths(dirs, spec), self.workdir, owner=owner)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    async def session(self, name: str) -> ShellSession:
        """The live session `name`, started (or restarted after it died) on first use."""
        self.touch()
        await self._passage()
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
        launch = self._launch(SHELL_ARGV)
        session = ShellSession(name, launch, self._output_limit, self.spec.forwards)
        try:
            await session.start()
        except SessionError as exc:
            raise self._start_failure(exc) from None
        self.started = True
        if self.closing:  # deleted while the shell was starting
            await session.close()
            raise SessionError(f"sandbox {self.id} is being deleted", status=404)
        self._sessions[name] = session
        self.write_record()
        return session

    def _start_failure(self, failure: SessionError) -> SessionError:
        """What to answer when a shell did not start. The spec's memory limit that cannot hold the shell with
        its env is the client's to fix (400, naming the limit). A sandbox whose shells started before worked
        with this spec: what runs in it changed it (a workdir made unreadable, say), which a wipe undoes (409).
        Anything else is the server's (as it came), unless the sandbox is being deleted meanwhile."""
        if self.closing:
            return SessionError(f"sandbox {self.id} is being deleted", status=404)
        memory = self.spec.limits.memory_mb
        if memory is not None and OUT_OF_MEMORY in str(failure):
            return SessionError(
                f"limits.memory_mb={memory} is too low for the sandbox's shell with this env: raise it, or send a "
                f"smaller env ({failure})",
                400,
            )
        if self.started and failure.status >= 500:
            return SessionError(
                f"the sandbox's shell no longer starts ({failure}): what ran in it may have changed it (a workdir "
                f"made unreadable, say); wipe it (POST /v1/sandboxes/{self.id}/wipe) or delete it",
                409,
            )
        return failure

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
        await self._passage()
        if self.closing:
            raise SessionError(f"sandbox {self.id} is being deleted", status=404)
        self.touch()
        argv = request.argv or ["bash", "--norc", "--noprofile", "-c", request.script or ""]
        launch = self._launch(ONESHOT_ARGV)
        script = run_script(launch, request.cwd or self.workdir, request.env, argv)
        task = asyncio.ensure_future(run_once(launch, script, timeout, max_output))
        self._runs.add(task)  # a delete cancels it, and its process with it
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._runs.discard(task)
            self.touch()

    def _launch(self, command: list[str]) -> Launch:
        """The backend's launch of `command`, started inside the sandbox's memory cgroup where it has one: the
        launcher joins it before it execs, so nothing of the sandbox ever runs outside (cgroups.join_argv)."""
        launch = self.backend.launch(self.dirs, self.spec, command)
        if self.cgroup is None:
            return launch
        return dataclasses.replace(launch, argv=[*join_argv(self.cgroup), *launch.argv])

    async def _passage(self) -> None:
        """Return once no reset is under way. Checked again after each wait: a reset may begin between the wake-up
        and the resumption, and what follows the return must not await before it registers its work."""
        while not self._open.is_set():
            await self._open.wait()

    async def in_thread(self, function: Callable[..., T], *args: object) -> T:
        """`function(*args)` in a thread, as the file API runs its work: never during a reset, and a reset waits
        for it. A thread cannot be stopped midway, so a cancelled caller leaves it to finish before any reset
        may begin (an upload racing a wipe would otherwise land in the emptied workspace, or half of it)."""
        await self._passage()
        self._file_ops += 1
        self._no_file_ops.clear()
        work = asyncio.ensure_future(asyncio.to_thread(function, *args))
        work.add_done_callback(self._file_op_done)
        return await asyncio.shield(work)

    def _file_op_done(self, _: object) -> None:
        self._file_ops -= 1
        if not self._file_ops:
            self._no_file_ops.set()

    async def end_processes(self) -> list[str]:
        """End every process of the sandbox: each session (a daemon it started too) and each one-shot run.
        The sandbox stays; a later command starts a fresh session. Returns the names of the sessions ended."""
        return await self._reset(None)

    async def wipe(self) -> list[str]:
        """End every process, then give the workspace and /tmp their owner and mode back, empty them and seed
        the workspace again (`seed_workdir`): the sandbox is as it was when created."""
        return await self._reset(self._clean_slate)

    async def _reset(self, clean: Callable[[], Awaitable[None]] | None) -> list[str]:
        """Run a reset to its end even if its caller goes away: one cut short would leave the workspace half
        emptied. Only a delete cancels it (`close`)."""
        task = asyncio.ensure_future(self._reset_now(clean))
        self._resets.add(task)
        task.add_done_callback(self._resets.discard)
        return await asyncio.shield(task)

    async def _reset_now(self, clean: Callable[[], Awaitable[None]] | None) -> list[str]:
        async with self._reset_lock:
            self._open.clear()
            try:
                await self._no_file_ops.wait()
                ended = await self._stop_sessions_and_runs()
                await self.backend.reset(self.dirs, self.spec, clean)
                self.write_record()
                return ended
            finally:
                self._open.set()

    async def _clean_slate(self) -> None:
        own_dirs(self.dirs)
        for directory in (self.dirs.workspace, self.dirs.tmp):
            await to_the_end(empty_directory, directory)
        await self.seed()

    async def _stop_sessions_and_runs(self) -> list[str]:
        for task in list(self._starting.values()):
            await asyncio.gather(task, return_exceptions=True)
        sessions, self._sessions = self._sessions, {}
        runs, self._runs = list(self._runs), set()
        for task in runs:
            task.cancel()
        await asyncio.gather(*(s.close() for s in sessions.values()), *runs, return_exceptions=True)
        return sorted(sessions)

    async def seed(self) -> None:
        """With `seed_workdir`, fill the (empty) workspace with a copy of what the image holds at the workdir;
        call it only while nothing of the sandbox runs. The copy, in a thread, cannot be cancelled midway: a
        cancelled seed stops it at its next entry and waits for it, so that nothing removes its tree meanwhile."""
        if not self.spec.seed_workdir:
            return
        if self.dirs.image_root is None:  # the manager unpacks the image for a seeded sandbox
            raise SeedError(f"image {self.spec.image!r} has no unpacked root to seed the workspace from", 500)
        disk_mb = self.spec.limits.disk_mb
        stop = threading.Event()
        copy = asyncio.ensure_future(
            asyncio.to_thread(
                seed_workspace,
                self.dirs.image_root,
                self.spec.workdir,
                self.dirs.workspace,
                self.dirs.uid,
                None if disk_mb is None else disk_mb << 20,
                stop,
            )
        )
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.gather(copy, return_exceptions=True)
            raise

    async def close(self) -> None:
        """Kill every session and run (each waits until its processes are gone), then the backend's own state."""
        self.closing = True
        resets = list(self._resets)
        for task in resets:  # a seed stops at its next entry, an emptying at its end
            task.cancel()
        await asyncio.gather(*resets, return_exceptions=True)
        await self._stop_sessions_and_runs()
        await self.backend.destroy(self.dirs, self.spec)

    def write_record(self) -> None:
        """What a restarted server needs to reap this sandbox's processes: pids with their start times."""
        record = {
            "id": self.id,
            "backend": self.backend.name,
            "spec": self.spec.model_dump(mode="json"),
            "uid": self.dirs.uid,
            "cgroup": None if self.cgroup is None else str(self.cgroup),
            "sessions": {n: [s.pid, s.started_at] for n, s in self._sessions.items() if not s.dead},
        }
        tmp = self.dirs.root / (RECORD + ".tmp")
        with state_disk(f"record sandbox {self.id}"):
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
            image_digest=self.dirs.image_digest,
            workdir=self.workdir,
            network=spec.network,
            forwards=spec.forwards,
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
        """Why the reaper should delete this sandbox now, or None. Never while it is being created: its creator
        would get a sandbox deleted under it (a TTL shorter than the start-up, say) instead of its answer."""
        if not self.created:
            return None
        if self.spec.ttl_s is not None and now_wall - self.created_at > self.spec.ttl_s:
            return "ttl"
        busy = any(s.busy for s in self._sessions.values())
        if self.spec.idle_timeout_s is not None and not busy and now_mono - self.last_used > self.spec.idle_timeout_s:
            return "idle"
        return None


def own_dirs(dirs: SandboxDirs) -> None:
    """Give a sandbox's workspace and /tmp the owner and mode of a new sandbox: under a root server its own uid's,
    both 0700 (nobody else's); else the server's, a workspace of 0700 and a /tmp of 1777."""
    if dirs.uid is None:
        dirs.workspace.chmod(0o700)
        dirs.tmp.chmod(0o1777)
        return
    for own in (dirs.workspace, dirs.tmp):
        os.chown(own, dirs.uid, dirs.uid)
        own.chmod(0o700)


async def to_the_end(function: Callable[..., T], *args: object) -> T:
    """`function(*args)` in a thread; a cancelled caller still waits for the thread to end (it cannot be stopped
    midway) before the cancellation goes on, so that nothing else touches the same tree meanwhile."""
    work = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.gather(work, return_exceptions=True)
        raise
