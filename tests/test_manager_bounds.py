"""What bounds a sandbox as a whole (its own file system, its memory cgroup) is made in a thread (manager._bound)
that cannot be stopped midway: a cancelled creation, or a delete that comes meanwhile, undoes it only once it is
made, never before (then the mount, its loop device and the cgroup outlived the sandbox until a restart)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from sandbox_runtime.config import ServerConfig
from sandbox_runtime.manager import SandboxManager, SandboxNotFound
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.models import SandboxSpec


@pytest.fixture
async def slow(tmp_path) -> AsyncIterator[tuple[SandboxManager, threading.Event, list[str]]]:
    """A manager whose `_bound` waits for the test's event, and a record of what was made and undone."""
    config = ServerConfig(state_dir=tmp_path / "state", backend="local", allow_local=True, reap_interval_s=3600)
    manager = SandboxManager(config, Metrics())
    manager.sandbox_uids = None  # no uid per sandbox: what is tried here is the order of making and undoing
    manager.boxes_dir.mkdir(parents=True)
    release, calls = threading.Event(), []

    def bound(box):
        calls.append("binding")
        release.wait(10)
        calls.append("bound")

    manager._bound = bound  # type: ignore[method-assign]
    manager._unbound = lambda dirs, cgroup: calls.append("unbound")  # type: ignore[method-assign]
    yield manager, release, calls
    release.set()
    await asyncio.gather(*(manager.delete(i) for i in list(manager._sandboxes)), return_exceptions=True)


async def binding_started(calls: list[str]) -> None:
    while "binding" not in calls:
        await asyncio.sleep(0.005)


async def test_a_cancelled_creation_undoes_its_bounds_after_they_are_made(slow):
    manager, release, calls = slow
    creation = asyncio.create_task(manager.create(SandboxSpec()))
    await binding_started(calls)
    creation.cancel()
    await asyncio.sleep(0.1)
    assert calls == ["binding"]  # the cancellation waits for the thread: nothing undone before it is made
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await creation
    assert calls == ["binding", "bound", "unbound"]
    assert len(manager) == 0


async def test_a_delete_during_the_creation_waits_for_the_bounds_then_undoes_them(slow):
    manager, release, calls = slow
    creation = asyncio.create_task(manager.create(SandboxSpec()))
    await binding_started(calls)
    (sandbox_id,) = manager._sandboxes
    deletion = asyncio.create_task(manager.delete(sandbox_id))
    await asyncio.sleep(0.1)
    assert calls == ["binding"] and not deletion.done()
    release.set()
    assert await deletion is True
    with pytest.raises(SandboxNotFound, match="deleted while it was being created"):
        await creation
    assert calls == ["binding", "bound", "unbound"]
    assert await manager.delete(sandbox_id) is False  # and later deletes find it gone, as before


def test_only_a_server_that_mounts_file_systems_unmounts_them(tmp_path, monkeypatch):
    """An unprivileged server cannot unmount: each delete logged two EPERM warnings before."""
    from sandbox_runtime import workspace_fs
    from sandbox_runtime.backends.base import SandboxDirs

    unmounted = []
    monkeypatch.setattr(workspace_fs, "unmount", lambda *targets: unmounted.append(targets))
    manager = SandboxManager(ServerConfig(state_dir=tmp_path / "state", backend="local", allow_local=True), Metrics())
    dirs = SandboxDirs("abc", tmp_path / "abc")
    manager.own_disks = False
    manager._unbound(dirs, None)
    assert unmounted == []
    manager.own_disks = True
    manager._unbound(dirs, None)
    assert unmounted == [(dirs.workspace, dirs.tmp)]
