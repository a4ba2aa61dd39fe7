"""A sandbox runtime stand-in (NOT a sandbox): the part of the runtime's HTTP API that `SandboxPool`,
`SandboxClient` and `Environment` use, with sandboxes that are records and a "shell" that answers from a table.

A command's output is `outputs[command]`, else what `echo` would print for `echo WORDS`, else nothing; its exit
code is `exit_codes[command]`, else 0. One-shot runs (`run`, what eval uses) are looked up the same way by their
script (or argv joined by spaces). Every request is logged in order in `log` as (operation, sandbox id, detail),
and `cue(operation, ...)` makes the next requests of that operation fail (`Fail`) or wait (`HANG`); a held
create goes on to create the sandbox once released, as the real runtime would.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from aiohttp import web
from pydantic import BaseModel

from sandbox_runtime.models import (
    ExecRequest,
    ExecResult,
    FileWritten,
    PathQuery,
    ProcessesEnded,
    RunRequest,
    RunResult,
    SandboxDeleted,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
)

from .standin import Fail, Hang, StandIn


def answer(reply: BaseModel, status: int = 200) -> web.Response:
    """A reply as the runtime sends it: the wire model's JSON."""
    return web.Response(body=reply.model_dump_json(), status=status, content_type="application/json")


class SandboxStandIn(StandIn):
    def __init__(self, outputs: dict[str, str] | None = None, exit_codes: dict[str, int] | None = None) -> None:
        super().__init__()
        self.outputs = dict(outputs or {})
        self.exit_codes = dict(exit_codes or {})
        self.boxes: dict[str, SandboxInfo] = {}  # the live ones
        self.peak = 0  # the most sandboxes alive at once
        self.created: list[SandboxInfo] = []
        self.files: dict[tuple[str, str], bytes] = {}
        self.log: list[tuple[str, str, str]] = []
        self._cued: dict[str, list[Fail | Hang]] = defaultdict(list)
        self._ids = itertools.count(1)
        box = "/v1/sandboxes/{id}"
        self.app.router.add_routes(
            [
                web.post("/v1/sandboxes", self._create),
                web.get("/v1/sandboxes", self._list),
                web.delete(box, self._delete),
                web.post(box + "/exec", self._exec),
                web.post(box + "/run", self._run),
                web.post(box + "/kill", self._kill),
                web.put(box + "/files", self._write),
                web.get(box + "/files", self._read),
            ]
        )

    def cue(self, operation: str, *answers: Fail | Hang) -> None:
        """Answer the next requests of `operation` (create, delete, exec, run, kill, ...) like this, in order."""
        self._cued[operation] += answers

    def uncue(self, operation: str) -> None:
        """Forget what is still cued for `operation`: its next requests are answered normally."""
        self._cued[operation].clear()

    def ops(self, sandbox_id: str | None = None) -> list[str]:
        """The operations logged, in order (on one sandbox, if given)."""
        return [op for op, box, _ in self.log if sandbox_id is None or box == sandbox_id]

    async def _enter(self, operation: str, sandbox_id: str, detail: str = "") -> web.Response | None:
        """Log the request and play its cue; a response to send instead of the normal one, or None."""
        self.log.append((operation, sandbox_id, detail))
        self.changed()
        cued = self._cued[operation].pop(0) if self._cued[operation] else None
        if isinstance(cued, Hang):
            await self.hold()
        elif isinstance(cued, Fail):
            return web.json_response({"error": cued.message, "status": cued.status}, status=cued.status)
        if sandbox_id and operation != "create" and sandbox_id not in self.boxes:
            return web.json_response({"error": f"no sandbox {sandbox_id!r}", "status": 404}, status=404)
        return None

    def _result(self, command: str) -> tuple[str, int]:
        default = command[5:] + "\n" if command.startswith("echo ") else ""
        return self.outputs.get(command, default), self.exit_codes.get(command, 0)

    async def _create(self, request: web.Request) -> web.Response:
        spec = SandboxSpec.model_validate_json(await request.read())
        box_id = f"box-{next(self._ids)}"
        if (refused := await self._enter("create", box_id, spec.labels.get("job_id", ""))) is not None:
            return refused
        info = SandboxInfo(
            id=box_id,
            backend="stand-in",
            isolated=False,
            image=spec.image,
            workdir=spec.workdir,
            network=spec.network,
            limits=spec.limits,
            labels=spec.labels,
            created_at=0.0,
            ttl_s=spec.ttl_s,
            idle_timeout_s=spec.idle_timeout_s,
            sessions=[],
        )
        self.boxes[box_id] = info
        self.created.append(info)
        self.peak = max(self.peak, len(self.boxes))
        self.changed()
        return answer(info, status=201)

    async def _list(self, request: web.Request) -> web.Response:
        return answer(SandboxList(sandboxes=list(self.boxes.values())))

    async def _delete(self, request: web.Request) -> web.Response:
        box_id = request.match_info["id"]
        if (refused := await self._enter("delete", box_id)) is not None:
            return refused
        del self.boxes[box_id]
        self.changed()
        return answer(SandboxDeleted(id=box_id, already_deleted=False))

    async def _exec(self, request: web.Request) -> web.Response:
        body = ExecRequest.model_validate_json(await request.read())
        box_id = request.match_info["id"]
        if (refused := await self._enter("exec", box_id, f"{body.session}: {body.command}")) is not None:
            return refused
        output, code = self._result(body.command)
        cwd = self.boxes[box_id].workdir
        return answer(
            ExecResult(output=output, exit_code=code, status="completed", truncated=False, duration_s=0.0, cwd=cwd)
        )

    async def _run(self, request: web.Request) -> web.Response:
        body = RunRequest.model_validate_json(await request.read())
        script = body.script or " ".join(body.argv or [])
        if (refused := await self._enter("run", request.match_info["id"], script)) is not None:
            return refused
        output, code = self._result(script)
        return answer(RunResult(output=output, exit_code=code, status="completed", truncated=False, duration_s=0.0))

    async def _kill(self, request: web.Request) -> web.Response:
        box_id = request.match_info["id"]
        if (refused := await self._enter("kill", box_id)) is not None:
            return refused
        return answer(ProcessesEnded(id=box_id, sessions_ended=["default"]))

    async def _write(self, request: web.Request) -> web.Response:
        box_id, path = request.match_info["id"], PathQuery.model_validate(dict(request.query)).path
        if (refused := await self._enter("write", box_id, path)) is not None:
            return refused
        self.files[box_id, path] = await request.read()
        return answer(FileWritten(path=path, bytes=len(self.files[box_id, path])), status=201)

    async def _read(self, request: web.Request) -> web.Response:
        box_id, path = request.match_info["id"], PathQuery.model_validate(dict(request.query)).path
        if (refused := await self._enter("read", box_id, path)) is not None:
            return refused
        if (box_id, path) not in self.files:
            return web.json_response({"error": f"no file {path!r}", "status": 404}, status=404)
        return web.Response(body=self.files[box_id, path], content_type="application/octet-stream")
