"""Both servers' front doors, tried as a flood would try them: half-sent requests, stalled bodies and thousands of
connections from one address (127.0.0.1 only, in bounded loops), against the real servers started as they are
deployed (the runtime by root and by an unprivileged user). Each test is a hole that was open before: aiohttp
bounds neither a request's headers nor its body in time, nor the connections a server holds."""

from __future__ import annotations

import os
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prorl_adapter.dev import localstack
from sandbox_runtime.client import SandboxClient

from .conftest import BACKEND_SKIPS, NOBODY, reachable

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))

DEPLOYMENTS = ["root", "unprivileged"]
DEADLINES = ("--header-timeout-s", "2", "--body-timeout-s", "2")
CLOSE_BOUND_S = 30.0  # the deadlines are 2 s: every half-sent request must be closed well within this
HALF_SENT = 300  # of each kind, per server
TOKEN = "front-door-token-0123456789"


@pytest.fixture(scope="module", autouse=True)
def enough_descriptors() -> None:
    """This process holds every socket of a flood: its soft descriptor limit up to its hard one."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this process may open {hard} descriptors; the floods need 4096")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_runtime(deployment: str, state: Path, *extra: str, nofile: int | None = None) -> localstack.Service:
    """The runtime as `deployment` runs it (root, or nobody under a root test run), with `nofile` as both its
    descriptor limits when given (prlimit execs the server: its pid is the server's)."""
    prefix = ["prlimit", f"--nofile={nofile}:{nofile}"] if nofile else []
    state = reachable(state)
    if deployment == "unprivileged" and os.geteuid() == 0:
        prefix += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        os.chown(state, NOBODY, NOBODY)
    elif deployment == "root" and os.geteuid() != 0:
        pytest.skip("the tests do not run as root: there is no root server to start")
    argv = [*prefix, *localstack.runtime_argv(state), "--backend", "bwrap", "--log-level", "WARNING", *extra]
    return localstack.start_service(f"{deployment} sandbox runtime", argv, "/healthz", 30)


def start_rollout(*extra: str) -> localstack.Service:
    return localstack.start_rollout_service([], [], *extra)


def descriptors(service: localstack.Service) -> int:
    return len(os.listdir(f"/proc/{service.process.pid}/fd"))


def port_of(service: localstack.Service) -> int:
    return int(service.url.rsplit(":", 1)[1])


def connect(port: int, count: int, send: bytes = b"") -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        if send:
            sock.sendall(send)
        sockets.append(sock)
    return sockets


def answers_until_closed(sockets: list[socket.socket], bound_s: float) -> list[bytes | None]:
    """What each socket received until the server closed it; None for those still open after `bound_s`."""
    received: dict[socket.socket, bytes] = {sock: b"" for sock in sockets}
    closed: dict[socket.socket, bytes] = {}
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + bound_s
        while len(closed) < len(sockets) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(timeout=left):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except (ConnectionResetError, BlockingIOError) as exc:
                    if isinstance(exc, BlockingIOError):
                        continue
                    data = b""
                if data:
                    received[sock] += data
                else:
                    selector.unregister(sock)
                    closed[sock] = received[sock]
    return [closed.get(sock) for sock in sockets]


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


@pytest.fixture(scope="module", params=["runtime-root", "runtime-unprivileged", "rollout"])
def server(request, tmp_path_factory) -> Iterator[tuple[localstack.Service, str]]:
    """A server with 2 s deadlines, and a path whose POST reads a JSON body (token-less: every request passes)."""
    if request.param == "rollout":
        service, path = start_rollout(*DEADLINES), "/v1/jobs"
    else:
        deployment = request.param.split("-", 1)[1]
        service, path = start_runtime(deployment, tmp_path_factory.mktemp("state"), *DEADLINES), "/v1/sandboxes"
    yield service, path
    service.stop()


def test_half_sent_requests_are_closed_within_a_bound(server):
    """Headers that never end get a 408 and are closed; a body that stalls is closed. Before, both stayed open
    as long as the client liked."""
    service, path = server
    port = port_of(service)
    headers = connect(port, HALF_SENT, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    body_start = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        '{"ttl_s": '
    ).encode()
    bodies = connect(port, HALF_SENT, body_start)
    try:
        header_answers = answers_until_closed(headers, CLOSE_BOUND_S)
        body_answers = answers_until_closed(bodies, CLOSE_BOUND_S)
    finally:
        close_all(headers + bodies)
    assert sum(answer is None for answer in header_answers) == 0, "half-sent headers left open"
    assert sum(answer is None for answer in body_answers) == 0, "stalled bodies left open"
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in header_answers)
    assert b"request headers not complete within 2 s" in header_answers[0]
    assert httpx.get(service.url + "/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
async def test_an_authorised_client_is_served_through_an_unauthenticated_flood(deployment, tmp_path):
    """1,500 silent connections and 300 complete requests without the token, all from 127.0.0.1, against a
    token-protected runtime allowed 1,024 descriptors: the authorised client still creates, uses and deletes a
    sandbox, the refused requests are each answered and closed, and the server's descriptors stay under half its
    limit above what it held before. Before, the flood took every descriptor and the create never got through."""
    runtime = start_runtime(deployment, tmp_path / "state", "--token", TOKEN, nofile=1024)
    try:
        before = descriptors(runtime)
        port = port_of(runtime)
        silent = connect(port, 1500)
        refused = connect(port, 300, b"GET /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            async with SandboxClient(runtime.url, token=TOKEN, timeout=60) as client:
                box = await client.create_sandbox(ttl_s=120)
                result = await client.run(box.id, script="echo served")
                await client.delete_sandbox(box.id)
            during = descriptors(runtime)
            answers = answers_until_closed(refused, CLOSE_BOUND_S)
        finally:
            close_all(silent + refused)
        assert result.exit_code == 0 and result.output.strip() == "served"
        assert during <= before + 1024 // 2, (before, during)
        assert all(answer is not None and answer.startswith(b"HTTP/1.1 401 ") for answer in answers)
    finally:
        runtime.stop()


def test_the_rollout_services_descriptors_stay_bounded_under_a_flood():
    """The rollout service under 600 silent connections, capped at 64: it holds at most that many, and a client
    still gets its answer."""
    service = start_rollout("--max-connections", "64")
    try:
        before = descriptors(service)
        silent = connect(port_of(service), 600)
        try:
            assert httpx.get(service.url + "/v1/status", timeout=30).status_code == 200
            during = descriptors(service)
        finally:
            close_all(silent)
        assert during <= before + 64, (before, during)
    finally:
        service.stop()
