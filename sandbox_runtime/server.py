"""The HTTP adapter: `create_app(config)` maps the /v1 API onto a SandboxManager.

Handlers only parse, call the manager or a sandbox, and shape the response; auth, JSON errors and metrics
live in middlewares. Every error reaches the client as `{"error": message, "status": code}`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from . import __version__
from .backends import describe_backends
from .config import ServerConfig
from .files import FileAccessError
from .manager import SandboxManager
from .metrics import Metrics
from .models import ExecRequest, InputRequest, RunRequest, SandboxSpec, ServerInfo
from .session import SessionError, key_bytes
from .webapp import (
    json_api,
    json_response,
    parse,
    serve_app,
)

log = logging.getLogger(__name__)

MANAGER = web.AppKey("manager", SandboxManager)
CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)


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
            default_limits=manager.default_limits,
            max_limits=manager.max_limits,
            local_backend_allowed=config.allow_local,
            image_dirs=len(manager.image_dirs),
            sandbox_uids=None
            if manager.sandbox_uids is None
            else f"{manager.sandbox_uids.start}-{manager.sandbox_uids.stop - 1}",
            max_timeout_s=config.max_timeout_s,
            max_output_bytes=config.max_output_bytes,
            max_body_bytes=config.max_body_bytes,
        )
    )


async def create_sandbox(request: web.Request) -> web.Response:
    spec: SandboxSpec = await parse(request, SandboxSpec, empty_ok=True)
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


def checked_timeout_and_output(
    config: ServerConfig, timeout: float | None, max_output: int | None
) -> tuple[float, int]:
    timeout = timeout or config.default_timeout_s
    if timeout > config.max_timeout_s:
        raise web.HTTPBadRequest(text=f"timeout {timeout} exceeds the server's maximum {config.max_timeout_s}")
    if max_output and max_output > config.max_output_bytes:
        raise web.HTTPBadRequest(
            text=f"max_output_bytes {max_output} exceeds the server's maximum {config.max_output_bytes}"
        )
    return timeout, max_output or config.default_output_bytes


async def exec_command(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    box = request.app[MANAGER].get(request.match_info["id"])
    req: ExecRequest = await parse(request, ExecRequest)
    timeout, _ = checked_timeout_and_output(config, req.timeout, req.max_output_bytes)
    session = await box.session(req.session)
    result = await session.run(req.command, timeout, req.max_output_bytes, keep=req.on_timeout == "keep")
    request.app[METRICS].exec_seconds.labels(result.status).observe(result.duration_s)
    return json_response(result)


async def run_once(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    req: RunRequest = await parse(request, RunRequest)
    timeout, max_output = checked_timeout_and_output(request.app[CONFIG], req.timeout, req.max_output_bytes)
    return json_response(await box.run(req, timeout, max_output))


async def end_processes(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    return web.json_response({"id": box.id, "sessions_ended": await box.end_processes()})


async def wipe(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    return web.json_response({"id": box.id, "sessions_ended": await box.wipe(), "wiped": True})


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


def mb(value: int | None) -> int | None:
    return None if value is None else value << 20


async def put_file(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    path = path_param(request)
    data = await request.read()
    disk = await asyncio.to_thread(box.files.usage)
    budget = mb(box.spec.limits.disk_mb)
    if budget is not None and disk + len(data) > budget:
        raise FileAccessError(413, f"{path!r}: over the sandbox's disk budget of {budget} bytes (limits.disk_mb)")
    written = await asyncio.to_thread(box.files.write, path, data, mb(box.spec.limits.file_size_mb))
    return web.json_response({"path": path, "bytes": written}, status=201)


async def get_file(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    data = await asyncio.to_thread(box.files.read, path_param(request), request.app[CONFIG].max_body_bytes)
    return web.Response(body=data, content_type="application/octet-stream")


async def put_archive(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    path = path_param(request)
    archive = await request.read()
    budget = mb(box.spec.limits.disk_mb)
    room = None if budget is None else max(budget - await asyncio.to_thread(box.files.usage), 0)
    count = await asyncio.to_thread(box.files.unpack, path, archive, mb(box.spec.limits.file_size_mb), room)
    return web.json_response({"path": path, "members": count}, status=201)


async def get_archive(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    limit = request.app[CONFIG].max_body_bytes
    # Sparse files compress to nothing: bound what is read, not only what is sent.
    content_limit = max(limit, mb(box.spec.limits.disk_mb) or 0)
    data = await asyncio.to_thread(box.files.pack, path_param(request), limit, content_limit)
    return web.Response(body=data, content_type="application/gzip")


def create_app(config: ServerConfig) -> web.Application:
    registry = Metrics()
    app = json_api(config.token, config.max_body_bytes, registry.requests)
    app[CONFIG] = config
    app[METRICS] = registry
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
            web.post(sandbox + "/run", run_once),
            web.post(sandbox + "/kill", end_processes),
            web.post(sandbox + "/wipe", wipe),
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
    """Run the server until SIGTERM/SIGINT; every sandbox is deleted on the way out."""
    config.check_exposure()
    await serve_app(create_app(config), config.host, config.port, f"prorl-sandbox (state dir {config.state_dir})")
