"""Process bookkeeping on Linux: identify a process by pid *and* start time, find and kill a Unix session.

Processes are never looked up or killed by name: a pid alone can be reused after a crash, so every record
pairs it with the start time the kernel gives in /proc/PID/stat.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    rest = raw[raw.rindex(b")") + 2 :].decode().split()
    return rest  # rest[0] is field 3 (state)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22


def is_same_process(pid: int, started: int) -> bool:
    return start_time(pid) == started


def session_members(sid: int) -> list[int]:
    """Pids of every live process whose Unix session id is `sid` (field 6 of /proc/PID/stat)."""
    members = []
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields and int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _real_uid(pid: int) -> int | None:
    # os.open and bytes, not pathlib and text: a scan reads this for every process on the host, and this way
    # it costs a third as much. The real uid from the status, not an owner under /proc/PID: that is the
    # effective uid, and the files of a process that makes itself non-dumpable are root's.
    try:
        fd = os.open(f"{_PROC}/{pid}/status", os.O_RDONLY)
        try:
            status = os.read(fd, 8192)
        finally:
            os.close(fd)
        start = status.index(b"\nUid:") + 5
        return int(status[start : status.index(b"\n", start)].split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
        return None


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in (_PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def _kill_until_gone(select: Callable[[int], bool]) -> int:
    """SIGKILL every process `select` picks, again until none is left (a process may fork while we scan)."""
    signalled = 0
    for _ in range(100):
        victims = [int(e.name) for e in os.scandir(_PROC) if e.name.isdigit() and select(int(e.name))]
        victims = [pid for pid in victims if pid != os.getpid() and (_stat_fields(pid) or ["Z"])[0] != "Z"]
        if not victims:
            break
        for pid in victims:
            kill(pid)
        signalled += len(victims)
    return signalled


def kill_user(uid: int) -> int:
    """SIGKILL every process whose real uid is `uid`: a sandbox's own uid, which no other process uses."""
    return kill_users({uid})


def kill_users(uids: set[int]) -> int:
    """SIGKILL every process whose real uid is one of `uids` (sandbox uids), in one scan of the processes."""
    if 0 in uids:
        raise ValueError("refusing to kill every process of uid 0")
    return _kill_until_gone(lambda pid: _real_uid(pid) in uids)


def kill_marked(name: str, value: str) -> int:
    """SIGKILL every process of this uid whose environment holds `name=value` (inherited by all that a
    launcher started, `setsid` daemons included)."""
    entry, me = f"{name}={value}".encode(), os.getuid()
    return _kill_until_gone(lambda pid: _real_uid(pid) == me and _environ_has(pid, entry))


def kill_session(sid: int) -> int:
    """SIGKILL every process of Unix session `sid`; returns how many were signalled."""
    members = session_members(sid)
    for pid in members:
        kill(pid)
    return len(members)


async def wait_exit(pid: int) -> int:
    """Wait, without blocking the event loop, for child `pid` to exit; reap it and return its exit status.

    A pidfd becomes readable when the process exits, so no thread and no polling are needed.
    """
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _reap(pid)
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return _reap(pid)


def _reap(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # already reaped elsewhere
        return -1
    return os.waitstatus_to_exitcode(status)


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/PID/task/*/children."""
    kids: list[int] = []
    try:
        for task in os.scandir(_PROC / str(pid) / "task"):
            kids += [int(p) for p in Path(task.path, "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
