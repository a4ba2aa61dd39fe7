"""The wire format: every request and response body of the runtime's HTTP API, shared by server and client.

pydantic validates each request body once at the edge and turns a bad field into a message naming it, so the
handlers and the sandbox code only ever see well-typed values.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ExecStatus = Literal["completed", "timeout", "interrupted", "dead", "running"]
SessionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class _Strict(BaseModel):
    # An unknown field is a client's typo (`timout`): say so rather than silently ignoring it.
    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    """Resource limits of a sandbox's processes, enforced with rlimits (cgroups are not delegated here)."""

    memory_mb: int | None = Field(None, gt=0, description="address space per process (RLIMIT_AS)")
    pids: int | None = Field(None, gt=0, description="processes of the sandbox's user (RLIMIT_NPROC)")
    cpu_seconds: int | None = Field(None, gt=0, description="CPU time per process (RLIMIT_CPU)")
    file_size_mb: int | None = Field(None, gt=0, description="largest file a process may write (RLIMIT_FSIZE)")
    open_files: int | None = Field(None, gt=0, description="open file descriptors per process (RLIMIT_NOFILE)")


class SandboxSpec(_Strict):
    """Body of POST /v1/sandboxes."""

    backend: str | None = None
    image: str | None = Field(None, description="bwrap: a root directory; apptainer: a SIF file or URI")
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/workspace"
    network: Literal["none", "host"] = "none"
    limits: Limits = Field(default_factory=Limits)
    ttl_s: float | None = Field(None, gt=0, description="delete the sandbox this long after creation")
    idle_timeout_s: float | None = Field(None, gt=0, description="delete it after this long without a request")
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        normal = posixpath.normpath(value)
        if not value.startswith("/") or ".." in value.split("/") or normal in ("/", "//"):
            raise ValueError("workdir must be an absolute path below / without '..', e.g. /workspace")
        if normal.split("/")[1] in {"proc", "dev", "sys", "tmp", "etc", "usr", "bin", "lib", "lib64", "sbin"}:
            raise ValueError(f"workdir {value!r} would hide a system directory; use e.g. /workspace")
        return normal

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not name or "=" in name or "\0" in name or "\0" in text:
                raise ValueError(f"invalid environment variable {name!r}")
        return value


class SessionInfo(BaseModel):
    name: str
    busy: bool
    pid: int
    cwd: str


class SandboxInfo(BaseModel):
    id: str
    backend: str
    isolated: bool
    image: str | None
    workdir: str
    network: str
    limits: Limits
    labels: dict[str, str]
    created_at: float
    ttl_s: float | None
    idle_timeout_s: float | None
    sessions: list[SessionInfo]


class ExecRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/exec."""

    command: str = Field(min_length=1)
    timeout: float | None = Field(None, gt=0)
    session: SessionName = "default"
    max_output_bytes: int | None = Field(None, gt=0)
    on_timeout: Literal["kill", "keep"] = "kill"


class InputRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/sessions/{name}/input: text to type, or named keys such as C-c."""

    text: str | None = None
    keys: list[str] | None = None
    timeout: float = Field(1.0, gt=0)

    @field_validator("keys", mode="before")
    @classmethod
    def _one_key_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class ExecResult(BaseModel):
    output: str
    exit_code: int | None
    status: ExecStatus
    truncated: bool
    duration_s: float
    cwd: str


class BackendInfo(BaseModel):
    name: str
    available: bool
    isolated: bool
    detail: str


class ServerInfo(BaseModel):
    version: str
    default_backend: str
    backends: list[BackendInfo]
    max_sandboxes: int
    sandboxes: int
    default_limits: Limits
    max_timeout_s: float
    max_output_bytes: int
    max_body_bytes: int
