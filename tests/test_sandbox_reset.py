"""A reset (a wipe, an end of processes) kept apart from everything else done in the sandbox, on the real
manager and backend in process: a file operation in flight finishes before the wipe empties the workspace, one
asked for during the wipe waits for its end, a wipe whose caller goes away still finishes, and a client that
went away while its sandbox was being made leaves no sandbox behind."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox_runtime.config import ServerConfig
from sandbox_runtime.manager import ClientGone, SandboxManager
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.models import SandboxSpec

BWRAP = shutil.which("bwrap") is not None
BACKEND = "bwrap" if BWRAP else "local"


@pytest.fixture
async def manager() -> AsyncIterator[SandboxManager]:
    base = Path(tempfile.mkdtemp(prefix="prorl-test-reset-"))  # outside pytest's 0700 dirs: sandbox uids reach it
    base.chmod(0o711)
    config = ServerConfig(state_dir=base / "state", backend=BACKEND, allow_local=not BWRAP, reap_interval_s=3600)
    manager = SandboxManager(config, Metrics())
    await manager.start()
    try:
        yield manager
    finally:
        await manager.stop()
        shutil.rmtree(base, ignore_errors=True)


def blocked_write(box, name: str, gate: threading.Event, entered: threading.Event):
    """A file write that holds its thread until `gate` is set, as a large upload would."""

    def write() -> int:
        entered.set()
        gate.wait(30)
        return box.files.write(name, b"x", None)

    return write


async def until(condition, what: str) -> None:
    """Yield to the loop until `condition()` holds (the event loop's own progress, no timing)."""
    for _ in range(100_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


async def test_a_wipe_waits_for_a_file_operation_in_flight_and_later_ones_wait_for_the_wipe(manager):
    box = await manager.create(SandboxSpec())
    gate, entered = threading.Event(), threading.Event()
    in_flight = asyncio.ensure_future(box.in_thread(blocked_write(box, "before-wipe", gate, entered)))
    await until(entered.is_set, "the write's thread runs")
    wipe = asyncio.ensure_future(box.wipe())
    await until(lambda: not box._open.is_set(), "the wipe closes the sandbox to new work")
    later = asyncio.ensure_future(box.in_thread(box.files.write, "during-wipe", b"y", None))
    command = asyncio.ensure_future(box.session("default"))
    for _ in range(1000):  # the wipe cannot go on while the write it waits for holds its thread
        await asyncio.sleep(0)
    assert not wipe.done() and not later.done() and not command.done()
    gate.set()
    await in_flight
    assert await wipe == ["default"]
    await later
    session = await command
    result = await session.run("ls", 10, 4096, keep=False)
    # The write in flight landed before the wipe emptied the workspace, the later one after it.
    assert result.output.split() == ["during-wipe"], result


async def test_a_wipe_whose_caller_goes_away_still_ends(manager):
    box = await manager.create(SandboxSpec())
    session = await box.session("default")
    await session.run("touch left-behind", 10, 4096, keep=False)
    wipe = asyncio.ensure_future(box.wipe())
    await until(lambda: not box._open.is_set(), "the wipe starts")
    wipe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wipe
    fresh = await box.session("default")  # waits for the wipe, which went on without its caller
    assert (await fresh.run("ls -A", 10, 4096, keep=False)).output == ""
    assert list(box.dirs.workspace.iterdir()) == []


async def test_a_delete_during_a_wipe_ends_both_and_leaves_nothing(manager):
    box = await manager.create(SandboxSpec())
    wipe = asyncio.ensure_future(box.wipe())
    await until(lambda: not box._open.is_set(), "the wipe starts")
    assert await manager.delete(box.id) is True
    await asyncio.gather(wipe, return_exceptions=True)
    assert len(manager) == 0 and not box.dirs.root.exists()


async def test_a_client_gone_while_its_sandbox_was_made_leaves_no_sandbox(manager):
    asked = []

    def wanted() -> bool:  # still there once the image is ready, gone once the sandbox is made
        asked.append(True)
        return len(asked) == 1

    with pytest.raises(ClientGone, match="went away while the sandbox was being created"):
        await manager.create(SandboxSpec(), wanted=wanted)
    assert len(asked) == 2 and len(manager) == 0
    assert list(manager.boxes_dir.iterdir()) == []
