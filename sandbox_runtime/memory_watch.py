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
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict
from pathlib import Path

WATCH_INTERVAL_S = 0.25
_PAGE = os.sysconf("SC_PAGE_SIZE")


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, resident bytes) of every process that can be read now."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat", "rb") as handle:
                text = handle.read()
            fields = text[text.rindex(b")") + 2 :].split()  # after the command name, which may hold anything
            table[int(name)] = (int(fields[1]), int(fields[21]) * _PAGE)
    return table


def sandbox_of(pid: int, boxes_dir: Path) -> str | None:
    """The id of the sandbox whose directory the launcher `pid` names in its arguments, if any."""
    prefix = os.fsencode(boxes_dir) + b"/"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
        for argument in handle.read().split(b"\0"):
            if argument.startswith(prefix):
                return os.fsdecode(argument[len(prefix) :].split(b"/")[0])
    return None


def over_limit(server_pid: int, boxes_dir: Path, limits: dict[str, int]) -> dict[str, tuple[int, list[int]]]:
    """Sandbox id -> (resident bytes, its pids, deepest first) for each sandbox in `limits` (id -> bytes) whose
    processes together hold more than its limit."""
    table = process_table()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in table.items():
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
            found[sandbox] = (held, pids[::-1])
    return found


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
