"""Limits for a whole sandbox, tried as a sandbox's code would break them, against a runtime started as deployed
(by root, and by an unprivileged user): the memory of all its processes together, the bytes and inodes of its
workspace and /tmp together, and a full state disk answered with a 507. Each test was a hole before (issue 47)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandbox_runtime.client import SandboxAPIError

from .conftest import BACKEND_SKIPS, reachable, start_unprivileged_server, stop_server
from .test_security import DEPLOYMENTS, start_deployment

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))

# A process that holds MB of memory (written, so resident) and goes on holding it in a child once its parent has
# returned: the shell runs the next one while the first still holds. HOLDE[R] finds them and not the finder.
HOLD = (
    "python3 -c \"import os, time; held = bytearray(b'1') * ({mb} << 20); "
    'os.fork() and os._exit(0); time.sleep(600)" HOLDER'
)
HOLDERS = "grep -la HOLDE[R] /proc/[0-9]*/cmdline 2>/dev/null | wc -l"


@pytest.fixture(scope="module", params=DEPLOYMENTS)
def server(request, tmp_path_factory):
    runtime = start_deployment(request.param, tmp_path_factory.mktemp("state"), "bwrap")
    yield runtime
    stop_server(runtime)


async def enforcement(server):
    async with server.client() as client:
        return (await client.info()).enforcement


def host_offers_memory_cgroups() -> bool:
    """Whether this process is in a cgroup v1 memory hierarchy that is mounted (as on the hosts measured here)."""
    controllers = [line.split(":")[1].split(",") for line in Path("/proc/self/cgroup").read_text().splitlines()]
    return any("memory" in names for names in controllers) and Path("/sys/fs/cgroup/memory").is_dir()


def need_own_file_systems(server) -> None:
    """Disk and inode limits for a whole sandbox need a root server (mounts) and loop devices."""
    if server.unprivileged:
        pytest.skip("an unprivileged server cannot mount here: its disk limit is per file, as GET /v1/info says")
    if not os.path.exists("/dev/loop-control"):
        pytest.skip("this host has no loop devices")


async def test_info_says_what_enforces_each_limit(server):
    held = await enforcement(server)
    assert held.detail
    if server.unprivileged:  # nothing is delegated to it here: said, not pretended
        assert (held.memory, held.disk, held.inodes) == ("watchdog", "per file", "none")
        assert "not root" in held.detail
    else:
        if host_offers_memory_cgroups():
            assert held.memory in ("cgroup v1", "cgroup v2")
        assert (held.disk, held.inodes) == ("filesystem", "filesystem")


async def test_processes_together_above_memory_mb_are_stopped(server):
    if not server.unprivileged and not host_offers_memory_cgroups():
        pytest.skip("this host offers no memory cgroup")
    async with server.client() as client:
        sandbox = (await client.create_sandbox(limits={"memory_mb": 256})).id
        try:
            # Each holder is under the per-process limit (RLIMIT_AS 256 MB); three together are far above it. The
            # shell then waits for fewer than three to hold: a cgroup kills one at once, a watchdog ends the
            # sandbox's processes (this shell too) within its interval; with neither it waits until the timeout.
            holds = "; ".join([HOLD.format(mb=100)] * 3)
            result = await client.exec(sandbox, f"{holds}; until [ $({HOLDERS}) -lt 3 ]; do :; done", timeout=60)
            assert result.status != "timeout", "three holders of 100 MB each lived on in a sandbox of 256 MB"
            assert int((await client.exec(sandbox, HOLDERS)).output.strip()) < 3
            assert (await client.exec(sandbox, "echo alive")).output.strip() == "alive"  # it still works
        finally:
            await client.delete_sandbox(sandbox)


async def test_a_sandbox_that_fills_its_disk_fails_its_own_writes_and_only_those(server):
    need_own_file_systems(server)
    async with server.client() as client:
        full = (await client.create_sandbox(limits={"disk_mb": 32, "file_size_mb": 1024})).id
        other = (await client.create_sandbox(limits={"disk_mb": 32, "file_size_mb": 1024})).id
        try:
            # The workspace and /tmp share the limit: 24 MB in each is over 32 MB together.
            fill = "dd if=/dev/zero of=/tmp/a bs=1M count=24 2>&1; dd if=/dev/zero of=b bs=1M count=24 2>&1"
            result = await client.exec(full, fill, timeout=60)
            assert "No space left on device" in result.output
            more = await client.exec(full, "dd if=/dev/zero of=c bs=1M count=8 2>&1", timeout=60)
            assert more.exit_code != 0 and "No space left on device" in more.output
            held = await client.exec(full, "du -smc /tmp . | tail -1 | cut -f1")
            assert int(held.output.strip()) <= 40  # its limit, and ext4's rounding: not the 56 MB it wrote
            # The file API meets the same wall, and says it with a 507.
            with pytest.raises(SandboxAPIError) as refused:
                await client.write_file(full, "d", b"x" * (1 << 20))
            assert refused.value.status in (413, 507), refused.value.message
            wrote = await client.exec(other, "dd if=/dev/zero of=b bs=1M count=24 2>&1 && echo wrote", timeout=60)
            assert wrote.output.strip().endswith("wrote")
        finally:
            await client.delete_sandbox(full)
            await client.delete_sandbox(other)


async def test_many_small_files_stop_at_the_inode_bound(server):
    need_own_file_systems(server)
    async with server.client() as client:
        sandbox = (await client.create_sandbox(limits={"inodes": 2048})).id
        try:
            make = "for i in $(seq 20000); do { : > f$i; } 2>/dev/null || { echo stopped at $i; break; }; done"
            output = (await client.exec(sandbox, make, timeout=120)).output.split()
            assert output[:2] == ["stopped", "at"], output
            assert int(output[2]) <= 4096  # ext4 rounds the inode count up to whole groups
            # The wipe still empties it, and the inodes come back.
            await client.wipe(sandbox)
            assert (await client.exec(sandbox, "touch again && ls | wc -l")).output.strip() == "1"
        finally:
            await client.delete_sandbox(sandbox)


def mounts_of(sandbox: str) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f"/{sandbox}/" in line]


def cgroups_of(sandbox: str) -> str:
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-maxdepth", "6", "-name", f"prorl-sandbox-{sandbox}"],
        capture_output=True,
        text=True,
    )
    return found.stdout


async def test_a_deleted_sandbox_leaves_no_mount_and_no_cgroup(server):
    async with server.client() as client:
        info = await client.create_sandbox()
        sandbox = info.id
        mounted, grouped = mounts_of(sandbox), cgroups_of(sandbox)
        if grouped:  # its launcher (and so everything it starts) is in the cgroup, not moved there later
            launcher = Path(f"/proc/{info.sessions[0].pid}/cgroup").read_text()
            assert f"prorl-sandbox-{sandbox}" in launcher
        await client.delete_sandbox(sandbox)
    assert bool(mounted) == (not server.unprivileged)
    assert bool(grouped) == (not server.unprivileged and host_offers_memory_cgroups())
    assert not mounts_of(sandbox) and not cgroups_of(sandbox)


async def test_a_crashed_servers_mounts_and_cgroups_go_at_the_next_start(tmp_path):
    state = tmp_path / "crash-state"  # the same path twice: one state dir for both incarnations
    first = start_deployment("root", state, "bwrap")
    try:
        async with first.client() as client:
            sandbox = (await client.create_sandbox()).id
            await client.exec(sandbox, "echo kept > file")
        assert mounts_of(sandbox)
        assert bool(cgroups_of(sandbox)) == host_offers_memory_cgroups()
        first.process.kill()  # SIGKILL: no clean-up ran
        first.process.wait()
    finally:
        stop_server(first)
    assert mounts_of(sandbox)  # the crash left them
    second = start_deployment("root", state, "bwrap")
    stop_server(second)
    assert not mounts_of(sandbox) and not cgroups_of(sandbox)


# -- a full state disk -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_state_disk(path: Path, size_mb: int):
    """A state dir on a file system of its own of `size_mb` (a tmpfs), for an unprivileged server: root mounts it."""
    if os.geteuid() != 0:
        pytest.skip("only root can mount the small file system this test fills")
    state = reachable(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0711", "tmpfs", str(state)], check=True)
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` to its last byte, as root (which a full disk refuses too)."""
    filler = directory / "filler"
    with open(filler, "wb") as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * (1 << 16))
            handle.flush()
    return filler


def archive() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("member")
        info.size = 1 << 20
        tar.addfile(info, io.BytesIO(b"m" * info.size))
    return buffer.getvalue()


async def test_a_full_state_disk_is_a_507_that_says_so(tmp_path):
    with small_state_disk(tmp_path / "state", 64) as state:
        server = start_unprivileged_server(state, "bwrap")
        try:
            async with server.client() as client:
                sandbox = (await client.create_sandbox()).id
                filler = await asyncio.to_thread(fill, state)
                for call in (
                    client.create_sandbox(),
                    client.write_file(sandbox, "f", b"x" * (1 << 20)),
                    client.upload_archive(sandbox, "a", archive()),
                ):
                    with pytest.raises(SandboxAPIError) as refused:
                        await call
                    assert refused.value.status == 507, refused.value.message
                    assert "space" in refused.value.message
                filler.unlink()  # room again: the server goes on as before
                assert (await client.exec(sandbox, "echo fine")).output.strip() == "fine"
                await client.delete_sandbox(sandbox)
        finally:
            stop_server(server)


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
async def test_a_sandbox_on_a_full_state_disk_is_a_507(tmp_path, deployment):
    with small_state_disk(tmp_path / "state", 32) as state:
        server = start_deployment(deployment, state, "bwrap")
        try:
            await asyncio.to_thread(fill, state)
            async with server.client() as client:
                with pytest.raises(SandboxAPIError) as refused:
                    await client.create_sandbox()
                assert refused.value.status == 507, refused.value.message
                assert "space" in refused.value.message
                assert await client.list_sandboxes() == []
        finally:
            stop_server(server)


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve-disk", "overcommit"])
async def test_sandboxes_are_admitted_only_while_the_state_disk_holds_all_their_limits(tmp_path, reserve):
    """The images are sparse: were more admitted than the disk holds, one sandbox filling its own would fail the
    writes of the others (EIO). With --reserve-disk, on a 144 MB state disk (8 MB of it kept free for the image
    cache): a sandbox of 64 MB may take ~74 MB (its inode tables and metadata on top), so a second one does not fit
    beside it, a 32 MB one does, and the 64 MB one again once the first is deleted. Without it (the default), the
    second one is admitted: the disk holds it now."""
    if not os.path.exists("/dev/loop-control"):
        pytest.skip("this host has no loop devices")
    with small_state_disk(tmp_path / "state", 144) as state:
        server = start_deployment("root", state, "bwrap", *(["--reserve-disk"] if reserve else []))
        try:
            if (await enforcement(server)).disk != "filesystem":
                pytest.skip("this host gives sandboxes no file system of their own")
            async with server.client() as client:
                first = (await client.create_sandbox(limits={"disk_mb": 64})).id
                if not reserve:
                    second = (await client.create_sandbox(limits={"disk_mb": 64})).id
                    assert "overcommitted" in (await enforcement(server)).detail
                    for sandbox in (first, second):
                        await client.delete_sandbox(sandbox)
                    return
                assert "reserved on the state disk" in (await enforcement(server)).detail
                with pytest.raises(SandboxAPIError) as refused:
                    await client.create_sandbox(limits={"disk_mb": 64})
                assert refused.value.status == 507, refused.value.message
                assert "the live sandboxes' file systems may still take" in refused.value.message
                assert [box.id for box in await client.list_sandboxes()] == [first]  # nothing half-made stays
                small = (await client.create_sandbox(limits={"disk_mb": 32})).id
                await client.delete_sandbox(first)
                again = (await client.create_sandbox(limits={"disk_mb": 64})).id
                await client.delete_sandbox(small)
                # What a live one holds is counted once: in the disk's free space, no longer in what it may take.
                # (Counting its whole limit against the free space would refuse the next one after this write.)
                await client.exec(again, "dd if=/dev/zero of=f bs=1M count=40 2>&1", timeout=60)
                late = (await client.create_sandbox(limits={"disk_mb": 32})).id
                for sandbox in (late, again):
                    await client.delete_sandbox(sandbox)
        finally:
            stop_server(server)
