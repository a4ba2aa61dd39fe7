"""Containment: what an isolating backend keeps inside the sandbox. Runs against bwrap (and apptainer where
it is installed); the `local` backend isolates nothing and is not tested here."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from sandbox_runtime import procs
from sandbox_runtime.client import SandboxAPIError, SandboxClient

from .conftest import BACKEND_SKIPS, ISOLATED, start_unprivileged_server, stop_server


@pytest.fixture
async def client(runtime):
    if runtime.backend not in ISOLATED:
        pytest.skip(f"the {runtime.backend} backend does not isolate")
    async with runtime.client() as client:
        yield client


async def make_box(client, runtime, **spec):
    return await client.create_sandbox(image=runtime.image(), **spec)


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def processes_in_namespace(namespace: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and pid_namespace(int(p)) == namespace]


@pytest.fixture
def unprivileged_bwrap_server(tmp_path):
    """The runtime as an unprivileged user runs it (the pids limit held under a root server is tested in
    test_security.py)."""
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    server = start_unprivileged_server(tmp_path / "state", "bwrap")
    yield server
    stop_server(server)


async def test_fork_bomb_is_contained_by_the_pids_limit(unprivileged_bwrap_server):
    async with SandboxClient(unprivileged_bwrap_server.url) as client:
        box = await client.create_sandbox(limits={"pids": 64})
        try:
            bomb = await client.exec(box.id, "bomb() { bomb | bomb & }; bomb; sleep 2", timeout=3)
            assert bomb.status in ("completed", "timeout", "dead")
            session_pid = (await client.get_sandbox(box.id)).sessions[0].pid
            inits = procs.children(session_pid)
            if inits:  # the bomb's processes never outnumber the limit (bwrap's init aside)
                assert len(processes_in_namespace(pid_namespace(inits[0]))) <= 64 + 1
            # The bomb's survivors keep the shell busy retrying forks; deleting the session kills them all,
            # and the sandbox goes on with a fresh shell.
            with contextlib.suppress(SandboxAPIError):
                await client.delete_session(box.id, "default")
            result = await client.exec(box.id, "echo ok", timeout=20)
            assert (result.status, result.output) == ("completed", "ok\n")
        finally:
            await client.delete_sandbox(box.id)


async def test_memory_hog_is_contained(client, runtime):
    box = await make_box(client, runtime, limits={"memory_mb": 256})
    try:
        result = await client.exec(box.id, "python3 -c 'x = bytearray(2 * 1024**3)'; echo rc=$?", timeout=30)
        assert "MemoryError" in result.output and "rc=1" in result.output
    finally:
        await client.delete_sandbox(box.id)


async def test_disk_fill_is_stopped_by_the_file_size_limit(client, runtime):
    box = await make_box(client, runtime, limits={"file_size_mb": 5})
    try:
        result = await client.exec(box.id, "dd if=/dev/zero of=big bs=1M count=50; stat -c %s big", timeout=30)
        # SIGXFSZ at its default disposition kills the writer (with it ignored, the write would fail with EFBIG)
        assert "File size limit exceeded" in result.output
        assert int(result.output.split()[-1]) <= 5 * 1024 * 1024
    finally:
        await client.delete_sandbox(box.id)


async def test_no_network_by_default(client, runtime):
    box = await make_box(client, runtime)
    try:
        # The runtime server itself listens on the host's loopback: from inside it must be unreachable.
        probe = (
            "python3 -c 'import socket; s = socket.socket(); s.settimeout(2); "
            f'print("reached" if s.connect_ex(("127.0.0.1", {runtime.port})) == 0 else "unreachable")\''
        )
        assert (await client.exec(box.id, probe, timeout=20)).output.strip() == "unreachable"
    finally:
        await client.delete_sandbox(box.id)


async def test_host_processes_and_home_are_invisible(client, runtime):
    box = await make_box(client, runtime)
    try:
        listing = await client.exec(box.id, "ls /proc | grep -c '^[0-9]'; ls -A /home /root 2>/dev/null | wc -l")
        visible, home_entries = (int(n) for n in listing.output.split())
        assert visible < 10  # the sandbox's own shell and the command, not the host's hundreds
        assert home_entries == 0
        server_pid = runtime.process.pid
        seen = await client.exec(box.id, f"cat /proc/{server_pid}/cmdline 2>/dev/null; echo")
        assert "sandbox_runtime" not in seen.output
        state = await client.exec(box.id, f"ls {runtime.state_dir}/sandboxes 2>/dev/null | wc -l")
        assert state.output.strip() == "0"  # other sandboxes' workspaces are not visible
    finally:
        await client.delete_sandbox(box.id)


async def test_delete_leaves_no_process_behind(client, runtime):
    box = await make_box(client, runtime)
    # The command returns once all three run: `setsid` may fork again before its sleep starts, so the shell
    # waits for three `sleep`s in its own /proc rather than for the forks alone.
    started = "until [ $(cat /proc/[0-9]*/comm 2>/dev/null | grep -cx sleep) -ge 3 ]; do :; done"
    await client.exec(box.id, f"sleep 1001 & setsid sleep 1002 & nohup sleep 1003 >/dev/null 2>&1 & {started}")
    session_pid = (await client.get_sandbox(box.id)).sessions[0].pid
    inits = procs.children(session_pid)
    assert inits, "bwrap's namespace init should be a child of the session's process"
    namespace = pid_namespace(inits[0])
    inside = processes_in_namespace(namespace)
    assert len(inside) >= 5  # init, bash, three sleeps
    await client.delete_sandbox(box.id)
    assert processes_in_namespace(namespace) == []
    assert not Path(runtime.state_dir, "sandboxes", box.id).exists()


async def test_two_hundred_sandboxes_run_commands_at_once(bwrap_runtime):
    async with bwrap_runtime.client(timeout=120) as client:
        # Small disks: under a root server each may take its whole limit of the state disk, and creations are
        # admitted only while the disk holds them all (200 of the default 4 GiB would not fit).
        boxes = await asyncio.gather(*(client.create_sandbox(limits={"disk_mb": 16}) for _ in range(200)))
        try:
            results = await asyncio.gather(
                *(client.exec(b.id, f"echo {i}; sleep 0.2; echo done-{i}", timeout=60) for i, b in enumerate(boxes))
            )
            assert [r.output for r in results] == [f"{i}\ndone-{i}\n" for i in range(200)]
        finally:
            await asyncio.gather(*(client.delete_sandbox(b.id) for b in boxes))
        assert await client.list_sandboxes() == []


async def test_nothing_the_server_holds_open_reaches_a_sandbox(client, runtime):
    """A session's shell has its terminal and nothing else: not the server's sockets, another sandbox's
    terminal, or a uid's lock file. The server closes nothing for its children: every descriptor it opens is
    close-on-exec (sandbox_runtime/spawn.py), and this shows that none slipped through."""
    other = await make_box(client, runtime)  # its terminal is open in the server meanwhile
    box = await make_box(client, runtime)
    try:
        shell = await client.exec(box.id, "ls /proc/$$/fd")  # an interactive bash keeps its terminal as 255 too
        assert sorted(shell.output.split(), key=int) == ["0", "1", "2", "255"]
        child = await client.exec(box.id, "ls /proc/self/fd")  # 3: the directory ls reads
        assert sorted(child.output.split(), key=int) == ["0", "1", "2", "3"]
        run = await client.run(box.id, argv=["ls", "/proc/self/fd"])
        assert sorted(run.output.split(), key=int) == ["0", "1", "2", "3"]
    finally:
        await client.delete_sandbox(box.id)
        await client.delete_sandbox(other.id)
