"""The HTTP adapter: `create_app(config)` maps the /v1 API onto a SandboxManager.

`RUNTIME_API` describes every operation once (its models, replies, errors and links): it routes the requests and
writes the OpenAPI document served at /openapi.json. Handlers get their body and query already validated, call
the manager or a sandbox, and shape the reply; auth, JSON errors and metrics live in middlewares. Every error
reaches the client as an ErrorBody, `{"error": message, "status": code}`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable

from aiohttp import web

from server_kit.address import advertised_url
from server_kit.cli import StartupError
from server_kit.openapi import API, Link, Operation, Reply, metrics_operation, operations_under
from server_kit.webapp import Site, bound_socket, json_api, json_response, serve_sites

from . import __version__
from .backends import describe_backends
from .config import ServerConfig
from .files import FileAccessError
from .manager import SandboxManager
from .metrics import Metrics
from .models import (
    ArchiveWritten,
    ExecRequest,
    ExecResult,
    FileWritten,
    Health,
    ImageList,
    InputRequest,
    PathQuery,
    ProcessesEnded,
    RunRequest,
    RunResult,
    SandboxDeleted,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
    SandboxWiped,
    ServerInfo,
    SessionDeleted,
)
from .registration import Registration, RegistrationConfig
from .session import SessionError, key_bytes

log = logging.getLogger(__name__)

MANAGER = web.AppKey("manager", SandboxManager)
CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)


# -- handlers -------------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return json_response(Health(ok=True))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain")


async def server_info(request: web.Request) -> web.Response:
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
            image_dirs=len(manager.images.image_dirs),
            host_paths=[str(path) for path in config.host_paths],
            sandbox_uids=None
            if manager.sandbox_uids is None
            else f"{manager.sandbox_uids.start}-{manager.sandbox_uids.stop - 1}",
            default_timeout_s=config.default_timeout_s,
            max_timeout_s=config.max_timeout_s,
            default_output_bytes=config.default_output_bytes,
            max_output_bytes=config.max_output_bytes,
            max_body_bytes=config.max_body_bytes,
            enforcement=manager.enforcement,
        )
    )


async def list_images(request: web.Request) -> web.Response:
    return json_response(await asyncio.to_thread(request.app[MANAGER].images.image_list))


async def create_sandbox(request: web.Request, body: SandboxSpec) -> web.Response:
    box = await request.app[MANAGER].create(body, wanted=lambda: request.transport is not None)
    return json_response(box.info(), status=201)


async def list_sandboxes(request: web.Request) -> web.Response:
    boxes = [b.info() for b in request.app[MANAGER].all() if not b.closing]
    return json_response(SandboxList(sandboxes=boxes))


async def get_sandbox(request: web.Request) -> web.Response:
    return json_response(request.app[MANAGER].get(request.match_info["id"]).info())


async def delete_sandbox(request: web.Request) -> web.Response:
    sandbox_id = request.match_info["id"]
    deleted = await request.app[MANAGER].delete(sandbox_id)
    return json_response(SandboxDeleted(id=sandbox_id, already_deleted=not deleted))


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


async def exec_command(request: web.Request, body: ExecRequest) -> web.Response:
    config = request.app[CONFIG]
    box = request.app[MANAGER].get(request.match_info["id"])
    timeout, _ = checked_timeout_and_output(config, body.timeout, body.max_output_bytes)
    session = await box.session(body.session)
    result = await session.run(body.command, timeout, body.max_output_bytes, keep=body.on_timeout == "keep")
    request.app[METRICS].exec_seconds.labels(result.status).observe(result.duration_s)
    return json_response(result)


async def run_once(request: web.Request, body: RunRequest) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    timeout, max_output = checked_timeout_and_output(request.app[CONFIG], body.timeout, body.max_output_bytes)
    return json_response(await box.run(body, timeout, max_output))


async def end_processes(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    return json_response(ProcessesEnded(id=box.id, sessions_ended=await box.end_processes()))


async def wipe_sandbox(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    return json_response(SandboxWiped(id=box.id, sessions_ended=await box.wipe()))


async def session_input(request: web.Request, body: InputRequest) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    try:
        data = body.text.encode() if body.text is not None else b"".join(key_bytes(k) for k in body.keys)
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    timeout = min(body.timeout, request.app[CONFIG].max_timeout_s)
    return json_response(await box.existing_session(request.match_info["name"]).send(data, timeout))


async def session_output(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    return json_response(box.existing_session(request.match_info["name"]).read_output())


async def delete_session(request: web.Request) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    name = request.match_info["name"]
    if not await box.close_session(name):
        raise SessionError(f"sandbox {box.id} has no session {name!r}", status=404)
    return json_response(SessionDeleted(id=box.id, session=name))


def mb(value: int | None) -> int | None:
    return None if value is None else value << 20


async def write_file(request: web.Request, query: PathQuery) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    data = await request.read()
    disk = await box.in_thread(box.files.usage)
    budget = mb(box.spec.limits.disk_mb)
    if budget is not None and disk + len(data) > budget:
        raise FileAccessError(413, f"{query.path!r}: over the sandbox's disk budget of {budget} bytes (limits.disk_mb)")
    written = await box.in_thread(box.files.write, query.path, data, mb(box.spec.limits.file_size_mb))
    return json_response(FileWritten(path=query.path, bytes=written), status=201)


async def read_file(request: web.Request, query: PathQuery) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    data = await box.in_thread(box.files.read, query.path, request.app[CONFIG].max_body_bytes)
    return web.Response(body=data, content_type="application/octet-stream")


async def upload_archive(request: web.Request, query: PathQuery) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    archive = await request.read()
    budget = mb(box.spec.limits.disk_mb)
    room = None if budget is None else max(budget - await box.in_thread(box.files.usage), 0)
    count = await box.in_thread(box.files.unpack, query.path, archive, mb(box.spec.limits.file_size_mb), room)
    return json_response(ArchiveWritten(path=query.path, members=count), status=201)


async def download_archive(request: web.Request, query: PathQuery) -> web.Response:
    box = request.app[MANAGER].get(request.match_info["id"])
    limit = request.app[CONFIG].max_body_bytes
    # Sparse files compress to nothing: bound what is read, not only what is sent.
    content_limit = max(limit, mb(box.spec.limits.disk_mb) or 0)
    data = await box.in_thread(box.files.pack, query.path, limit, content_limit)
    return web.Response(body=data, content_type="application/gzip")


# -- the API, described once: routes and the OpenAPI document ---------------------------------------------
SANDBOX = "/v1/sandboxes/{id}"
SESSION = SANDBOX + "/sessions/{name}"
SANDBOX_ID = {"id": {"type": "string", "description": "the id POST /v1/sandboxes answered with"}}
SESSION_PARAMETERS = {
    **SANDBOX_ID,
    "name": {"type": "string", "description": "a session name, as given to exec (`default` unless named)"},
}
NO_SANDBOX = {404: "no such sandbox (or it is being deleted)"}
BUSY = {409: "the session is busy with another command (or could not start)"}
FILE_ERRORS = {
    400: "the path is not valid (a NUL, a '..', a symbolic link on the way), lies outside the sandbox's writable "
    "areas (the workspace and /tmp), or names something that is not a regular file or directory",
    403: "the file system refuses the access (permission denied) inside the workspace or /tmp",
    404: "no such sandbox, or no such file",
    409: "a directory where a file is meant (or the reverse), or a program running in the sandbox that would be "
    "replaced",
    507: "no space left where the sandbox's files are kept",
}
IN_SANDBOX = {"exec_command", "run_once", "end_processes", "wipe_sandbox", "get_sandbox", "delete_sandbox"}
SANDBOX_LINKS = {
    name: Link(name, {"id": "$response.body#/id"})
    for name in (*sorted(IN_SANDBOX), "write_file", "read_file", "upload_archive", "download_archive")
}


sandbox_op = operations_under(SANDBOX, SANDBOX_ID, NO_SANDBOX, "sandboxes")


RUNTIME_API = API(
    name="runtime",
    program="prorl-sandbox",
    title="prorl-sandbox: the sandbox runtime",
    version=__version__,
    description="Sandboxes with persistent PTY shells, one-shot runs and a file API, isolated by a backend "
    "(bubblewrap, Apptainer). Every error is an ErrorBody; see docs/runtime.md for the model behind the calls.",
    default_port=8765,
    operations=(
        Operation("GET", "/healthz", healthz, "Liveness", (Reply(200, "serving", Health),), public=True, tag="server"),
        metrics_operation(metrics, tag="server"),
        Operation(
            "GET", "/v1/info", server_info, "Backends, limits and policy", (Reply(200, "", ServerInfo),), tag="server"
        ),
        Operation(
            "GET",
            "/v1/images",
            list_images,
            "The images a spec may name: format, digest and cache state",
            (Reply(200, "every image below the server's image directories", ImageList),),
            tag="server",
        ),
        Operation(
            "POST",
            "/v1/sandboxes",
            create_sandbox,
            "Create a sandbox",
            (Reply(201, "created, its shell started", SandboxInfo, links=SANDBOX_LINKS),),
            errors={
                400: "the spec is not valid, or the server's policy refuses it (a limit above the maximum, an unknown "
                "image, a backend that is not installed): the message says which",
                403: "a backend the operator did not allow (`local`)",
                409: "the image file changed while it was unpacked; try again",
                413: "seed_workdir: the image's directory at workdir holds more than limits.disk_mb",
                429: "the server holds its maximum number of sandboxes; delete some first",
                507: "no space left where the sandbox's files are kept",
            },
            body=SandboxSpec,
            body_required=False,
            tag="sandboxes",
        ),
        Operation(
            "GET", "/v1/sandboxes", list_sandboxes, "List sandboxes", (Reply(200, "", SandboxList),), tag="sandboxes"
        ),
        sandbox_op("GET", "", get_sandbox, "Describe a sandbox", (Reply(200, "", SandboxInfo),)),
        sandbox_op(
            "DELETE",
            "",
            delete_sandbox,
            "Delete a sandbox: every process ends, its files are removed (idempotent)",
            (Reply(200, "deleted, or gone already", SandboxDeleted),),
            errors={},
        ),
        sandbox_op(
            "POST",
            "/exec",
            exec_command,
            "Run a command in a persistent shell session",
            (Reply(200, "the command's output, exit code and the shell's cwd", ExecResult),),
            errors=BUSY,
            body=ExecRequest,
        ),
        sandbox_op(
            "POST",
            "/run",
            run_once,
            "Run one fresh process; its exit status comes from waitpid",
            (Reply(200, "", RunResult),),
            body=RunRequest,
        ),
        sandbox_op(
            "POST", "/kill", end_processes, "End every process of the sandbox", (Reply(200, "", ProcessesEnded),)
        ),
        sandbox_op(
            "POST",
            "/wipe",
            wipe_sandbox,
            "End every process, then empty the workspace and /tmp (and seed the workspace again: seed_workdir)",
            (Reply(200, "", SandboxWiped),),
        ),
        Operation(
            "POST",
            SESSION + "/input",
            session_input,
            "Type text or keys (e.g. C-c) into a session",
            (Reply(200, "the output so far", ExecResult),),
            errors={404: "no such sandbox or session", 409: "the session runs no command to send input to"},
            body=InputRequest,
            path_parameters=SESSION_PARAMETERS,
            tag="sessions",
        ),
        Operation(
            "GET",
            SESSION + "/output",
            session_output,
            "What a session printed since the last read",
            (Reply(200, "", ExecResult),),
            errors={404: "no such sandbox or session"},
            path_parameters=SESSION_PARAMETERS,
            tag="sessions",
        ),
        Operation(
            "DELETE",
            SESSION,
            delete_session,
            "End a session",
            (Reply(200, "", SessionDeleted),),
            errors={404: "no such sandbox or session"},
            path_parameters=SESSION_PARAMETERS,
            tag="sessions",
        ),
        sandbox_op(
            "PUT",
            "/files",
            write_file,
            "Write a file (the body is its content)",
            (Reply(201, "written", FileWritten),),
            errors={**FILE_ERRORS, 413: "over the body limit, limits.file_size_mb or limits.disk_mb"},
            query=PathQuery,
            raw_body="application/octet-stream",
            body_required=False,  # an empty file
        ),
        sandbox_op(
            "GET",
            "/files",
            read_file,
            "Read a file",
            (Reply(200, "the file's content", media_type="application/octet-stream"),),
            errors={**FILE_ERRORS, 413: "the file is larger than the server's body limit"},
            query=PathQuery,
        ),
        sandbox_op(
            "PUT",
            "/archive",
            upload_archive,
            "Extract a tar (optionally gzip'd) into a directory",
            (Reply(201, "extracted", ArchiveWritten),),
            errors={
                **FILE_ERRORS,
                400: "the path is not valid, or the body is not a tar archive, or holds a member that would leave "
                "the directory",
                413: "over the body limit, limits.file_size_mb or limits.disk_mb",
            },
            query=PathQuery,
            raw_body="application/x-tar",
        ),
        sandbox_op(
            "GET",
            "/archive",
            download_archive,
            "A directory as a tar.gz",
            (Reply(200, "the archive", media_type="application/gzip"),),
            errors={**FILE_ERRORS, 413: "the archive is larger than the server's body limit"},
            query=PathQuery,
        ),
    ),
)


def create_app(config: ServerConfig, port: int | None = None) -> web.Application:
    """The runtime as an aiohttp application; `port` is the one it is served on (for its registration)."""
    registry = Metrics()
    app = json_api(RUNTIME_API, config.token, config.max_body_bytes, registry.requests)
    app[CONFIG] = config
    app[METRICS] = registry
    app[MANAGER] = manager = SandboxManager(config, app[METRICS])
    app[METRICS].active.set_function(lambda: len(manager))

    async def manager_lifecycle(app: web.Application):
        await manager.start()
        yield
        await manager.stop()

    async def registration(app: web.Application):
        # After the manager: a service may place a sandbox here as soon as it hears of this runtime.
        if not config.register:
            yield
            return
        url = config.advertise_url or advertised_url(config.host, port or config.port)
        name = config.name or f"{socket.gethostname()}-{port or config.port}"
        settings = RegistrationConfig(
            config.register, name, url, config.register_token, config.heartbeat_s, api_token=config.token
        )
        beats = Registration(
            settings, lambda: (config.max_sandboxes, len(manager)), manager.default_backend, __version__
        )
        await beats.start()
        yield
        await beats.stop()  # before the manager deletes every sandbox: no service places one on the way out

    app.cleanup_ctx.extend([manager_lifecycle, registration])
    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """`bound_socket`, or a StartupError that says which flag to change."""
    try:
        return bound_socket(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is already in use (another prorl-sandbox?): stop whatever holds it, or give "
                "another --port"
            ) from None
        # create_server's own message repeats the address; a name that does not resolve has a negative errno.
        positive = isinstance(exc.errno, int) and exc.errno > 0
        reason = os.strerror(exc.errno) if positive else (exc.strerror or str(exc)).partition(" (while")[0]
        raise StartupError(f"cannot listen on {host} port {port}: {reason}; check --host and --port") from None


async def serve(config: ServerConfig, ready: Callable[[], None] | None = None) -> None:
    """Run the server until SIGTERM/SIGINT; every sandbox is deleted on the way out. `ready` is called once it
    listens."""
    config.check()
    # Bound first (or given bound): the registration advertises its real port.
    sock = config.listen_socket or listening_socket(config.host, config.port)
    app = create_app(config, port=sock.getsockname()[1])
    await serve_sites(
        [Site(app, config.host, 0, f"prorl-sandbox (state dir {config.state_dir})", sock=sock)],
        config.connections,
        ready=ready,
    )
