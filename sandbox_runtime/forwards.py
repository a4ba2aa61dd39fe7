"""Port forwards: one TCP port on a sandbox's own loopback that leads to one host address, and nowhere else.

A sandbox with `network: none` has a network namespace of its own holding only a loopback interface. A forward
`{"port": 8000, "target": "127.0.0.1:8766"}` makes `127.0.0.1:8000` inside every shell session of the sandbox
reach the target (an agent harness reaching the rollout service's LLM gateway): the server opens a listening
socket *inside* the session's network namespace and relays each connection it accepts to the target from the
host. The sandbox gets no route, no interface and no DNS: the one address is all it reaches.

Why a socket opened in the namespace, rather than a relay process inside the sandbox: the listening socket
belongs to this server (the sandbox cannot kill it, replace it or see where it leads), and the image needs no
program of ours. Python 3.11 has no `os.setns` (ctypes calls libc's), and a multithreaded process cannot join
a user namespace, so a forked child of the server (one thread) calls setns(2), binds the socket there, hands it
back over a Unix socket (SCM_RIGHTS) and exits: no program is executed. A root server's child enters only the
network namespace (root may); an unprivileged one's first joins the user namespace that owns it, as its owner
may.

One-shot runs (what eval uses) get no forward: grading never talks to the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import socket

from server_kit.errors import ProrlError

from . import procs
from .models import PortForward

log = logging.getLogger(__name__)

HELPER_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
RELAY_CHUNK = 64 * 1024
# Connections one session may have relayed at once: each costs the server two descriptors, and a sandbox's code
# may open as many as its limits allow. Past it a new connection is closed at once.
MAX_RELAYS_PER_SESSION = 64
_libc = ctypes.CDLL(None, use_errno=True)


class ForwardError(ProrlError):
    """A forward could not be opened; the session does not start."""


def _same_netns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except FileNotFoundError as exc:
        raise ForwardError(f"the sandbox's process {pid} is gone") from exc


async def listen_in_namespace(pid: int, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` in the network namespace of process `pid`. Every failure, the
    system's included (a process gone, no descriptor left, no fork), is a ForwardError, and nothing it opened
    stays open; the helper child is always reaped, also when the caller is cancelled."""
    opened: list[int] = []
    pair: tuple[socket.socket, socket.socket] | None = None
    child = 0
    try:
        if _same_netns(pid):  # never open a "sandbox" port on the host's own loopback
            raise ForwardError("the sandbox has no network namespace of its own (network: host?)")
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        opened.append(netns)
        userns = None if os.geteuid() == 0 else _owning_userns(netns)
        if userns is not None:
            opened.append(userns)
        pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours, theirs = pair
        child = os.fork()
        if child == 0:  # pragma: no cover - the child only binds the socket and exits
            _bind_in_child(netns, userns, port, theirs)
        theirs.close()
        try:
            status = await asyncio.wait_for(procs.wait_exit(child), HELPER_TIMEOUT_S)
        except TimeoutError:
            raise ForwardError(f"opening port {port} in the sandbox took over {HELPER_TIMEOUT_S:g} s") from None
        child = 0  # reaped
        message, fds, _, _ = socket.recv_fds(ours, 1024, 1, socket.MSG_DONTWAIT) if status == 0 else (b"", [], 0, 0)
        if status != 0 or not fds:
            raise ForwardError(f"cannot open port {port} in the sandbox: {_child_error(ours, message)}")
        listener = socket.socket(fileno=fds[0])
        listener.set_inheritable(False)
        listener.setblocking(False)
        return listener
    except OSError as exc:
        raise ForwardError(f"cannot open port {port} in the sandbox: {exc}") from exc
    finally:
        if child:  # timed out or cancelled while the helper ran: end it and reap it
            procs.kill(child)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
        for sock in pair or ():
            sock.close()
        for fd in opened:
            os.close(fd)


def _bind_in_child(netns: int, userns: int | None, port: int, back: socket.socket) -> None:
    """In the forked child (one thread, so it may join a user namespace): enter the namespaces, bind, listen,
    send the socket back, exit. Never returns; an error is sent back as text."""
    try:
        if userns is not None and _libc.setns(userns, CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), f"joining the user namespace: {os.strerror(ctypes.get_errno())}")
        if _libc.setns(netns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"joining the network namespace: {os.strerror(ctypes.get_errno())}")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", port))
        listener.listen(1024)
        socket.send_fds(back, [b"ok"], [listener.fileno()])
        os._exit(0)
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            back.sendall(str(exc).encode()[:1000])
        os._exit(1)


def _child_error(ours: socket.socket, message: bytes) -> str:
    with contextlib.suppress(OSError):
        message += ours.recv(1024, socket.MSG_DONTWAIT)
    return message.decode(errors="replace") or "no message"


def _owning_userns(netns: int) -> int:
    """An fd of the user namespace that owns the network namespace `netns` (ioctl NS_GET_USERNS). bwrap's
    --disable-userns runs the sandbox in a user namespace nested below that one; only the owner's gives the
    capability over the network namespace."""
    try:
        return fcntl.ioctl(netns, NS_GET_USERNS)
    except OSError as exc:
        raise ForwardError(f"cannot find the sandbox's user namespace: {exc}") from exc


class Forwards:
    """The forwards of one shell session: listeners in its namespace and the connections they relay."""

    def __init__(self, specs: list[PortForward]) -> None:
        self.specs = specs
        self._servers: list[asyncio.base_events.Server] = []
        self._relays: set[asyncio.Task[None]] = set()
        self._closed = False

    async def open(self, pid: int) -> None:
        try:
            for spec in self.specs:
                listener = await listen_in_namespace(pid, spec.port)
                try:
                    server = await asyncio.start_server(lambda r, w, s=spec: self._accept(r, w, s), sock=listener)
                except BaseException:
                    listener.close()
                    raise
                self._servers.append(server)
        except OSError as exc:
            await self.close()
            raise ForwardError(f"cannot serve a forward: {exc}") from exc
        except BaseException:
            await self.close()
            raise

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, spec: PortForward) -> None:
        if self._closed or len(self._relays) >= MAX_RELAYS_PER_SESSION:
            writer.close()
            return
        task = asyncio.ensure_future(self._relay(reader, writer, spec))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, spec: PortForward) -> None:
        target_writer = None
        try:
            target_reader, target_writer = await asyncio.open_connection(spec.target_host, spec.target_port)
            await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer))
        except OSError as exc:
            log.warning("forward to %s failed: %s", spec.target, exc)
        finally:  # whatever ended it (the target, the sandbox, a cancel): both sides are closed
            writer.close()
            if target_writer is not None:
                target_writer.close()

    async def close(self) -> None:
        """Stop listening and end every relayed connection. Bounded: from Python 3.12 a server's wait_closed
        also waits for its connections, which the relays' cancellation has closed already."""
        self._closed = True
        for server in self._servers:
            server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), CLOSE_TIMEOUT_S)
        self._servers.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close the other side (an HTTP client may wait for it)."""
    try:
        while data := await reader.read(RELAY_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
