"""A memory cgroup per sandbox: `limits.memory_mb` for all its processes together, where the host lets the server
make one.

Found from /proc/self/cgroup and /proc/self/mountinfo: the cgroup v2 hierarchy where the server's own cgroup
offers the `memory` controller (a host that delegates it), else the cgroup v1 `memory` hierarchy. Either way a
sandbox's cgroup is a child of the cgroup the server started in, named after the sandbox, so the limit the host put
on that cgroup still bounds every sandbox. (On cgroup v2 a cgroup with processes of its own cannot offer `memory`
to its children: there the server may first move itself into a leaf `prorl-server`, and its sandboxes' cgroups are
siblings of that leaf, `_enable_v2_memory`.) Only a root server can use one: nothing is delegated to an
unprivileged one on the hosts measured here (GET /v1/info says what enforces the limit instead).

A sandbox's processes are in its cgroup from their first instruction: the launcher (setpriv, bwrap) is started by
a tiny `sh` that writes its own pid into the cgroup and then execs it (`join_argv`), so no process of the sandbox
ever runs outside, and every process it forks is born inside. Swap is bounded too (v1's `memsw`, v2's
`memory.swap.max`), or the limit would only move memory to swap; on v1 with swap accounting off (no `memsw`) the
sandbox's cgroup gets `memory.swappiness` 0 instead, so its memory is not swapped out (GET /v1/info says which). A
cgroup is removed once its processes have
ended; its path is kept in the sandbox's record, so a server restarted after a crash removes the ones it left.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

PREFIX = "prorl-sandbox-"
LEAF = "prorl-server"  # cgroup v2: where the server moves itself to offer `memory` to its sandboxes
# How long a removal waits for the kernel to finish the processes it killed (their exits are asynchronous).
EMPTY_WAIT_S = 10.0
_POLL_S = 0.01


@dataclass(frozen=True)
class MemoryCgroups:
    """Where this server makes its sandboxes' memory cgroups: `base`, a directory of a cgroup file system."""

    version: Literal["cgroup v1", "cgroup v2"]
    base: Path

    def swap(self) -> str:
        """How a sandbox's swap is bounded here (for GET /v1/info)."""
        if self.version == "cgroup v2":
            return "no swap (memory.swap.max 0)"
        if (self.base / "memory.memsw.limit_in_bytes").exists():
            return "memory and swap together (memory.memsw.limit_in_bytes)"
        return "swap accounting is off (no memory.memsw), so each sandbox's cgroup has memory.swappiness 0: not swapped"

    def path(self, sandbox_id: str) -> Path:
        return self.base / f"{PREFIX}{sandbox_id}"

    def create(self, sandbox_id: str, memory_bytes: int) -> Path:
        """A new cgroup for the sandbox, its limit set (memory and swap together), before anything runs in it."""
        cgroup = self.path(sandbox_id)
        cgroup.mkdir()
        try:
            if self.version == "cgroup v1":
                _write(cgroup / "memory.limit_in_bytes", memory_bytes)
                swap = cgroup / "memory.memsw.limit_in_bytes"  # memory + swap: absent where swap accounting is off
                if swap.exists():
                    _write(swap, memory_bytes)
                else:  # nothing bounds its swap: keep its memory out of swap, so that the limit bounds it all
                    _write(cgroup / "memory.swappiness", 0)
            else:
                _write(cgroup / "memory.max", memory_bytes)
                swap = cgroup / "memory.swap.max"
                if swap.exists():
                    _write(swap, 0)
        except BaseException:
            remove(cgroup)
            raise
        return cgroup


def join_argv(cgroup: Path) -> list[str]:
    """argv prefix that runs the rest inside `cgroup`: the shell moves itself in, then execs the rest (same pid).
    The path is `$0`, never part of the script, so no path can change what the shell runs."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs")]


def remove(cgroup: Path) -> None:
    """Kill what still runs in `cgroup` and remove it, waiting (bounded) for the kernel to empty it. Idempotent."""
    deadline = time.monotonic() + EMPTY_WAIT_S
    while True:
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("cannot remove cgroup %s: %s", cgroup, exc)
                return
        _kill_members(cgroup)
        time.sleep(_POLL_S)  # the killed processes' exits are the kernel's: poll, bounded by the deadline


def _kill_members(cgroup: Path) -> None:
    kill = cgroup / "cgroup.kill"  # v2, Linux 5.14+: every process at once, forks included
    if kill.exists():
        with contextlib.suppress(OSError):
            _write(kill, 1)
            return
    with contextlib.suppress(OSError):
        for line in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line), signal.SIGKILL)


def _write(path: Path, value: int | str) -> None:
    with open(path, "w") as handle:
        handle.write(str(value))


# -- finding the controller --------------------------------------------------------------------------------
def find(proc: Path = Path("/proc/self")) -> tuple[MemoryCgroups | None, str]:
    """The memory cgroups this server can make, or None and why not (one line, for GET /v1/info and the log),
    from `proc`'s `cgroup` and `mountinfo`. Tried for real: a probe cgroup is made, limited and removed, since a
    writable-looking hierarchy may still refuse (a read-only mount, a container's cgroup namespace)."""
    if os.geteuid() != 0:
        return None, "the server is not root and no memory cgroup is delegated to it"
    mounts = _cgroup_mounts(proc / "mountinfo")
    memberships = _memberships(proc / "cgroup")
    candidates: list[MemoryCgroups] = []
    v2 = mounts.get("cgroup2")
    if v2 is not None and "" in memberships:
        base = _inside(v2, memberships[""])
        if base is not None and "memory" in _words(base / "cgroup.controllers"):
            candidates.append(MemoryCgroups("cgroup v2", base))
    v1 = mounts.get("memory")
    if v1 is not None and "memory" in memberships:
        base = _inside(v1, memberships["memory"])
        if base is not None:
            candidates.append(MemoryCgroups("cgroup v1", base))
    if not candidates:
        return None, "no memory cgroup controller is mounted for this server (cgroup v2 offers none, v1 has none)"
    reasons = []
    for cgroups in candidates:
        try:
            if cgroups.version == "cgroup v2":
                _enable_v2_memory(cgroups.base)
            probe = cgroups.create(f"probe-{os.getpid()}", 64 << 20)
            remove(probe)
            return cgroups, f"{cgroups.version} memory controller under {cgroups.base}; swap: {cgroups.swap()}"
        except OSError as exc:
            reasons.append(f"{cgroups.version} at {cgroups.base}: {exc.strerror or exc}")
    return None, "cannot make a memory cgroup: " + "; ".join(reasons)


def _enable_v2_memory(base: Path) -> None:
    """Offer `memory` to the children of `base`. cgroup v2 lets a cgroup with processes of its own have no
    controllers in its subtree, so a server alone in a delegated cgroup first moves itself into a leaf, as
    systemd's delegation rules ask. Where that does not help either (other processes share `base`), the server
    moves back and the leaf goes: nothing of the attempt stays."""
    control = base / "cgroup.subtree_control"
    if "memory" in _words(control):
        return
    try:
        _write(control, "+memory")
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        leaf = base / LEAF
        leaf.mkdir(exist_ok=True)
        try:
            _write(leaf / "cgroup.procs", os.getpid())
            _write(control, "+memory")
        except BaseException:
            try:
                _write(base / "cgroup.procs", os.getpid())
            except OSError as back:
                log.warning("cannot move the server back from %s to %s: %s", leaf, base, back)
            with contextlib.suppress(OSError):
                leaf.rmdir()
            raise


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _memberships(path: Path) -> dict[str, str]:
    """Controller (v1; "" for v2) -> the server's cgroup path in that hierarchy, from a /proc/PID/cgroup."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            _id, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            for controller in controllers.split(",") if controllers else [""]:
                found.setdefault(controller, path)
    return found


@dataclass(frozen=True)
class _Mount:
    point: Path
    root: str  # the directory of the hierarchy that is mounted there


def _cgroup_mounts(path: Path) -> dict[str, _Mount]:
    """`cgroup2` and each v1 controller -> where its hierarchy is mounted, from a /proc/PID/mountinfo."""
    mounts: dict[str, _Mount] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            fields, _, tail = line.partition(" - ")
            parts, after = fields.split(), tail.split()
            if len(parts) < 5 or len(after) < 3:
                continue
            mount = _Mount(Path(unescape(parts[4])), unescape(parts[3]))
            if after[0] == "cgroup2":
                mounts.setdefault("cgroup2", mount)
            elif after[0] == "cgroup":
                for option in after[2].split(","):
                    mounts.setdefault(option, mount)
    return mounts


def _inside(mount: _Mount, path: str) -> Path | None:
    """The directory of cgroup `path` under `mount`, or None when the mount does not show it."""
    relative = os.path.relpath(path, mount.root)
    if relative.startswith(".."):
        return None
    directory = mount.point / relative if relative != "." else mount.point
    return directory if directory.is_dir() else None


def unescape(field: str) -> str:
    """A mountinfo field: space, tab, newline and backslash are written as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field
