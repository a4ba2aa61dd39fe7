"""A watchdog for `limits.memory_mb` over all of a sandbox's processes, where no memory cgroup can be used (an
unprivileged server: nothing is delegated to it on the hosts measured here).

Every WATCH_INTERVAL_S it reads each process's parent and resident memory from /proc, finds each sandbox's
processes as the descendants of the launchers the server started for it (a session's or a one-shot run's bwrap:
its pid namespace's processes all descend from it, `setsid` daemons included, since orphans are adopted by the
namespace's init), and kills them all where their resident memory together is above the limit. A launcher is
known as the sandbox's by its command line, which binds the sandbox's own workspace from under the state dir.

What it does not hold, and a cgroup does: a process that allocates faster than one interval is caught after it
(RLIMIT_AS still bounds each process to `memory_mb`), pages shared between processes are counted once per process
(so the bound errs on the side of killing), and memory that is not resident in a process (tmpfs, page cache)
is not counted.

What it kills is known by more than a pid: a pid read from /proc may be freed and reused by another process before
the kill, and the server never kills a process it does not own by a stale identity. So each process is held by a
pidfd first, then its start time is read again and compared with the scan's; the signal goes through the pidfd,
which can only ever reach the process it was opened on.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict
from pathlib import Path

from . import procs

WATCH_INTERVAL_S = 0.25
_PAGE = os.sysconf("SC_PAGE_SIZE")


def process_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, resident bytes, start time in clock ticks) of every process that can be read now."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat", "rb") as handle:
                text = handle.read()
            fields = text[text.rindex(b")") + 2 :].split()  # after the command name, which may hold anything
            table[int(name)] = (int(fields[1]), int(fields[21]) * _PAGE, int(fields[19]))
    return table


def sandbox_of(pid: int, boxes_dir: Path) -> str | None:
    """The id of the sandbox whose directory the launcher `pid` names in its arguments, if any."""
    prefix = os.fsencode(boxes_dir) + b"/"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
        for argument in handle.read().split(b"\0"):
            if argument.startswith(prefix):
                return os.fsdecode(argument[len(prefix) :].split(b"/")[0])
    return None


Process = tuple[int, int]  # pid, start time: who the scan saw


def over_limit(server_pid: int, boxes_dir: Path, limits: dict[str, int]) -> dict[str, tuple[int, list[Process]]]:
    """Sandbox id -> (resident bytes, its processes, deepest first) for each sandbox in `limits` (id -> bytes)
    whose processes together hold more than its limit."""
    table = process_table()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _, _) in table.items():
        children[parent].append(pid)
    members: dict[str, list[int]] = defaultdict(list)
    for launcher in children.get(server_pid, []):
        sandbox = sandbox_of(launcher, boxes_dir)
        if sandbox not in limits:
            continue
        tree, stack = [], [launcher]
        while stack:
            pid = stack.pop()
            tree.append(pid)
            stack.extend(children.get(pid, []))
        members[sandbox] += tree
    found = {}
    for sandbox, pids in members.items():
        held = sum(table[pid][1] for pid in pids)
        if held > limits[sandbox]:
            found[sandbox] = (held, [(pid, table[pid][2]) for pid in pids[::-1]])
    return found


def kill(processes: list[Process]) -> int:
    """SIGKILL each process that is still the one the scan saw (see the module's docstring); how many."""
    killed = 0
    for pid, started in processes:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone (ESRCH), or not ours to signal
            continue
        try:
            if procs.start_time(pid) == started:  # the pidfd holds the scanned process, not a successor
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed += 1
        finally:
            os.close(pidfd)
    return killed
