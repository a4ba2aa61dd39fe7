"""Crash recovery and expiry: nothing of a sandbox outlives the server, its TTL, or its idle timeout."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from sandbox_runtime import procs

from .conftest import BACKEND_SKIPS, start_server, stop_server


def wait_until(condition, timeout: float = 20.0) -> bool:
    """Poll `condition` until it holds or `timeout` passes (for effects of a background reaper)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("backend", ["local", "bwrap"])
async def test_restart_after_sigkill_reaps_what_the_old_server_left(tmp_path, backend):
    if BACKEND_SKIPS[backend]:
        pytest.skip(BACKEND_SKIPS[backend])
    state = tmp_path / "state"
    first = start_server(state, backend)
    async with first.client() as client:
        box = await client.create_sandbox()
        # A process that ignores the terminal's hang-up, as a daemon the agent started would.
        result = await client.exec(box.id, "nohup sleep 1000 >/dev/null 2>&1 & echo $!")
        session_pid = (await client.get_sandbox(box.id)).sessions[0].pid
    survivors = procs.session_members(session_pid)
    assert survivors, "the sandbox's processes should be running"
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    assert (first.state_dir / "sandboxes" / box.id).is_dir()  # left behind by the crash

    second = start_server(state, backend)
    try:
        assert not (second.state_dir / "sandboxes" / box.id).exists()
        assert wait_until(lambda: procs.session_members(session_pid) == [])
        assert result.status == "completed"
        async with second.client() as client:
            assert await client.list_sandboxes() == []
    finally:
        stop_server(second)


async def test_a_second_server_on_the_same_state_dir_is_refused(tmp_path):
    first = start_server(tmp_path / "state", "local")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            start_server(tmp_path / "state", "local")
    finally:
        stop_server(first)


async def test_ttl_and_idle_timeout_reap_sandboxes(tmp_path):
    server = start_server(tmp_path / "state", "bwrap" if not BACKEND_SKIPS["bwrap"] else "local")
    try:
        async with server.client() as client:
            ttl = await client.create_sandbox(ttl_s=0.5)
            idle = await client.create_sandbox(idle_timeout_s=0.5)
            # A TTL shorter than the start-up itself: the creator still gets its sandbox (201), reaped after.
            instant = await client.create_sandbox(ttl_s=5e-324)
            kept = await client.create_sandbox()
            pid = ttl.sessions[0].pid
            url = server.url + "/v1/sandboxes/"

            def gone(box_id: str) -> bool:
                return httpx.get(url + box_id).status_code == 404

            assert wait_until(lambda: gone(ttl.id) and gone(idle.id) and gone(instant.id))
            assert not gone(kept.id)
            assert procs.session_members(pid) == []
            assert not (server.state_dir / "sandboxes" / ttl.id).exists()
            metrics = httpx.get(server.url + "/metrics").text
            assert 'prorl_sandbox_reaped_total{reason="ttl"} 2.0' in metrics
            assert 'prorl_sandbox_reaped_total{reason="idle"} 1.0' in metrics
    finally:
        stop_server(server)


async def test_sigterm_deletes_every_sandbox(tmp_path):
    server = start_server(tmp_path / "state", "bwrap" if not BACKEND_SKIPS["bwrap"] else "local")
    async with server.client() as client:
        box = await client.create_sandbox()
        await client.exec(box.id, "sleep 1000 &")
        pid = box.sessions[0].pid
    stop_server(server)  # SIGTERM, then wait for exit
    assert server.process.returncode == 0
    assert procs.session_members(pid) == []
    assert not (server.state_dir / "sandboxes" / box.id).exists()
