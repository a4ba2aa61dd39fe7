"""One sandbox: its directories, its backend, its named bash sessions and its one-shot runs."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path

from .backends.base import ONESHOT_ARGV, Backend, SandboxDirs
from .files import SandboxFiles
from .models import RunRequest, RunResult, SandboxInfo, SandboxSpec, SessionInfo
from .oneshot import run_once, run_script
from .session import SessionError, ShellSession

log = logging.getLogger(__name__)

RECORD = "record.json"
# What bash prints when its memory limit keeps it from starting (xmalloc failing while it reads its environment).
# The other limits cannot: bash opens no file and starts no process before its first command, and their
# minimums (models.Limits) leave room for that command.
OUT_OF_MEMORY = "cannot allocate"


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
        launch = self.backend.launch(self.dirs, self.spec)
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
        """End every process, then give the workspace and /tmp their owner and mode back, empty them and seed
        the workspace again (`seed_workdir`): the sandbox is as it was when created."""
        ended = await self.end_processes()
        own_dirs(self.dirs)
        for directory in (self.dirs.workspace, self.dirs.tmp):
            await asyncio.to_thread(empty_directory, directory)
        await self.seed()
        return ended

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


class SeedError(Exception):
    """The image cannot seed the workspace (400), its copy is over limits.disk_mb (413), or the host has no room
    for it (507)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def seed_workspace(
    image_root: Path,
    workdir: str,
    workspace: Path,
    uid: int | None,
    max_bytes: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Copy the directory `image_root`/`workdir` into the empty `workspace`; returns the bytes of its files.

    No link is ever followed, neither on the way to `workdir` (a link there is refused: in the image it could
    lead anywhere on the host) nor in the tree (links are copied as links). Regular files keep their mode less
    setuid and setgid, and their times (git's index stays valid); directories their mode (set once they are
    filled); device nodes, FIFOs and sockets are skipped. Under a root server (`uid`) every copy is given to
    the sandbox's uid, as the rest of its workspace. SeedError when the image holds no directory at `workdir`,
    part of it cannot be read, or its files hold more than `max_bytes`. One directory level at a time holds
    two descriptors: no recursion."""
    try:
        source = _image_directory(image_root, workdir)
    except OSError:
        raise SeedError(
            f"the image holds no directory at {workdir} to seed the workspace from (seed_workdir; a link there "
            "is not followed)"
        ) from None
    try:
        target = os.open(workspace, _DIR_FLAGS)
    except BaseException:
        os.close(source)
        raise
    try:
        return _copy_tree(source, target, uid, max_bytes, stop or threading.Event(), workdir)
    except PermissionError as exc:
        raise SeedError(f"the image's {workdir} cannot be copied into the workspace: {exc}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SeedError(f"no space left for the copy of the image's {workdir}: {exc}", 507) from None
        raise


def _image_directory(image_root: Path, workdir: str) -> int:
    """A descriptor of the directory at `workdir` in the image, each name of it opened without following links."""
    fd = os.open(image_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in workdir.strip("/").split("/"):
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _copy_tree(
    source: int, target: int, uid: int | None, max_bytes: int | None, stop: threading.Event, what: str
) -> int:
    total = 0
    # (source fd, target fd, names left, the source directory's stat): the levels from the top down.
    stack: list[tuple[int, int, list[str], os.stat_result | None]] = [(source, target, [], None)]
    try:
        stack[0] = (source, target, os.listdir(source), None)
        while stack:
            src, dst, names, directory = stack[-1]
            if not names:  # a level filled: its mode and times last (a read-only one could not be filled)
                stack.pop()
                if directory is not None:
                    os.fchmod(dst, _kept_mode(directory))
                    os.utime(dst, ns=(directory.st_atime_ns, directory.st_mtime_ns))
                os.close(src)
                os.close(dst)
                continue
            if stop.is_set():
                raise SeedError("the seeding of the workspace was cancelled", 500)
            name = names.pop()
            info = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                os.mkdir(name, 0o700, dir_fd=dst)
                child_src = os.open(name, _DIR_FLAGS, dir_fd=src)
                try:
                    child_dst = os.open(name, _DIR_FLAGS, dir_fd=dst)
                except BaseException:
                    os.close(child_src)
                    raise
                stack.append((child_src, child_dst, os.listdir(child_src), info))
                if uid is not None:
                    os.fchown(child_dst, uid, uid)
            elif stat.S_ISLNK(info.st_mode):
                link = os.readlink(name, dir_fd=src)
                total += len(os.fsencode(link))
                os.symlink(link, name, dir_fd=dst)
                if uid is not None:
                    os.chown(name, uid, uid, dir_fd=dst, follow_symlinks=False)
                os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
            elif stat.S_ISREG(info.st_mode):
                total += info.st_size
                if max_bytes is not None and total > max_bytes:
                    raise SeedError(
                        f"the image's {what} holds more than the sandbox's disk budget of {max_bytes} bytes "
                        "(limits.disk_mb)",
                        413,
                    )
                _copy_file(src, dst, name, info, uid)
    finally:
        for src, dst, _, _ in stack:
            os.close(src)
            os.close(dst)
    return total


def _kept_mode(info: os.stat_result) -> int:
    return stat.S_IMODE(info.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)


def _copy_file(src: int, dst: int, name: str, info: os.stat_result, uid: int | None) -> None:
    fd_in = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    try:
        fd_out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst)
        try:
            offset = 0
            while os.fstat(fd_in).st_size > offset:
                sent = os.sendfile(fd_out, fd_in, offset, 1 << 30)
                if sent == 0:
                    break
                offset += sent
            if uid is not None:
                os.fchown(fd_out, uid, uid)
            os.fchmod(fd_out, _kept_mode(info))
            os.utime(fd_out, ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def empty_directory(directory: Path) -> None:
    """Remove everything inside `directory`, never following a link, at any depth: one directory open at a time
    and a stack of names, not recursion (an agent's tree may be deeper than Python's recursion limit and than
    PATH_MAX). What its owner made unwritable or unreadable is made accessible again (an unprivileged server owns
    its sandboxes' files). Call it only once every process that could write there is gone: the walk climbs back
    through '..'."""
    fd = os.open(directory, _DIR_FLAGS)
    below: list[str] = []  # the directories from `directory` down to the one open on fd
    try:
        while True:
            sub = _unlink_all_but_directories(fd)
            if sub is not None:
                child = _open_accessible(fd, sub)
                os.close(fd)
                fd = child
                below.append(sub)
            elif below:
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                _writable_retry(fd, os.rmdir, below.pop())
            else:
                return
    finally:
        os.close(fd)


def remove_tree(directory: Path) -> None:
    """`directory` and everything in it, as empty_directory does; what cannot be removed stays (logged), for the
    next server on the state dir to reap."""
    try:
        empty_directory(directory)
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", directory, exc)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _unlink_all_but_directories(fd: int) -> str | None:
    """Unlink the entries of the directory open on `fd` up to its first subdirectory, whose name is returned;
    None once only subdirectories were left (and there were none)."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            _writable_retry(fd, os.unlink, entry.name)
    return None


def _writable_retry(fd: int, remove, name: str) -> None:
    """`remove(name, dir_fd=fd)`; if the directory was made unwritable, make it writable (0700) and retry."""
    try:
        remove(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except PermissionError:
        os.fchmod(fd, 0o700)
        remove(name, dir_fd=fd)


def _open_accessible(fd: int, name: str) -> int:
    """Open subdirectory `name` of `fd` without following a link. If `fd` was made untraversable or `name`
    unreadable, both are given 0700 first."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except PermissionError:
        os.fchmod(fd, 0o700)
        os.chmod(name, 0o700, dir_fd=fd)  # a directory (scandir said so, and nothing runs to swap it)
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
