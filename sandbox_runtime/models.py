"""The wire format: every request and response body of the runtime's HTTP API, shared by server and client.

pydantic validates each request body once at the edge and turns a bad field into a message naming it, so the
handlers and the sandbox code only ever see well-typed values.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ExecStatus = Literal["completed", "timeout", "interrupted", "dead", "running"]
SessionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class _Strict(BaseModel):
    # An unknown field is a client's typo (`timout`): say so rather than silently ignoring it.
    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    """Resource limits of a sandbox, enforced with rlimits (cgroups are not delegated here) and, for the file
    API, by the server. A field left out takes the server's default; above the server's maximum is a 400.
    Both are in GET /v1/info."""

    memory_mb: int | None = Field(None, gt=0, description="address space per process (RLIMIT_AS)")
    pids: int | None = Field(None, gt=0, description="processes of the sandbox's own host uid (RLIMIT_NPROC)")
    cpu_seconds: int | None = Field(None, gt=0, description="CPU time per process (RLIMIT_CPU)")
    file_size_mb: int | None = Field(
        None, gt=0, description="largest file a process or the file API may write (RLIMIT_FSIZE)"
    )
    open_files: int | None = Field(None, gt=0, description="open file descriptors per process (RLIMIT_NOFILE)")
    disk_mb: int | None = Field(
        None, gt=0, description="what the file API may bring into the sandbox in all (archives counted expanded)"
    )


# Variables the runtime's shell owns (its completion marker, its prompt) or bash keeps read-only.
RESERVED_ENV = frozenset({"PROMPT_COMMAND", "PS0", "PS1", "PS2", "PS4", "SHELLOPTS", "BASHOPTS", "BASH_ENV", "ENV"})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_IMAGE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*$")


class SandboxSpec(_Strict):
    """Body of POST /v1/sandboxes."""

    backend: str | None = None
    image: str | None = Field(
        None,
        max_length=255,
        description="an image by name, relative to one of the server's --image-dir directories "
        "(bwrap: a root filesystem directory; apptainer: a SIF file); never a host path",
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment of the sandboxed shell only")
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

    @field_validator("image")
    @classmethod
    def _image_name(cls, value: str | None) -> str | None:
        if value is not None and (not _IMAGE_NAME.match(value) or ".." in value.split("/")):
            raise ValueError(
                f"image {value!r} is not an image name: names are relative to the server's image directories "
                "(letters, digits, '._+-', '/' between parts; no '..', no absolute path)"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)


def check_env(value: dict[str, str]) -> dict[str, str]:
    """Environment variables for a sandboxed process: shell identifiers, no NUL, none the runtime owns."""
    for name, text in value.items():
        if not _ENV_NAME.match(name) or "\0" in text:
            raise ValueError(f"invalid environment variable {name!r}: names are shell identifiers, values have no NUL")
        if name in RESERVED_ENV or name.startswith("__prorl"):
            raise ValueError(f"environment variable {name!r} is reserved by the runtime's shell")
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


class RunRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/run: one process, started fresh, whose exit status the server takes
    from the kernel (waitpid), not from terminal output. What evaluation should run."""

    argv: list[str] | None = Field(None, min_length=1, description="the program and its arguments")
    script: str | None = Field(None, min_length=1, description="a bash script, run as `bash -c script`")
    cwd: str | None = Field(None, description="working directory inside the sandbox (default: the workdir)")
    env: dict[str, str] = Field(default_factory=dict, description="added to the sandbox's environment")
    timeout: float | None = Field(None, gt=0)
    max_output_bytes: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_program(self) -> RunRequest:
        if (self.argv is None) == (self.script is None):
            raise ValueError("give exactly one of `argv` or `script`")
        return self

    @field_validator("argv")
    @classmethod
    def _no_nul(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any("\0" in arg for arg in value):
            raise ValueError("argv entries may not contain NUL")
        return value

    @field_validator("cwd")
    @classmethod
    def _absolute_cwd(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or "\0" in value):
            raise ValueError("cwd must be an absolute path inside the sandbox")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)


class RunResult(BaseModel):
    output: str = Field(description="stdout and stderr together, head and tail kept when over the cap")
    exit_code: int | None = Field(description="from waitpid; 128+N when killed by signal N; None on timeout")
    status: Literal["completed", "timeout"]
    truncated: bool
    duration_s: float


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
    max_limits: Limits
    local_backend_allowed: bool
    image_dirs: int = Field(description="how many image directories the server takes images from")
    sandbox_uids: str | None = Field(description="host uids sandboxes run as (one each), or None: the server's own")
    max_timeout_s: float
    max_output_bytes: int
    max_body_bytes: int
