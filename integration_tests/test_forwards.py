"""Port forwards (sandbox_runtime/forwards.py): a port on a sandbox's own loopback that reaches one host address,
and nothing else. Run against real bwrap sandboxes under a root server (as CI runs it) and an unprivileged one."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from sandbox_runtime.client import SandboxAPIError

from .conftest import BACKEND_SKIPS, start_server, start_unprivileged_server, stop_server

# Connect to 127.0.0.1:PORT from inside, send a line, print what comes back (or why nothing does).
PROBE = (
    "python3 -c 'import socket,sys; s=socket.socket(); s.settimeout(5);"
    ' r=s.connect_ex(("127.0.0.1",int(sys.argv[1])));'
    ' print("refused" if r else (s.sendall(b"ping\\n") or s.recv(100).decode().strip()))\' {port}'
)


@pytest.fixture
async def echo_server():
    """A TCP server on the host's loopback that answers each line with `echo:` and the line."""

    async def answer(reader, writer):
        line = await reader.readline()
        writer.write(b"echo:" + line)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.fixture
def unprivileged_server(tmp_path):
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    server = start_unprivileged_server(tmp_path / "state", "bwrap")
    yield server
    stop_server(server)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def check_forward_reaches_only_its_target(server, echo_port: int) -> None:
    async with server.client() as client:
        box = await client.create_sandbox(forwards=[{"port": 8000, "target": f"127.0.0.1:{echo_port}"}])
        try:
            assert (await client.exec(box.id, PROBE.format(port=8000), timeout=20)).output.strip() == "echo:ping"
            # The target itself, and the runtime's own port, stay out of reach: the forward is the only way out.
            assert (await client.exec(box.id, PROBE.format(port=echo_port), timeout=20)).output.strip() == "refused"
            assert (await client.exec(box.id, PROBE.format(port=server.port), timeout=20)).output.strip() == "refused"
            # Every session has its own network namespace, and the forward in it.
            again = await client.exec(box.id, PROBE.format(port=8000), timeout=20, session="second")
            assert again.output.strip() == "echo:ping"
            # Eval's one-shot runs get no forward.
            run = await client.run(box.id, script=PROBE.format(port=8000), timeout=20)
            assert run.output.strip() == "refused"
            assert [f.port for f in (await client.get_sandbox(box.id)).forwards] == [8000]
        finally:
            await client.delete_sandbox(box.id)


async def test_forward_reaches_its_target_and_nothing_else_under_root_server(bwrap_runtime, echo_server):
    await check_forward_reaches_only_its_target(bwrap_runtime, echo_server)


async def test_forward_under_an_unprivileged_server(unprivileged_server, echo_server):
    await check_forward_reaches_only_its_target(unprivileged_server, echo_server)


async def test_forwards_leave_no_descriptor_behind(bwrap_runtime, echo_server):
    """Listeners and relayed connections are closed with their session: a server making and deleting sandboxes
    with forwards for days holds no more descriptors than before."""
    pid = bwrap_runtime.process.pid
    async with bwrap_runtime.client() as client:

        async def cycle():
            box = await client.create_sandbox(forwards=[{"port": 9000, "target": f"127.0.0.1:{echo_server}"}])
            await client.exec(box.id, PROBE.format(port=9000), timeout=20)
            await client.delete_sandbox(box.id)

        await cycle()  # the first one opens what the server keeps (its client sessions, a log file)
        before = open_fds(pid)
        for _ in range(5):
            await cycle()
        assert open_fds(pid) <= before


async def test_a_sandbox_opening_many_connections_holds_a_bounded_number_of_the_servers_descriptors(
    bwrap_runtime, echo_server
):
    """Each relayed connection costs the server two descriptors; a sandbox's code opening hundreds (and keeping
    them) gets MAX_RELAYS_PER_SESSION relayed, the rest closed, so it cannot exhaust the server's."""
    from sandbox_runtime.forwards import MAX_RELAYS_PER_SESSION

    pid = bwrap_runtime.process.pid
    async with bwrap_runtime.client() as client:
        box = await client.create_sandbox(forwards=[{"port": 8000, "target": f"127.0.0.1:{echo_server}"}])
        try:
            before = open_fds(pid)
            # Open 300 connections and keep them until told; say when they are open.
            hold = (
                'python3 -c \'import os,socket,time; s=[socket.create_connection(("127.0.0.1",8000),5) for _ in'
                ' range(300)]; open("/tmp/held","w").close()\nwhile not os.path.exists("/tmp/release"):'
                " time.sleep(0.05)\nprint(len(s))'"
            )
            task = asyncio.ensure_future(client.exec(box.id, hold, timeout=60))
            while not (await client.exec(box.id, "test -e /tmp/held && echo yes", session="probe")).output.strip():
                pass  # each probe is a round trip to the sandbox: the held connections are open once it says so
            held = open_fds(pid) - before
            assert held <= 2 * MAX_RELAYS_PER_SESSION + 8, held
            await client.write_file(box.id, "/tmp/release", "")
            assert (await task).output.strip() == "300"
            assert (await client.exec(box.id, PROBE.format(port=8000), timeout=20)).output.strip() == "echo:ping"
        finally:
            await client.delete_sandbox(box.id)


async def test_forward_to_a_closed_port_fails_the_connection_not_the_sandbox(bwrap_runtime):
    async with bwrap_runtime.client() as client:
        box = await client.create_sandbox(forwards=[{"port": 8000, "target": "127.0.0.1:1"}])
        try:
            result = await client.exec(
                box.id,
                'python3 -c \'import socket; s=socket.create_connection(("127.0.0.1",8000),5);'
                " print(repr(s.recv(10)))'",
                timeout=20,
            )
            assert result.output.strip() == "b''"  # accepted, then closed: the target is down
            assert (await client.exec(box.id, "echo alive")).output.strip() == "alive"
        finally:
            await client.delete_sandbox(box.id)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"network": "host", "forwards": [{"port": 8000, "target": "127.0.0.1:80"}]}, "network: none"),
        ({"forwards": [{"port": 8000, "target": "127.0.0.1:80"}] * 2}, "two forwards on one port"),
        ({"forwards": [{"port": 8000, "target": "127.0.0.1:99999"}]}, "no port"),
        ({"forwards": [{"port": 8000, "target": "host;rm -rf /:80"}]}, "target"),
        ({"forwards": [{"port": 0, "target": "127.0.0.1:80"}]}, "port"),
    ],
)
async def test_bad_forwards_are_refused(bwrap_runtime, spec, message):
    async with bwrap_runtime.client() as client, aiohttp.ClientSession() as http:
        before = await client.list_sandboxes()
        async with http.post(f"{bwrap_runtime.url}/v1/sandboxes", json=spec) as reply:
            assert reply.status == 400 and message in (await reply.json())["error"]
        assert await client.list_sandboxes() == before


async def test_a_backend_without_network_namespaces_refuses_forwards(tmp_path, echo_server):
    server = start_server(tmp_path / "local-state", "local", None, "--allow-local")
    try:
        async with server.client() as client:
            with pytest.raises(SandboxAPIError) as refused:
                await client.create_sandbox(forwards=[{"port": 8000, "target": f"127.0.0.1:{echo_server}"}])
            assert refused.value.status == 400 and "cannot forward" in str(refused.value)
    finally:
        stop_server(server)
