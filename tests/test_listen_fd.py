"""Servers handed their listening socket (`--listen-fd`), and the ports of servers that bind their own.

A port found free and bound by a server a moment later can be taken in between by any other process: every
outgoing connection takes a port of the kernel's ephemeral range, and a test run or a node makes thousands (CI
failed so once: "address already in use" on a rollout service's port). So the launchers (launch/process.py,
dev/localstack.py) bind the socket first and hand it to our servers, and pick ports for the others (Redis,
vLLM) below the ephemeral range.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import pytest

from prorl_adapter.launch import process
from prorl_adapter.launch.process import ServerProcess, free_port, listening_socket
from server_kit.webapp import inherited_socket


def sandbox_main(tmp_path: Path, *argv: str) -> int:
    from sandbox_runtime.cli import main

    return main(["serve", *argv, "--state-dir", str(tmp_path / "state"), "--backend", "local"])


def rollout_main(tmp_path: Path, *argv: str) -> int:
    from prorl_adapter.service.cli import main

    return main(["serve", *argv, "--sandbox-url", "http://s", "--llm-url", "http://l", "--tokenizer", "t"])


MAINS = {"prorl-sandbox": sandbox_main, "prorl-rollout": rollout_main}


def printed(capsys) -> str:
    """What a command said on stderr, where both servers say why they cannot start."""
    return capsys.readouterr().err


def closed_fd(tmp_path: Path) -> int:
    fd = os.open(tmp_path, os.O_RDONLY)
    os.close(fd)
    return fd


@pytest.mark.parametrize("cli", MAINS)
@pytest.mark.parametrize("kind", ["closed", "negative", "file", "not listening", "udp", "unix socket"])
def test_a_descriptor_that_is_not_a_listening_tcp_socket_is_refused(cli, kind, tmp_path, capsys):
    held: list = []
    if kind == "closed":
        fd = closed_fd(tmp_path)
    elif kind == "negative":
        fd = -1
    elif kind == "file":
        held.append(open(tmp_path / "f", "w"))  # noqa: SIM115 - closed below
        fd = held[0].fileno()
    elif kind in ("not listening", "udp"):
        held.append(socket.socket(type=socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM))
        held[0].bind(("127.0.0.1", 0))
        fd = held[0].fileno()
    else:
        held.append(socket.socket(socket.AF_UNIX))
        held[0].bind(str(tmp_path / "s"))
        held[0].listen()
        fd = held[0].fileno()
    try:
        assert MAINS[cli](tmp_path, "--listen-fd", str(fd)) == 2
        assert f"--listen-fd {fd}" in printed(capsys)
        for thing in held:  # not the server's to close: the descriptor is still the caller's
            os.fstat(thing.fileno())
    finally:
        for thing in held:
            thing.close()


@pytest.mark.parametrize("cli", MAINS)
@pytest.mark.parametrize("address", [["--host", "127.0.0.1"], ["--port", "8000"]])
def test_a_handed_socket_takes_no_other_address(cli, address, tmp_path, capsys):
    with listening_socket("127.0.0.1") as sock:
        assert MAINS[cli](tmp_path, "--listen-fd", str(sock.fileno()), *address) == 2
        os.fstat(sock.fileno())  # refused before it was adopted: still the caller's
    assert "give it without --host and --port" in printed(capsys)


def test_an_adopted_socket_is_kept_from_everything_the_server_starts():
    """close-on-exec: no sandbox, launcher or other child inherits the server's listening socket."""
    with listening_socket("127.0.0.1") as sock:
        inherited = os.dup(sock.fileno())
        os.set_inheritable(inherited, True)  # as a child that was handed it holds it
        adopted = inherited_socket(inherited)
        try:
            assert adopted.fileno() == inherited and not os.get_inheritable(inherited)
            assert adopted.getsockname() == sock.getsockname()
        finally:
            adopted.close()


@pytest.mark.parametrize("cli", MAINS)
def test_a_handed_socket_on_a_public_address_still_needs_a_token(cli, tmp_path, capsys, monkeypatch):
    """The exposure rule reads the socket's own address, not --host's default (loopback)."""
    monkeypatch.delenv("PRORL_SANDBOX_TOKEN", raising=False)
    monkeypatch.delenv("PRORL_ROLLOUT_TOKEN", raising=False)
    with listening_socket("0.0.0.0") as sock:
        inherited = os.dup(sock.fileno())  # the server's own copy, as a child of the starter would hold
        assert MAINS[cli](tmp_path, "--listen-fd", str(inherited)) == 2
        with contextlib.suppress(OSError):  # whether the refused server's socket object closed it already
            os.close(inherited)
    assert "refusing to listen on '0.0.0.0' without a token" in printed(capsys)


def test_a_server_process_serves_on_the_socket_it_is_handed_and_the_starter_keeps_no_copy(tmp_path):
    listener = listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    serve_one = "import socket, sys; s = socket.socket(fileno=int(sys.argv[1])); c, _ = s.accept(); c.sendall(b'mine')"
    argv = [sys.executable, "-c", serve_one, str(listener.fileno())]
    server = ServerProcess("one-shot", argv, tmp_path / "log", listener=listener).start()
    try:
        assert listener.fileno() == -1  # closed here: only the server holds the port now
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            assert client.recv(16) == b"mine"
    finally:
        server.stop(5)


def test_ports_for_servers_that_bind_their_own_lie_below_the_ephemeral_range():
    low, _ = process._ephemeral_range()
    if low - process.FREE_PORTS_FROM < 1000:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it")
    picks = [free_port() for _ in range(20)]
    ports = set(picks)
    assert len(ports) == len(picks)  # never the same port twice: two servers started together would clash
    assert all(process.FREE_PORTS_FROM <= port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed
