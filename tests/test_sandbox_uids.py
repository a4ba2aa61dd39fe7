"""The sandbox uids of a root server, on the real manager and the bwrap backend: a uid is handed out only with
nothing running as it, whether it is fresh (a crashed server may have left processes) or one this server
released and kept locked for reuse; and a kept uid is no other server's to take until it lets go.

Root only: an unprivileged server runs every sandbox as its own uid, and only root can start the processes
that stand for a crashed server's leftovers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox_runtime import manager as manager_module
from sandbox_runtime import procs
from sandbox_runtime.config import ServerConfig
from sandbox_runtime.manager import SandboxManager, hold_uid
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.models import SandboxSpec

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are a root server's; this run is not root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]

# A range of its own, apart from the default one and the chaos test's (2,100,000,000 on); below 2**31, as bwrap
# reads a uid as a signed int.
FIRST_UID = 2_140_000_000


async def new_manager(base: Path, uids: range) -> SandboxManager:
    config = ServerConfig(state_dir=base / "state", backend="bwrap", reap_interval_s=3600, sandbox_uids=uids)
    manager = SandboxManager(config, Metrics())
    await manager.start()
    return manager


@pytest.fixture
async def base() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="prorl-test-uids-"))  # outside pytest's 0700 dirs: sandbox uids reach it
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def manager(base: Path) -> AsyncIterator[SandboxManager]:
    manager = await new_manager(base, range(FIRST_UID, FIRST_UID + 4))
    yield manager
    await manager.stop()


def running_as(uid: int) -> list[int]:
    """Live processes whose real uid is `uid`."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return [pid for pid in pids if procs._real_uid(pid) == uid and (procs._stat_fields(pid) or ["Z"])[0] != "Z"]


def start_as(uid: int, *argv: str) -> subprocess.Popen:
    """`argv` running as `uid` (it has said so on its stdout before it became `argv`)."""
    announce = ["sh", "-c", 'echo running; exec "$@"', "sh", *argv]
    command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *announce]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "running"
    return process


async def sh(box, command: str) -> str:
    """`command`'s output in the sandbox's default shell session."""
    session = await box.session("default")
    return (await session.run(command, 30, None, False)).output


UIDS_SEEN = "for f in /proc/[0-9]*/status; do awk '/^Uid:/ {print $2}' $f; done | sort -u"


async def test_processes_left_running_as_fresh_uids_are_killed_before_a_sandbox_gets_one(manager):
    uids = range(FIRST_UID, FIRST_UID + 4)  # the manager's whole range: one scan clears them together
    leftovers = [start_as(uid, "sleep", "300") for uid in uids]  # what a crashed server's sandboxes left
    try:
        assert [running_as(uid) for uid in uids] == [[p.pid] for p in leftovers]
        box = await manager.create(SandboxSpec())
        assert box.dirs.uid in uids
        assert [p.wait(timeout=10) for p in leftovers] == [-9] * 4  # killed before the sandbox started
        assert (await sh(box, UIDS_SEEN)).split() == [str(box.dirs.uid)]  # nothing but the sandbox's own
        second = await manager.create(SandboxSpec())  # from the same scan's uids
        assert second.dirs.uid in uids and second.dirs.uid != box.dirs.uid
    finally:
        for leftover in leftovers:
            leftover.kill()
            leftover.wait()


async def test_a_released_uid_is_given_again_with_nothing_left_running_as_it(manager):
    first = await manager.create(SandboxSpec())
    uid = first.dirs.uid
    # A daemon that leaves the agent's session: the release must end it before the uid is anyone's again.
    await sh(first, "setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
    daemons = await sh(first, "pgrep -x sleep || true")
    assert daemons.split(), "the daemon did not start"
    await manager.delete(first.id)
    assert running_as(uid) == []
    second = await manager.create(SandboxSpec())
    assert second.dirs.uid == uid  # reused without another scan, and clean
    assert (await sh(second, "pgrep -x sleep || echo none")).strip() == "none"


async def test_a_kept_uid_is_not_another_servers_until_this_one_stops(base, manager):
    box = await manager.create(SandboxSpec())
    kept = box.dirs.uid
    await manager.delete(box.id)  # released, its lock kept
    other_base = base / "other"
    other_base.mkdir(mode=0o711)
    beyond = FIRST_UID + 4  # past this server's range, whose every uid it holds (in use, kept or scanned)
    other = await new_manager(other_base, range(kept, beyond + 1))  # a server whose range overlaps
    try:
        theirs = await other.create(SandboxSpec())
        assert theirs.dirs.uid == beyond
        await other.delete(theirs.id)
    finally:
        await other.stop()
    await manager.stop()  # lets go of the kept uids
    lock = hold_uid(kept)
    assert lock is not None
    lock.close()


async def test_uids_kept_past_the_limit_go_back_to_the_free_ones(manager, monkeypatch):
    monkeypatch.setattr(manager_module, "CLEAN_UIDS_KEPT", 1)
    boxes = [await manager.create(SandboxSpec()) for _ in range(2)]
    uids = [box.dirs.uid for box in boxes]
    for box in boxes:
        await manager.delete(box.id)
    released_first, kept = uids
    lock = hold_uid(released_first)  # let go of: any server may take it
    assert lock is not None
    lock.close()
    assert hold_uid(kept) is None  # still this server's


def test_a_process_that_makes_itself_non_dumpable_is_still_found_by_its_uid():
    """The files under /proc/PID of a non-dumpable process are root's, whatever its uid: the scan reads the
    real uid inside its status, so such a process cannot hide from the kill that releases its uid."""
    uid = FIRST_UID + 100
    hide = (
        "import ctypes, sys, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "  # PR_SET_DUMPABLE = 4
        "print('hidden', flush=True); time.sleep(300)"
    )
    hidden = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", sys.executable, "-c", hide],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hidden.stdout.readline().strip() == "hidden"
        assert os.stat(f"/proc/{hidden.pid}/status").st_uid == 0
        assert procs._real_uid(hidden.pid) == uid
        assert procs.kill_user(uid) >= 1
        assert hidden.wait(timeout=10) == -9
    finally:
        hidden.kill()
        hidden.wait()
