"""The connection limits' defaults and the start-up refusals of both CLIs (the behaviour under a flood is in
integration_tests/test_slow_clients.py)."""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from prorl_adapter.models import JobRequest
from prorl_adapter.service import cli as rollout_cli
from prorl_adapter.service import gateway, server
from prorl_adapter.service.gateway import Gateway
from sandbox_runtime import cli as runtime_cli
from server_kit.connections import DEFAULT_MAX_CONNECTIONS, ConnectionLimits, raise_descriptor_limit
from server_kit.webapp import Site, bound_socket, json_api, serve_sites


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    try:
        assert raise_descriptor_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_default_caps_leave_half_the_descriptors_to_the_server():
    limits = ConnectionLimits().resolve()
    room = raise_descriptor_limit() // 2
    assert limits.max_connections == min(DEFAULT_MAX_CONNECTIONS, room)
    assert limits.max_connections_per_peer == limits.max_connections // 4
    assert ConnectionLimits(max_connections=40, max_connections_per_peer=40).resolve().max_connections_per_peer == 40


@pytest.mark.parametrize(
    ("limits", "fragment"),
    [
        (ConnectionLimits(max_connections=10**9), "would leave too few descriptors"),
        (ConnectionLimits(max_connections=10, max_connections_per_peer=11), "is above --max-connections 10"),
        (ConnectionLimits(header_timeout_s=0), "--header-timeout-s 0 must be in (0, 86400]"),
        (ConnectionLimits(body_timeout_s=-1), "--body-timeout-s -1 must be"),
        (ConnectionLimits(max_connections=-1), "--max-connections -1 must be an integer >= 0"),
    ],
)
def test_limits_that_cannot_work_are_refused_naming_the_flag(limits, fragment):
    with pytest.raises(ValueError) as refused:
        limits.resolve()
    assert fragment in str(refused.value)


@pytest.mark.parametrize(
    ("main", "argv", "program"),
    [
        (runtime_cli.main, ["serve", "--max-connections", "999999999"], "prorl-sandbox"),
        (rollout_cli.main, ["serve", "--tokenizer", "x", "--max-connections", "999999999"], "prorl-rollout"),
    ],
)
def test_a_server_with_caps_beyond_its_descriptors_says_why_in_one_line(main, argv, program, capsys):
    assert main(argv) == 2
    out = capsys.readouterr().err  # where both servers say why they cannot start
    assert out.startswith(f"{program}: --max-connections 999999999 would leave too few descriptors")
    assert out.count("\n") == 1


# -- the guards at work: both of the rollout service's real applications, served in this process on loopback ------
API_TOKEN = "the-api-token-0123456789"


@contextlib.asynccontextmanager
async def served(limits: ConnectionLimits) -> AsyncIterator[tuple[int, int, Gateway]]:
    """The rollout API (with a token) and the LLM gateway, each on its own loopback listener as `serve` runs them
    (the API's handlers that need the pipeline are not called); yields their ports and the gateway."""
    requests = PromCounter("test_requests", "", ["route", "status"], registry=CollectorRegistry())
    api = json_api(server.ROLLOUT_API, API_TOKEN, 16 * 1024 * 1024, requests)
    gateway_app = gateway.create_gateway_app(requests)
    gateway_app[gateway.GATEWAY] = gate = gateway.Gateway(None, None, None)  # type: ignore[arg-type]
    sockets = [bound_socket("127.0.0.1", 0), bound_socket("127.0.0.1", 0)]
    ports = [sock.getsockname()[1] for sock in sockets]
    stop = asyncio.Event()
    sites = [
        Site(api, "127.0.0.1", 0, "api", sock=sockets[0]),
        Site(gateway_app, "127.0.0.1", 0, "gw", sock=sockets[1]),
    ]
    task = asyncio.create_task(serve_sites(sites, limits, stop))
    await asyncio.sleep(0.2)  # the listeners start
    try:
        yield ports[0], ports[1], gate
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def closed_within(reader: asyncio.StreamReader, bound_s: float) -> bytes | None:
    """What the server sent until it closed the connection; None if still open after `bound_s`."""
    received = b""
    deadline = asyncio.get_running_loop().time() + bound_s
    try:
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                return received
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        return received
    return None


def post_head(path: str, length: int, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def test_a_gateway_flood_with_valid_keys_leaves_the_api_answering():
    """Sandbox code holding valid gateway keys fills the gateway's connections with requests whose bodies never
    end: each key gets REQUESTS_PER_KEY of them (the next is refused, 429, before its body), and the trainer's API,
    behind a guard of its own, still answers. Before, one guard served both, and the API's newcomers were refused."""
    limits = ConnectionLimits(body_timeout_s=30, max_connections=16, max_connections_per_peer=16)
    async with served(limits) as (api_port, gateway_port, gate):
        keys = [gate.open(f"job-{i}", JobRequest(task="shell")).key for i in range(2)]
        flood = []

        async def trickle(key: str) -> asyncio.StreamReader:
            reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
            writer.write(post_head(f"/gateway/{key}/v1/chat/completions", 100_000) + b'{"messages": [')
            flood.append(writer)
            return reader

        held = [await trickle(keys[0]) for _ in range(gateway.REQUESTS_PER_KEY)]
        await asyncio.sleep(0.3)
        refused = await asyncio.wait_for((await trickle(keys[0])).readline(), 5)  # before its body
        assert refused.startswith(b"HTTP/1.1 429 "), refused
        held += [await trickle(keys[1]) for _ in range(gateway.REQUESTS_PER_KEY)]
        await asyncio.sleep(0.3)
        for reader in held:  # all held, in admitted requests: the gateway is full
            assert await closed_within(reader, 0.05) is None
        assert await closed_within(await trickle(keys[1]), 5) == b""  # a newcomer finds no room there
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=5) as http:
            for _ in range(20):  # more newcomers than either cap
                assert (await http.get(f"http://127.0.0.1:{api_port}/healthz")).status_code == 200
        for writer in flood:
            writer.close()


async def test_a_trickled_body_is_cut():
    """A byte every 0.3 s never stalls for body_timeout_s (1 s), but 100 kB at that rate would take eight hours:
    at min_body_rate 1000 bytes/s the connection is closed within about body_timeout_s. Before, it stayed open."""
    limits = ConnectionLimits(body_timeout_s=1, min_body_rate=1000)
    async with served(limits) as (api_port, _gateway_port, _gate):
        reader, writer = await asyncio.open_connection("127.0.0.1", api_port)
        writer.write(post_head("/v1/jobs", 100_000, API_TOKEN) + b"{")
        started = asyncio.get_running_loop().time()
        closed = None
        for _ in range(40):  # 12 s at most
            writer.write(b" ")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            closed = await closed_within(reader, 0.3)
            if closed is not None:
                break
        took = asyncio.get_running_loop().time() - started
        writer.close()
        assert closed is not None, "a trickled body held its connection"
        assert took < 4, took


async def test_only_a_checked_credential_admits_a_connection():
    """On a server with a token: a public path answered without it (/healthz) does not keep the connection alive
    (it would be an "admitted" one, the last to go for room); an authorised request answered 400 by its handler
    does (it was admitted before the handler ran). Before, it was the other way round for both."""
    async with served(ConnectionLimits()) as (api_port, _gateway_port, _gate):
        reader, writer = await asyncio.open_connection("127.0.0.1", api_port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = await closed_within(reader, 5)
        assert answer is not None and answer.startswith(b"HTTP/1.1 200 "), answer
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", api_port)
        writer.write(post_head("/v1/jobs", 2, API_TOKEN) + b"{}")
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.startswith(b"HTTP/1.1 400 "), status
        assert await closed_within(reader, 0.5) is None  # kept alive
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"HTTP/1.1 200 " in await asyncio.wait_for(reader.read(65536), 5)
        writer.close()
