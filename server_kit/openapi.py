"""Each HTTP API described once: an `Operation` names its method, path and handler and the pydantic models of
its query, its body and each of its replies. The same description routes requests (`route`: the query and the
body are parsed with those models before the handler runs) and writes the OpenAPI 3.1 document
(`API.document`), so the document cannot say one thing while the server does another.

Why not a library: the aiohttp OpenAPI packages either describe marshmallow schemas (aiohttp-apispec) or ask for
class-based views with their own validation flow (aiohttp-pydantic); this is pydantic's own JSON Schema
(`models_json_schema`) placed in OpenAPI's frame, which is all either would add here.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema

Handler = Callable[..., Awaitable[web.StreamResponse]]
JSON = "application/json"
BINARY = {"type": "string", "format": "binary"}


class ErrorBody(BaseModel):
    """Every error, from either server: what is wrong, in words a caller can act on, and the HTTP status."""

    error: str = Field(description="what went wrong and, for a caller's mistake, what to fix")
    status: int = Field(ge=400, le=599, description="the HTTP status of the reply, repeated")


@dataclass(frozen=True)
class Link:
    """An OpenAPI link: the reply carries what `operation` needs, e.g. `{"id": "$response.body#/id"}`."""

    operation: str
    parameters: Mapping[str, str]


@dataclass(frozen=True)
class Reply:
    status: int
    description: str
    model: type[BaseModel] | None = None
    media_type: str = JSON
    links: Mapping[str, Link] = field(default_factory=dict)


# The errors any operation may answer, whatever it does (all with an ErrorBody).
AUTH_ERRORS = {
    401: "the server was started with a token and the request's `Authorization: Bearer <token>` is missing or wrong",
}
BROWSER_ERRORS = {
    403: "a token-less server refuses a request that a browser could have sent: a Host that is not a loopback "
    "name (DNS rebinding) or a foreign Origin",
}
BODY_ERRORS = {
    400: "the body (or a parameter) is not valid: the message names the field and what is wrong with it",
    413: "the body is larger than the server's limit",
    415: "the body is not sent as application/json",
}
PARAMETER_ERRORS = {400: "a parameter is not valid: the message names it and what is wrong with it"}
COMMON_ERRORS = {**BODY_ERRORS, **AUTH_ERRORS, **BROWSER_ERRORS}  # the readable reference says them once
_COMMON_TEXTS = {*COMMON_ERRORS.values(), *PARAMETER_ERRORS.values()}


@dataclass(frozen=True)
class Operation:
    """One endpoint. The handler is called as `handler(request, body=..., query=...)`, with only the arguments
    this operation declares, already validated; path parameters stay in `request.match_info`."""

    method: str
    path: str
    handler: Handler
    summary: str
    replies: tuple[Reply, ...]
    errors: Mapping[int, str] = field(default_factory=dict)
    body: type[BaseModel] | None = None
    body_required: bool = True  # False: an empty body is the model's defaults (or, for a raw body, empty content)
    raw_body: str | None = None  # the media type of a body taken as bytes (files, archives)
    query: type[BaseModel] | None = None  # a model with extra='forbid': a typo'd parameter is a 400
    path_parameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # name -> JSON schema
    public: bool = False  # no token needed (health, the document itself)
    tag: str = ""
    description: str = ""
    # The shape of its error replies: ErrorBody, or a protocol's own that its clients read (the LLM gateway's).
    error_model: type[BaseModel] = ErrorBody

    @property
    def operation_id(self) -> str:
        return self.handler.__name__

    def error_statuses(self) -> dict[int, str]:
        errors = dict(BROWSER_ERRORS)
        if not self.public:
            errors.update(AUTH_ERRORS)
        if self.query is not None or self.path_parameters:
            errors.update(PARAMETER_ERRORS)
        if self.body is not None:
            errors.update(BODY_ERRORS)
        elif self.raw_body is not None:
            errors[413] = BODY_ERRORS[413]
        for status, when in self.errors.items():  # this operation's own causes come first
            errors[status] = f"{when}; or {errors[status]}" if status in errors else when
        return dict(sorted(errors.items()))


def operations_under(
    prefix: str, path_parameters: Mapping[str, Mapping[str, Any]], resource_errors: Mapping[int, str], tag: str
) -> Callable[..., Operation]:
    """A maker of the operations on one resource (a sandbox, a job): `make(method, suffix, handler, summary,
    replies, errors=..., **more)` is an Operation on `prefix + suffix` with the resource's path parameters, tag and
    errors (the operation's own errors added to them)."""

    def make(
        method: str, suffix: str, handler: Handler, summary: str, replies: tuple[Reply, ...], errors=None, **more
    ) -> Operation:
        return Operation(
            method,
            prefix + suffix,
            handler,
            summary,
            replies,
            errors={**resource_errors, **(errors or {})},
            path_parameters=path_parameters,
            tag=tag,
            **more,
        )

    return make


def metrics_operation(handler: Handler, tag: str) -> Operation:
    """`GET /metrics`, as both servers serve it: Prometheus text behind the token."""
    return Operation(
        "GET",
        "/metrics",
        handler,
        "Prometheus metrics",
        (Reply(200, "Prometheus text exposition format", media_type="text/plain"),),
        tag=tag,
    )


async def parse_body(request: web.Request, model: type[BaseModel], required: bool = True) -> BaseModel:
    """The request's JSON body as `model`. A body must come as application/json: a browser cannot send that
    cross-site without a CORS preflight, which these servers never grant."""
    body = await request.read()
    if not body:
        if not required:
            return model()
        raise web.HTTPBadRequest(text=f"a JSON body is required ({model.__name__})")
    if request.content_type != JSON:
        raise web.HTTPUnsupportedMediaType(
            text=f"the body must be JSON with Content-Type: application/json, not {request.content_type!r}"
        )
    return model.model_validate_json(body)


def parse_query(request: web.Request, model: type[BaseModel]) -> BaseModel:
    repeated = sorted({key for key in request.query if len(request.query.getall(key)) > 1})
    if repeated:
        raise web.HTTPBadRequest(text=f"query parameter(s) {', '.join(repeated)} given more than once")
    try:
        return model.model_validate(dict(request.query))
    except ValidationError as exc:
        raise web.HTTPBadRequest(text=f"invalid query: {describe_validation(exc)}") from None


UNKNOWN_KEY_ERRORS = frozenset({"extra_forbidden", "unexpected_keyword_argument"})


def describe_validation(exc: ValidationError, schema: Any = None) -> str:
    """Every error as `where: what`, joined. Given `schema` (the type that was validated: a model, a pydantic
    dataclass, or a dict of either), an unknown key's error also lists the keys its place takes: a typo's fix."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"])
        message = err["msg"]
        if schema is not None and err["type"] in UNKNOWN_KEY_ERRORS:
            known = _keys_at(schema, err["loc"][:-1])
            if known:
                message += f" (known: {', '.join(known)})"
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _keys_at(schema: Any, path: tuple[int | str, ...]) -> list[str] | None:
    """The field names of the model found at `path` inside `schema`, or None where that is not a model."""
    for step in path:
        if typing.get_origin(schema) is dict:  # a mapping's values: any key leads to the value type
            schema = typing.get_args(schema)[1]
            continue
        fields = _fields(schema)
        if fields is None or step not in fields:
            return None
        schema = _without_none(fields[step].annotation)
    fields = _fields(_without_none(schema))
    return sorted(fields) if fields else None


def _fields(schema: Any) -> dict[str, Any] | None:
    """A pydantic model's or pydantic dataclass's fields."""
    return getattr(schema, "model_fields", None) or getattr(schema, "__pydantic_fields__", None)


def _without_none(annotation: Any) -> Any:
    """`X | None` as `X` (an optional nested section is still that section)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        others = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(others) == 1:
            return others[0]
    return annotation


def route(operation: Operation) -> web.RouteDef:
    """The aiohttp route of an operation: its query and body are validated with the operation's models."""

    async def handle(request: web.Request) -> web.StreamResponse:
        kwargs: dict[str, Any] = {}
        if operation.query is not None:
            kwargs["query"] = parse_query(request, operation.query)
        elif request.query:
            raise web.HTTPBadRequest(text=f"{operation.method} {operation.path} takes no query parameters")
        if operation.body is not None:
            kwargs["body"] = await parse_body(request, operation.body, operation.body_required)
        return await operation.handler(request, **kwargs)

    return web.route(operation.method, operation.path, handle, name=operation.operation_id)


@dataclass(frozen=True)
class API:
    """A server's whole HTTP API: its operations and what the document says about the server."""

    name: str  # the file name of its document under docs/openapi/
    program: str  # the command that serves it and writes its document
    title: str
    version: str
    description: str
    default_port: int
    operations: tuple[Operation, ...]

    def all_operations(self) -> tuple[Operation, ...]:
        return (*self.operations, self.document_operation())

    @property
    def public_paths(self) -> frozenset[str]:
        return frozenset(op.path for op in self.all_operations() if op.public)

    def routes(self) -> list[web.RouteDef]:
        return [route(op) for op in self.all_operations()]

    def document_operation(self) -> Operation:
        async def openapi_document(request: web.Request) -> web.Response:
            return web.json_response(self.document())

        return Operation(
            "GET",
            "/openapi.json",
            openapi_document,
            "This document: the server's API in OpenAPI 3.1",
            replies=(Reply(200, "the OpenAPI document", model=None),),
            public=True,
            tag="server",
        )

    def document(self) -> dict[str, Any]:
        """The OpenAPI 3.1 document: every operation with its parameters, body, replies and errors."""
        operations = self.all_operations()
        refs, schemas = _schemas(operations)
        paths: dict[str, dict[str, Any]] = {}
        for op in operations:
            paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, refs, schemas)
        return {
            "openapi": "3.1.0",
            "info": {
                "title": self.title,
                "version": self.version,
                "description": self.description,
                "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
            },
            "servers": [{"url": f"http://127.0.0.1:{self.default_port}", "description": "the default, loopback"}],
            "security": [{"bearer": []}],
            "tags": [{"name": tag} for tag in dict.fromkeys(op.tag for op in operations if op.tag)],
            "paths": paths,
            "components": {
                "schemas": schemas,
                "securitySchemes": {
                    "bearer": {
                        "type": "http",
                        "scheme": "bearer",
                        "description": "Required on every operation but the public ones when the server is started "
                        "with a token (--token or its environment variable). Without a token the server listens on "
                        "loopback only and needs none.",
                    }
                },
            },
        }


def write_reference(api: API, directory: Path) -> list[Path]:
    """Write `api`'s document as NAME.json and its readable reference as NAME.md under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    document = api.document()
    json_path, markdown_path = directory / f"{api.name}.json", directory / f"{api.name}.md"
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    markdown_path.write_text(render_markdown(api))
    return [json_path, markdown_path]


def openapi_command(api: API, out: Path | None) -> int:
    """The servers' `openapi` command: the document on stdout, or both files written under `out`."""
    if out is None:
        print(json.dumps(api.document(), indent=2))
    else:
        for path in write_reference(api, out):
            print(f"wrote {path}")
    return 0


def _error_shapes(api: API) -> str:
    """The error bodies the operations answer with, as the reference names them."""
    names = [m.__name__ for m in dict.fromkeys(op.error_model for op in api.all_operations())]
    links = [f"[{n}](#{n.lower()})" for n in names]
    if len(links) == 1:
        return f"an {links[0]}"
    return "an " + ", ".join(links[:-1]) + f" or {links[-1]}, as each operation says"


def render_markdown(api: API) -> str:
    """A reference a person reads: every operation with its parameters, body and replies, then every schema
    with its fields. Generated from the document (never edit it by hand)."""
    document = api.document()
    info = document["info"]
    lines = [
        f"# {info['title']}: HTTP API reference",
        "",
        f"Generated from the code by `{api.program} openapi --out docs/openapi` (the same document is served at "
        f"`GET /openapi.json`); the OpenAPI 3.1 document is [{api.name}.json]({api.name}.json). Do not edit by hand.",
        "",
        info["description"],
        "",
        "Auth: with a server token, every operation but the public ones needs `Authorization: Bearer <token>`. "
        f"Every error reply is {_error_shapes(api)}. Besides the replies listed with each operation, any "
        "operation may answer:",
        "",
        *(f"- {status}: {when}" for status, when in sorted(COMMON_ERRORS.items())),
        "",
    ]
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            lines += [
                f"## `{method.upper()} {path}`",
                "",
                op["summary"] + (" (public)" if op.get("security") == [] else ""),
                "",
            ]
            for parameter in op.get("parameters", []):
                schema, required = parameter["schema"], "" if parameter["required"] else ", optional"
                note = f": {schema['description']}" if "description" in schema else ""
                lines.append(
                    f"- {parameter['in']} `{parameter['name']}` ({_type(schema)}{_bounds(schema)}{required}){note}"
                )
            body = op.get("requestBody")
            if body:
                for media, content in body["content"].items():
                    if body["required"]:
                        optional = ""
                    elif media == JSON:
                        optional = " (optional: empty means the defaults)"
                    else:  # raw content: empty is empty content (an empty file), not a default
                        optional = " (may be empty)"
                    lines.append(f"- body ({media}): {_type(content['schema'])}{optional}")
            if lines[-1]:
                lines.append("")
            lines += ["| status | reply | when |", "| --- | --- | --- |"]
            for status, reply in op["responses"].items():
                own = [part for part in reply["description"].split("; or ") if part not in _COMMON_TEXTS]
                if status.startswith(("4", "5")) and not own:
                    continue  # said once at the top
                shape = ", ".join(
                    f"{_type(c['schema'])} ({media})" if media != JSON else _type(c["schema"])
                    for media, c in reply.get("content", {}).items()
                )
                lines.append(f"| {status} | {shape} | {'; or '.join(own)} |")
            lines.append("")
    lines += ["# Schemas", ""]
    for name, schema in document["components"]["schemas"].items():
        lines += [f"## {name}", ""]
        if schema.get("description"):
            lines += [" ".join(schema["description"].split()), ""]
        properties = schema.get("properties", {})
        if properties:
            required = set(schema.get("required", ()))
            lines += ["| field | type | required | description |", "| --- | --- | --- | --- |"]
            for field_name, field_schema in properties.items():
                default = f" (default {json.dumps(field_schema['default'])})" if "default" in field_schema else ""
                described = " ".join(field_schema.get("description", "").split())
                yes = "yes" if field_name in required else "no"
                lines.append(
                    f"| `{field_name}` | {_type(field_schema)}{_bounds(field_schema)} | {yes} | {described}{default} |"
                )
            lines.append("")
        elif "enum" in schema:
            lines += ["One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def _type(schema: dict[str, Any]) -> str:
    """A JSON Schema in a few words: `list[SandboxInfo]`, `string | null`, a link for a named schema."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " \\| ".join(_type(s) for s in schema[key])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_type(schema.get('items', {}))}]"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"dict[string, {_type(schema['additionalProperties'])}]"
    if schema.get("format") == "binary":
        return "bytes"
    return kind or "any"


def _bounds(schema: dict[str, Any]) -> str:
    words = {
        "minimum": ">=",
        "exclusiveMinimum": ">",
        "maximum": "<=",
        "exclusiveMaximum": "<",
        "minLength": "length >=",
        "maxLength": "length <=",
        "minItems": "items >=",
        "pattern": "matching",
    }
    schemas = [schema, *schema.get("anyOf", [])]
    found = [f"{word} `{s[key]}`" for s in schemas for key, word in words.items() if key in s]
    return f" ({', '.join(found)})" if found else ""


def _models(operations: tuple[Operation, ...]) -> list[tuple[type[BaseModel], str]]:
    pairs: dict[tuple[type[BaseModel], str], None] = {(ErrorBody, "serialization"): None}
    for op in operations:
        if op.body is not None:
            pairs[(op.body, "validation")] = None
        if op.query is not None:
            pairs[(op.query, "validation")] = None
        for reply in op.replies:
            if reply.model is not None:
                pairs[(reply.model, "serialization")] = None
        pairs[(op.error_model, "serialization")] = None
    return list(pairs)


def _schemas(operations: tuple[Operation, ...]) -> tuple[dict, dict[str, Any]]:
    refs, definitions = models_json_schema(_models(operations), ref_template="#/components/schemas/{model}")
    return refs, definitions.get("$defs", {})


def _operation(op: Operation, refs: dict, schemas: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary}
    if op.description:
        entry["description"] = op.description
    if op.tag:
        entry["tags"] = [op.tag]
    if op.public:
        entry["security"] = []
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": dict(schema)}
        for name, schema in op.path_parameters.items()
    ]
    if op.query is not None:
        definition = _definition(refs[(op.query, "validation")], schemas)
        required = set(definition.get("required", ()))
        for name, schema in definition.get("properties", {}).items():
            parameter = {"name": name, "in": "query", "required": name in required, "schema": schema}
            if "description" in schema:
                parameter["description"] = schema["description"]
            parameters.append(parameter)
    if parameters:
        entry["parameters"] = parameters
    if op.body is not None:
        entry["requestBody"] = {
            "required": op.body_required,
            "content": {JSON: {"schema": refs[(op.body, "validation")]}},
        }
    elif op.raw_body is not None:
        entry["requestBody"] = {"required": op.body_required, "content": {op.raw_body: {"schema": BINARY}}}
    responses: dict[str, Any] = {}
    for reply in op.replies:
        responses[str(reply.status)] = _reply(reply, refs)
    for status, when in op.error_statuses().items():
        responses[str(status)] = {
            "description": when,
            "content": {JSON: {"schema": refs[(op.error_model, "serialization")]}},
        }
    entry["responses"] = responses
    return entry


def _reply(reply: Reply, refs: dict) -> dict[str, Any]:
    described: dict[str, Any] = {"description": reply.description}
    if reply.model is not None:
        described["content"] = {reply.media_type: {"schema": refs[(reply.model, "serialization")]}}
    elif reply.media_type == JSON:
        described["content"] = {JSON: {"schema": {"type": "object"}}}
    else:
        described["content"] = {reply.media_type: {"schema": BINARY if "text" not in reply.media_type else {}}}
    if reply.links:
        described["links"] = {
            name: {"operationId": link.operation, "parameters": dict(link.parameters)}
            for name, link in reply.links.items()
        }
    return described


def _definition(ref: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    return schemas[ref["$ref"].rsplit("/", 1)[1]]
