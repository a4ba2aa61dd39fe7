"""What both HTTP servers of the project share (the sandbox runtime's and the rollout service's): JSON errors,
bearer-token auth, the refusal of browser-borne requests, request metrics, body parsing, and running an app
until SIGTERM behind the front door's bounds on slow requests and connections (connections.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from .address import is_loopback
from .connections import (
    CONNECTION_GUARD,
    ConnectionGuard,
    ConnectionLimits,
    mark_credential_checked,
    request_admitted,
    request_seen,
)
from .errors import ApiError, DownstreamError
from .openapi import API, ErrorBody, describe_validation

log = logging.getLogger(__name__)
LISTEN_BACKLOG = 4096

MAX_REQUEST_LINE = 64 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
ErrorShape = Callable[[web.Request, int, str, str | None], BaseModel]  # (request, status, message, code) -> body


def json_response(model: BaseModel, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=model.model_dump_json(), status=status, content_type="application/json", headers=headers)


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return json_response(ErrorBody(error=message, status=status), status=status, headers=headers)


def error_body(request: web.Request, status: int, message: str, code: str | None) -> BaseModel:
    """The servers' own error shape, `{"error", "status"}` (no code)."""
    return ErrorBody(error=message, status=status)


def errors_as_json(max_body_bytes: int, shape: ErrorShape = error_body) -> Middleware:
    """Every failure becomes a JSON error, `shape`d (by default `{"error", "status"}`): 400 for a bad body, an
    `ApiError`'s status, 502 or 503 for a call to another server that failed (errors.py), 500 for the rest
    (logged)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        def answer(
            status: int, message: str, headers: Mapping[str, str] | None = None, code: str | None = None
        ) -> web.Response:
            return json_response(shape(request, status, message, code), status=status, headers=headers)

        try:
            return await handler(request)
        except ValidationError as exc:
            return answer(400, f"invalid request body: {describe_validation(exc)}")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
            if isinstance(exc, web.HTTPRequestEntityTooLarge):
                message = f"request body too large (limit {max_body_bytes} bytes)"
            # A 405 keeps its Allow header: it tells the caller which methods the path has.
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return answer(exc.status, message, allow)
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            if request.transport is not None and not request.transport.is_closing():
                raise
            # The client went, or was closed (a stalled body): nobody reads this answer, and a flood of them must
            # not flood the log with tracebacks.
            return answer(400, "the connection was lost while the request was read")
        except ApiError as exc:
            return answer(exc.status, str(exc), code=exc.code)
        except DownstreamError as exc:  # never the other server's status: the caller's request was not at fault
            return answer(exc.answer_status, str(exc))
        except Exception as exc:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return answer(500, f"internal error: {type(exc).__name__}: {exc}")

    return middleware


def bearer_auth(token: str | None, open_paths: frozenset[str]) -> Middleware:
    """The token on every path but the open ones, which may hold parameters (`/gateway/{key}/v1/models`):
    matched against the request's path itself, so a wrong method on an open path is its 405, not a 401. A right
    token, on any path, is a checked credential (connections.py: it admits the connection); an open path answered
    without one admits nothing."""
    expected = f"Bearer {token}".encode()
    templates = (re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) for path in sorted(open_paths))
    open_path = re.compile("|".join(f"(?:{t})" for t in templates) or "(?!)")

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token:
            # aiohttp decodes header bytes as UTF-8 with surrogateescape: encode them back the same way.
            sent = request.headers.get("Authorization", "").encode("utf-8", errors="surrogateescape")
            if hmac.compare_digest(sent, expected):
                mark_credential_checked(request)
            elif not open_path.fullmatch(request.path):
                return error_response(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        return await handler(request)

    return middleware


def is_loopback_host(host: str) -> bool:
    """Whether a Host header (or an Origin's host) names this machine's loopback: localhost, 127/8, ::1. A
    value that is no host at all (`[::1`, `[zz]`) names none."""
    try:
        return is_loopback(urlsplit(f"//{host}").hostname or "")
    except ValueError:
        return False


def refuse_browsers(token: str | None) -> Middleware:
    """Without a token a server listens on loopback only, where the one untrusted client left is a web page in
    a browser on the same machine. It can reach loopback by DNS rebinding (its own host name, resolved to
    127.0.0.1: the Host header gives it away) or by a cross-site form post (a foreign Origin, a text/plain
    body: no CORS preflight). Both are refused. With a token, the token is the gate: browsers cannot send it.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is None:
            host = request.headers.get("Host", "")
            if not is_loopback_host(host):
                return error_response(403, f"Host {host!r} is not a loopback name; this token-less server refuses it")
            origin = request.headers.get("Origin")
            if origin is not None:
                try:
                    same = urlsplit(origin).netloc == host
                except ValueError:  # not a URL (`http://[::1`): no page of this server sent it
                    same = False
                if not same:
                    return error_response(403, f"cross-origin request from {origin!r} refused")
        return await handler(request)

    return middleware


def count_requests(counter: Counter) -> Middleware:
    """Count requests by route template (not by raw path, which would make a label per id) and status."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        resource = request.match_info.route.resource
        counter.labels(resource.canonical if resource is not None else "unmatched", str(response.status)).inc()
        return response

    return middleware


def json_api(
    api: API,
    token: str | None,
    max_body_bytes: int,
    requests: Counter,
    gates: Sequence[Middleware] = (),
    own_auth_paths: frozenset[str] = frozenset(),
    credentialed: bool | None = None,
    error_shape: ErrorShape = error_body,
) -> web.Application:
    """The application serving `api` (and its OpenAPI document) with both servers' middlewares, outermost
    first: the connection guard's view of the request (`connections`), errors as JSON (and the body bound),
    browsers refused where there is no token, the bearer token (but on `api`'s public paths and on
    `own_auth_paths`, whose gates check a credential of their own), the application's own `gates`, the
    guard's mark of an admitted request, and every request counted in `requests`. `credentialed` (default:
    whether there is a token) says whether a request is admitted only once a gate checked a credential
    (`connections.mark_credential_checked`). `error_shape` makes the error bodies (a protocol's own, where
    clients expect one)."""
    middlewares = [
        request_seen,
        errors_as_json(max_body_bytes, error_shape),
        refuse_browsers(token),
        bearer_auth(token, api.public_paths | own_auth_paths),
        *gates,
        request_admitted(token is not None if credentialed is None else credentialed),
        count_requests(requests),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app.router.add_routes(api.routes())
    return app


@dataclass(frozen=True)
class Site:
    """One application on one address, or on a socket bound already (so its port is known before it starts)."""

    app: web.Application
    host: str
    port: int
    name: str
    sock: socket.socket | None = None


async def serve_sites(
    sites: list[Site],
    limits: ConnectionLimits | None = None,
    stop: asyncio.Event | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    """Run the applications until SIGTERM or SIGINT (or until `stop` is set, where given: no signal handlers
    then), then shut them down cleanly (their cleanup contexts run, the last started first). Each is set up in
    order, so an application's start-up may prepare the next one. `ready`, where given, is called once every site
    listens: what fails before it is a failure to start, what fails after it a crash of a serving server.

    Each site's connections go through a `ConnectionGuard` of its own with `limits`, resolved for that many
    sites (the process's descriptors are what the caps protect; they are shared out): a flood of one listener
    (the gateway, which sandboxes reach) takes no connection of another (the API the trainer calls). aiohttp's
    server is the protocol the guard wraps, on a listener made here. The listen backlog is large: at hundreds of
    concurrent clients, the default 128 costs 1 s SYN retries.
    """
    limits = (limits or ConnectionLimits()).resolve(len(sites))
    loop = asyncio.get_running_loop()
    runners: list[web.AppRunner] = []
    listeners: list[asyncio.AbstractServer] = []
    try:
        for site in sites:
            guard = site.app[CONNECTION_GUARD] = ConnectionGuard(limits)
            # A request line may carry a query parameter of up to 4096 characters (a file path), percent-encoded:
            # far more than aiohttp's default 8190 bytes, whose refusal is a plain-text 400 below the middlewares.
            runner = web.AppRunner(
                site.app, access_log=None, max_line_size=MAX_REQUEST_LINE, keepalive_timeout=limits.idle_timeout_s
            )
            try:
                await runner.setup()
            except BaseException:
                await cleanup_after_failed_start(site.app)
                raise
            runners.append(runner)
            assert runner.server is not None
            factory = guard.protocol_factory(runner.server)
            if site.sock is not None:
                listener = await loop.create_server(factory, sock=site.sock, backlog=LISTEN_BACKLOG)
            else:
                listener = await loop.create_server(factory, site.host, site.port, backlog=LISTEN_BACKLOG)
            listeners.append(listener)
            port = listener.sockets[0].getsockname()[1]
            log.info("%s listening on http://%s:%d", site.name, site.host, port)
        if ready is not None:
            ready()
        if stop is None:
            stop = asyncio.Event()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        for listener in listeners:
            listener.close()
        for runner in reversed(runners):
            await runner.cleanup()


async def cleanup_after_failed_start(app: web.Application) -> None:
    """Close what the cleanup contexts of `app` had opened when one of them failed to start: aiohttp's runner
    cleans up only after a start-up that succeeded, and the sessions and connections left open would be reported
    (an "Unclosed client session" logged at exit, say) under the one line that says why the server did not start.
    A failure to close them is logged at DEBUG: the start-up's own failure is the one that is raised."""
    try:
        await app.cleanup()
    except Exception:
        log.debug("closing what a failed start-up had opened failed", exc_info=True)


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one), for a Site whose port must be known early."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


def inherited_socket(fd: int) -> socket.socket:
    """The listening TCP socket this process inherited as descriptor `fd` from whoever started it: a launcher
    that bound it first, so that the port is known, and held, before the server starts (a port only found free
    can be taken by any other process before the server binds it; every outgoing connection takes one). Made
    close-on-exec here, so that nothing the server starts inherits it further. ValueError when `fd` is not an
    open, listening TCP socket."""
    try:
        sock = socket.socket(fileno=fd)
    except (OSError, ValueError) as exc:  # ValueError: a negative number
        raise ValueError(f"--listen-fd {fd}: {getattr(exc, 'strerror', None) or exc}") from None
    listening = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
    if not (listening and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
        sock.detach()  # not ours to close
        raise ValueError(f"--listen-fd {fd} is not a listening TCP socket")
    sock.set_inheritable(False)
    return sock


def listen_address(
    fd: int | None, host: str | None, port: int | None, default_port: int
) -> tuple[socket.socket | None, str, int]:
    """Where a server listens: (the inherited socket, its host, its port) given --listen-fd, else (None, --host
    or loopback, --port or `default_port`). ValueError as `inherited_socket`, or for --listen-fd with --host or
    --port (the socket's address is the one it has)."""
    if fd is None:
        return None, "127.0.0.1" if host is None else host, default_port if port is None else port
    if host is not None or port is not None:
        raise ValueError("--listen-fd serves on the socket's own address: give it without --host and --port")
    sock = inherited_socket(fd)
    return sock, *sock.getsockname()[:2]


def run_forever(main: Coroutine[Any, Any, None]) -> None:
    """Run a server's main coroutine on uvloop where it is installed (it halves the event loop's and the HTTP
    stack's share of the CPU per request), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
