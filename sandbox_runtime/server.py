"""The HTTP adapter: `create_app(config)` maps the /v1 API onto a SandboxManager.

Handlers only parse, call the manager or a sandbox, and shape the response; auth, JSON errors and metrics
live in middlewares. Every error reaches the client as `{"error": message, "status": code}`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, ValidationError

from . import __version__
from .backends import describe_backends
from .config import ServerConfig
from .manager import SandboxManager
from .metrics import Metrics
from .models import ExecRequest, InputRequest, SandboxSpec, ServerInfo
from .session import SessionError, key_bytes

log = logging.getLogger(__name__)

MANAGER = web.AppKey("manager", SandboxManager)
CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/healthz"})


def json_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=model.model_dump_json(), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


def describe_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ValidationError as exc:
        return error_response(400, f"invalid request body: {describe_validation(exc)}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            message = f"request body too large (limit {request.app[CONFIG].max_body_bytes} bytes)"
        return error_response(exc.status, message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        status = getattr(exc, "status", None)
        if isinstance(status, int) and 400 <= status < 600:
            return error_response(status, str(exc))
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


@web.middleware
async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[CONFIG].token
    if token and request.path not in OPEN_PATHS:
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            return error_response(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
    return await handler(request)


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[METRICS].requests.labels(route, str(response.status)).inc()
    return response


async def parse(request: web.Request, model: type[BaseModel]) -> BaseModel:
    body = await request.read()
    if not body:
        raise web.HTTPBadRequest(text=f"a JSON body is required ({model.__name__})")
    return model.model_validate_json(body)


def path_param(request: web.Request) -> str:
    path = request.query.get("path")
    if not path:
        raise web.HTTPBadRequest(text="query parameter `path` is required")
    return path


# -- handlers -------------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain")


async def info(request: web.Request) -> web.Response:
    config, manager = request.app[CONFIG], request.app[MANAGER]
    return json_response(
        ServerInfo(
            version=__version__,
            default_backend=manager.default_backend,
            backends=describe_backends(),
            max_sandboxes=config.max_sandboxes,
            sandboxes=len(manager),
            default_limits=config.default_limits,
            max_timeout_s=config.max_timeout_s,
            max_output_bytes=config.max_output_bytes,
            max_body_bytes=config.max_body_bytes,
        )
    )


async def create_sandbox(request: web.Request) -> web.Response:
    body = await request.read()
    spec = SandboxSpec.model_validate_json(body) if body else SandboxSpec()
    box = await request.app[MANAGER].create(spec)
    return json_response(box.info(), status=201)


async def list_sandboxes(request: web.Request) -> web.Response:
    boxes = [b.info().model_dump(mode="json") for b in request.app[MANAGER].all() if not b.closing]
    return web.json_response({"sandboxes": boxes})


async def get_sandbox(request: web.Request) -> web.Response:
    return json_response(request.app[MANAGER].get(request.match_info["id"]).info())


async def delete_sandbox(request: web.Request) -> web.Response:
    sandbox_id = request.match_info["id"]
    deleted = await request.app[MANAGER].delete(sandbox_id)
    return web.json_response({"id": sandbox_id, "deleted": True, "already_deleted": not deleted})


async def exec_command(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    box = request.app[MANAGER].get(request.match_info["id"])
    req: ExecRequest = await parse(request, ExecRequest)
    timeout = req.timeout or config.default_timeout_s
    if timeout > config.max_timeout_s:
        raise web.HTTPBadRequest(text=f"timeout {timeout} exceeds the server's maximum {config.max_timeout_s}")
    if req.max_output_bytes and req.max_output_bytes > config.max_output_bytes:
        raise web.HTTPBadRequest(
            text=f"max_output_bytes {req.max_output_bytes} exceeds the server's maximum {config.max_output_bytes}"
        )
    session = await box.session(req.session)
    result = await session.run(req.command, timeout, req.max_output_bytes, keep=req.on_timeout == "keep")
    request.app[METRICS].exec_seconds.labels(result.status).observe(result.duration_s)
    return json_response(result)


async def session_input(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    req: InputRequest = await parse(request, InputRequest)
    if (req.text is None) == (req.keys is None):
        raise web.HTTPBadRequest(text="give exactly one of `text` or `keys`")
    try:
        data = req.text.encode() if req.text is not None else b"".join(key_bytes(k) for k in req.keys)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    timeout = min(req.timeout, request.app[CONFIG].max_timeout_s)
    return json_response(await box.existing_session(request.match_info["name"]).send(data, timeout))


async def session_output(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    return json_response(box.existing_session(request.match_info["name"]).read_output())


async def delete_session(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    name = request.match_info["name"]
    if not await box.close_session(name):
        raise SessionError(f"sandbox {box.id} has no session {name!r}", status=404)
    return web.json_response({"id": box.id, "session": name, "deleted": True})


async def put_file(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    path = path_param(request)
    written = await asyncio.to_thread(box.files.write, path, await request.read())
    return web.json_response({"path": path, "bytes": written}, status=201)


async def get_file(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    data = await asyncio.to_thread(box.files.read, path_param(request), request.app[CONFIG].max_body_bytes)
    return web.Response(body=data, content_type="application/octet-stream")


async def put_archive(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    path = path_param(request)
    count = await asyncio.to_thread(box.files.unpack, path, await request.read())
    return web.json_response({"path": path, "members": count}, status=201)


async def get_archive(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    data = await asyncio.to_thread(box.files.pack, path_param(request), request.app[CONFIG].max_body_bytes)
    return web.Response(body=data, content_type="application/gzip")


def create_app(config: ServerConfig) -> web.Application:
    app = web.Application(
        middlewares=[errors_as_json, bearer_auth, count_requests], client_max_size=config.max_body_bytes
    )
    app[CONFIG] = config
    app[METRICS] = Metrics()
    app[MANAGER] = manager = SandboxManager(config, app[METRICS])
    app[METRICS].active.set_function(lambda: len(manager))

    async def manager_lifecycle(app: web.Application):
        await manager.start()
        yield
        await manager.stop()

    app.cleanup_ctx.append(manager_lifecycle)
    sandbox = "/v1/sandboxes/{id}"
    session = sandbox + "/sessions/{name}"
    app.router.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
            web.get("/v1/info", info),
            web.post("/v1/sandboxes", create_sandbox),
            web.get("/v1/sandboxes", list_sandboxes),
            web.get(sandbox, get_sandbox),
            web.delete(sandbox, delete_sandbox),
            web.post(sandbox + "/exec", exec_command),
            web.post(session + "/input", session_input),
            web.get(session + "/output", session_output),
            web.delete(session, delete_session),
            web.put(sandbox + "/files", put_file),
            web.get(sandbox + "/files", get_file),
            web.put(sandbox + "/archive", put_archive),
            web.get(sandbox + "/archive", get_archive),
        ]
    )
    return app


async def serve(config: ServerConfig) -> None:
    """Run the server until cancelled, with a listen backlog sized for hundreds of concurrent clients."""
    config.check_exposure()
    runner = web.AppRunner(create_app(config), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=4096)
    await site.start()
    log.info("prorl-sandbox listening on http://%s:%d (state dir %s)", config.host, config.port, config.state_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: every sandbox is deleted on the way out
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
