"""What both servers allow a connection before, while and after it shows a request: the front door's bounds.

aiohttp bounds neither how long a request's headers may take nor how long its body may stall (its keep-alive
timer is the only clock, and it is an hour by default), nor how many connections are open. So a client could
hold thousands of half-sent requests open forever, or, with enough of them, every descriptor the server has. The
`ConnectionGuard` wraps aiohttp's protocol (by asyncio's Protocol interface only: nothing of aiohttp's internals)
and holds these invariants:

- A connection that has not yet shown a complete request (new, or a keep-alive one whose next request has begun)
  has `header_timeout_s` to finish its headers; then it gets a 408 and is closed.
- A request whose body is awaited by the server and receives nothing for `body_timeout_s` is closed; so is one
  whose body comes slower than `min_body_rate` bytes/s on average after the first `body_timeout_s` (a body must
  arrive within body_timeout_s + its size / min_body_rate: a byte every few seconds holds no request open for
  ever). A body the server is not reading (the transport paused because the handler has not consumed what came)
  is never the client's fault: that time is not counted.
- A request is admitted when it passed the gates and, on a server with a credential (a token, a gateway key), a
  credential was actually checked (`mark_credential_checked`): a public path answered without one admits nothing.
  A connection is an authorised client's once one of its requests was admitted (decided before the handler runs,
  so a handler's 400 does not close it). A connection none of whose requests was admitted is closed after its
  answer, so an unauthenticated client holds a connection only while it sends one request.
- At most `max_connections` are open, and `max_connections_per_peer` from one address. A connection beyond a cap
  takes the place of the oldest one that was never admitted (in a request or not), then of the oldest
  authorised one not in an admitted request, skipping those still writing an answer (an answer is written after
  the middlewares return; one whose client has not read it for `body_timeout_s` is not spared): a connection in
  an admitted request is never closed for room, so an authorised client keeps working through a flood from the
  same address (everything is 127.0.0.1 on one machine: per-peer counts alone cannot tell a tenant from an
  attacker). Only when no connection can go is the newcomer closed.
- Each site (the rollout service's API, its LLM gateway, the runtime's API) has a guard of its own: a flood of
  one listener (sandbox code holding a valid gateway key, say) cannot take the connections of another.
- The caps leave descriptors for the server's own work: the soft RLIMIT_NOFILE is raised to the hard one at
  start-up, and connections may use at most half of it, shared by the sites (the default per site is the smaller
  of its share and 8192).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from aiohttp import web

log = logging.getLogger(__name__)
DEFAULT_MAX_CONNECTIONS = 8192
TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)
# Set by a gate that compared a credential the request carries and found it right (`mark_credential_checked`).
CREDENTIAL_CHECKED = web.RequestKey("credential_checked", bool)
REFUSAL_LOG_S = 10.0  # at most one warning per this many seconds about closed connections: a flood is no log flood


@dataclass(frozen=True)
class ConnectionLimits:
    """The front-door settings of a server (both CLIs take them: `add_connection_arguments`). 0 connections: the
    default, derived from the descriptor limit by `resolve`."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    min_body_rate: float = 16 * 1024  # bytes/s a body must average after its first body_timeout_s
    idle_timeout_s: float = 60.0  # a keep-alive connection with no request begun (aiohttp's own timer)
    max_connections: int = 0
    max_connections_per_peer: int = 0

    def resolve(self, sites: int = 1) -> ConnectionLimits:
        """These limits with the caps filled in for each of `sites` listeners (each has a guard of its own), after
        raising the soft descriptor limit to the hard one. ValueError, naming the setting, for a bound that is not
        positive or caps that would leave the server without descriptors for its own work."""
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not 0 < getattr(self, name) <= 86_400:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name):g} must be in (0, 86400]")
        if not self.min_body_rate > 0:
            raise ValueError(f"--min-body-rate {self.min_body_rate:g} must be > 0 (bytes/s)")
        for name in ("max_connections", "max_connections_per_peer"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} must be an integer >= 0")
        limit = raise_descriptor_limit()
        room = max(limit // 2 // sites, 1)
        total = self.max_connections or min(DEFAULT_MAX_CONNECTIONS, room)
        if total > room:
            each = f" for each of its {sites} listeners" if sites > 1 else ""
            raise ValueError(
                f"--max-connections {total} would leave too few descriptors: the limit is {limit} (RLIMIT_NOFILE), "
                f"so at most {room}{each}; raise the limit (ulimit -n) or lower --max-connections"
            )
        per_peer = self.max_connections_per_peer or max(total // 4, 1)
        if per_peer > total:
            raise ValueError(f"--max-connections-per-peer {per_peer} is above --max-connections {total}")
        return replace(self, max_connections=total, max_connections_per_peer=per_peer)


def raise_descriptor_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (the kernel's nr_open where the hard one is unlimited)
    and answer the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        try:
            hard = int(open("/proc/sys/fs/nr_open").read())  # noqa: SIM115 (one read of a proc file)
        except (OSError, ValueError):
            hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        soft = hard
    return soft


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The front-door flags, as both servers take them (`connection_limits` reads them back)."""
    defaults = ConnectionLimits()
    group = parser.add_argument_group("connections (slow and unfinished requests)")
    group.add_argument(
        "--header-timeout-s",
        type=float,
        default=defaults.header_timeout_s,
        help="seconds a request's headers may take, from its first byte (or from the connection): then 408 and "
        "closed (default %(default)g)",
    )
    group.add_argument(
        "--body-timeout-s",
        type=float,
        default=defaults.body_timeout_s,
        help="seconds a request body being read may go without data before the connection is closed; also the "
        "grace before --min-body-rate applies (default %(default)g)",
    )
    group.add_argument(
        "--min-body-rate",
        type=float,
        default=defaults.min_body_rate,
        help="bytes/s a request body must average: it must arrive within --body-timeout-s + its size / this rate, "
        "or the connection is closed (default %(default)g)",
    )
    group.add_argument(
        "--idle-timeout-s",
        type=float,
        default=defaults.idle_timeout_s,
        help="seconds an idle keep-alive connection stays open (default %(default)g)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="open connections at most, per listener (default 0: half the descriptor limit shared by the "
        f"listeners, at most {DEFAULT_MAX_CONNECTIONS} each); a newcomer beyond it replaces the oldest connection "
        "that has shown no admitted request",
    )
    group.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=0,
        help="open connections from one address at most (default 0: a quarter of --max-connections)",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        min_body_rate=args.min_body_rate,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer,
    )


class Connection:
    """One accepted connection, as the guard sees it: waiting for a request's headers, in a request, or idle."""

    __slots__ = (
        "admitted",
        "body_s",
        "checked_at",
        "in_admitted",
        "last_data",
        "peer",
        "received",
        "request",
        "state",
        "timer",
        "transport",
        "write_paused_at",
    )

    def __init__(self, transport: asyncio.Transport, peer: str, now: float) -> None:
        self.transport = transport
        self.peer = peer
        self.state = "headers"  # "headers" | "request" | "idle"
        self.admitted = False  # one of its requests was admitted: it is an authorised client's
        self.in_admitted = False  # its current request was admitted: it is not closed for room
        self.timer: asyncio.TimerHandle | None = None
        self.request: web.BaseRequest | None = None
        self.last_data = now
        self.received = 0  # bytes received since its current request's headers were complete
        self.body_s = 0.0  # seconds its current request's body has been read (not counting pauses)
        self.checked_at = now
        self.write_paused_at: float | None = None  # since when its answer waits for the client to read


CONNECTION_GUARD = web.AppKey("connection_guard", "ConnectionGuard")


class ConnectionGuard:
    """The bounds of the module docstring for one site (listener) of a server process: `protocol_factory` wraps
    the site's aiohttp server, the two middlewares tell it when a request's headers are complete
    (`request_seen`, outermost) and when it passed the gates (`request_admitted`, inside them)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._loop = asyncio.get_running_loop()
        self._open: dict[asyncio.BaseTransport, Connection] = {}
        self._per_peer: Counter[str] = Counter()
        # Candidates to close for room, oldest first (dicts keep insertion order): never one in an admitted request.
        self._unproven: dict[Connection, None] = {}
        self._idle: dict[Connection, None] = {}
        self.closed_for_room = 0
        self.refused = 0
        self.timed_out = 0
        self._last_warning = -REFUSAL_LOG_S

    def __len__(self) -> int:
        return len(self._open)

    def protocol_factory(self, make_handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: GuardedProtocol(self, make_handler)

    # -- connections -----------------------------------------------------------------------------------------
    def admit(self, transport: asyncio.Transport) -> Connection | None:
        """Record a new connection, making room by closing others if a cap is reached; None: no room."""
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        if self._per_peer[peer] >= self.limits.max_connections_per_peer and not self._make_room(peer):
            return self._refuse(peer, "per-peer")
        if len(self._open) >= self.limits.max_connections and not self._make_room(None):
            return self._refuse(peer, "total")
        connection = Connection(transport, peer, self._loop.time())
        self._open[transport] = connection
        self._per_peer[peer] += 1
        self._unproven[connection] = None
        self._await_headers(connection)
        return connection

    def _refuse(self, peer: str, cap: str) -> None:
        self.refused += 1
        self._warn(f"connection from {peer} closed: every connection ({cap} cap) is in an admitted request")
        return None

    def _writing(self, connection: Connection) -> bool:
        """Whether an authorised connection is still sending an answer its client reads (not one it has left
        unread for body_timeout_s: such a client could otherwise pin connections by never reading)."""
        if connection.transport.get_write_buffer_size() == 0:
            return False
        paused = connection.write_paused_at
        return paused is None or self._loop.time() - paused < self.limits.body_timeout_s

    def _make_room(self, peer: str | None) -> bool:
        for kind, candidates in (("unproven", self._unproven), ("idle", self._idle)):
            victim = next(
                (
                    c
                    for c in candidates
                    if (peer is None or c.peer == peer) and (candidates is self._unproven or not self._writing(c))
                ),
                None,
            )
            if victim is not None:
                self.closed_for_room += 1
                self._warn(f"at a connection cap: closing the oldest {kind} connections for newcomers")
                self.forget(victim)
                victim.transport.abort()  # its descriptor now, not after a goodbye
                return True
        return False

    def forget(self, connection: Connection) -> None:
        if self._open.pop(connection.transport, None) is None:
            return
        self._per_peer[connection.peer] -= 1
        if not self._per_peer[connection.peer]:
            del self._per_peer[connection.peer]
        self._unproven.pop(connection, None)
        self._idle.pop(connection, None)
        self._cancel_timer(connection)

    def data(self, connection: Connection, size: int) -> None:
        connection.last_data = self._loop.time()
        connection.received += size
        if connection.state == "idle":  # the next request has begun: its headers have their deadline
            connection.state = "headers"
            self._await_headers(connection)

    def writing_paused(self, connection: Connection, paused: bool) -> None:
        connection.write_paused_at = self._loop.time() if paused else None

    # -- deadlines -------------------------------------------------------------------------------------------
    def _cancel_timer(self, connection: Connection) -> None:
        if connection.timer is not None:
            connection.timer.cancel()
            connection.timer = None

    def _await_headers(self, connection: Connection) -> None:
        self._cancel_timer(connection)
        connection.timer = self._loop.call_later(self.limits.header_timeout_s, self._headers_late, connection)

    def _headers_late(self, connection: Connection) -> None:
        connection.timer = None
        if connection.state != "headers" or connection.transport.is_closing():
            return
        self.timed_out += 1
        body = b'{"error": "request headers not complete within %g s", "status": 408}' % self.limits.header_timeout_s
        self.forget(connection)
        connection.transport.write(TIMEOUT_ANSWER % (len(body), body))
        connection.transport.close()

    def _watch_body(self, connection: Connection, request: web.BaseRequest) -> None:
        """Every period while the body is read: closed if it stalled for body_timeout_s, or if the seconds it has
        been read (paused time not counted) exceed body_timeout_s + what came / min_body_rate."""
        connection.timer = None
        if connection.state != "request" or connection.request is not request or request.content.is_eof():
            return
        limits, now, transport = self.limits, self._loop.time(), connection.transport
        reading = transport.is_reading()
        if reading:
            connection.body_s += now - connection.checked_at
        connection.checked_at = now
        stalled = reading and now - connection.last_data >= limits.body_timeout_s
        slow = connection.body_s > limits.body_timeout_s + connection.received / limits.min_body_rate
        if stalled or slow:
            self.timed_out += 1
            why = "stalled" if stalled else f"came slower than {limits.min_body_rate:g} bytes/s"
            self._warn(f"closing a connection from {connection.peer}: its request body {why}")
            self.forget(connection)
            transport.abort()
            return
        # A period, not a deadline: the rate's bound moves with every byte, and paused time must not count.
        period = min(max(limits.body_timeout_s / 4, 0.05), 1.0)
        connection.timer = self._loop.call_later(period, self._watch_body, connection, request)

    def _warn(self, message: str) -> None:
        if self._loop.time() - self._last_warning >= REFUSAL_LOG_S:
            self._last_warning = self._loop.time()
            log.warning(
                "%s (so far: %d closed for room, %d refused, %d timed out)",
                message,
                self.closed_for_room,
                self.refused,
                self.timed_out,
            )

    # -- what the middlewares report ---------------------------------------------------------------------------
    def connection_of(self, request: web.BaseRequest) -> Connection | None:
        return self._open.get(request.transport) if request.transport is not None else None

    def request_started(self, request: web.BaseRequest) -> Connection | None:
        """Headers complete: the body's clock starts. Not yet admitted, the connection stays a candidate for room
        (an unproven one stays where it was among them, oldest first)."""
        connection = self.connection_of(request)
        if connection is None:
            return None
        self._cancel_timer(connection)
        connection.state, connection.request, connection.in_admitted = "request", request, False
        if not request.content.is_eof():
            now = self._loop.time()
            connection.last_data = connection.checked_at = now
            connection.received, connection.body_s = 0, 0.0
            self._watch_body(connection, request)
        return connection

    def request_admitted(self, connection: Connection) -> None:
        """The request passed the gates (and a credential, where the server has one): its connection is an
        authorised client's, and not closed for room while this request lasts."""
        connection.admitted = connection.in_admitted = True
        self._unproven.pop(connection, None)
        self._idle.pop(connection, None)

    def request_ended(self, connection: Connection) -> None:
        if connection.transport not in self._open:
            return
        self._cancel_timer(connection)
        connection.state, connection.request, connection.in_admitted = "idle", None, False
        if connection.admitted:
            self._unproven.pop(connection, None)
            self._idle.pop(connection, None)
            self._idle[connection] = None  # the most recently used: the last of them to go
        else:
            self._unproven.setdefault(connection, None)


def mark_credential_checked(request: web.BaseRequest) -> None:
    """Called by a gate that compared a credential the request carries and found it right: only then does a
    request to a server with a credential admit its connection."""
    request[CREDENTIAL_CHECKED] = True


@web.middleware
async def request_seen(request: web.Request, handler: Any) -> web.StreamResponse:
    """Outermost: the request's headers are complete (its header deadline ends, its body's begins); once it is
    answered, a connection none of whose requests was admitted is closed rather than kept alive."""
    guard = request.config_dict.get(CONNECTION_GUARD)
    connection = guard.request_started(request) if guard is not None else None
    if connection is None:
        return await handler(request)
    try:
        response = await handler(request)
        if not connection.admitted:
            response.force_close()
        return response
    finally:
        guard.request_ended(connection)


def request_admitted(credentialed: bool) -> Any:
    """Inside the gates, before the handler: the request is admitted (its connection an authorised client's, even
    if the handler then answers 400) if a gate checked its credential, or if the server has none
    (`credentialed` False: a token-less loopback server, where passing the browser checks is all there is)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if not credentialed or request.get(CREDENTIAL_CHECKED):
            guard = request.config_dict.get(CONNECTION_GUARD)
            connection = guard.connection_of(request) if guard is not None else None
            if connection is not None:
                guard.request_admitted(connection)
        return await handler(request)

    return middleware


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's per-connection protocol behind the guard: made only for a connection the guard admits."""

    def __init__(self, guard: ConnectionGuard, make_handler: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_handler = make_handler
        self._inner: asyncio.Protocol | None = None
        self._connection: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are no subclasses of asyncio's
        self._connection = self._guard.admit(transport)
        if self._connection is None:
            transport.abort()
            return
        self._inner = self._make_handler()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            assert self._connection is not None
            self._guard.data(self._connection, len(data))
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None:
            assert self._connection is not None
            self._guard.forget(self._connection)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            assert self._connection is not None
            self._guard.writing_paused(self._connection, True)
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            assert self._connection is not None
            self._guard.writing_paused(self._connection, False)
            self._inner.resume_writing()
