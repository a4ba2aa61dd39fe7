"""The wire format: every request and response body of the runtime's HTTP API, shared by server and client.

pydantic validates each request body once at the edge and turns a bad field into a message naming it, so the
handlers and the sandbox code only ever see well-typed values.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

ExecStatus = Literal["completed", "timeout", "interrupted", "dead", "running"]
ImageFormat = Literal["directory", "sif", "oci", "docker-archive"]
ImageCacheState = Literal["in place", "unpacked", "unpacking", "not unpacked"]
SessionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class _Strict(BaseModel):
    # An unknown field is a client's typo (`timout`): say so rather than silently ignoring it. A value of the
    # wrong JSON type (`"5"` for a number, `0` for a boolean) is one too: strict, as the OpenAPI document says.
    model_config = ConfigDict(extra="forbid", strict=True)


# The least a sandbox can work with: what its bash needs to start and to run a pipeline of coreutils, a
# command substitution and a background job, measured with a session and a one-shot run alive (6 MB of address
# space, 5 open files, 4 processes), with a margin. Below these a sandbox could not even run `ls | wc -l`.
MIN_MEMORY_MB = 32
MIN_PIDS = 16
MIN_OPEN_FILES = 16
MIN_INODES = 1024  # a file system of the workspace and /tmp smaller than this is no use


class Limits(_Strict):
    """Resource limits of a sandbox: per process with rlimits, and for the whole sandbox (memory of all its
    processes, disk bytes and inodes of its workspace and /tmp) with what the server can use, which GET /v1/info
    names in `enforcement`. A field left out takes the server's default; above the server's maximum is a 400.
    Both are in GET /v1/info. The minimums are what a shell needs to run ordinary commands."""

    memory_mb: int | None = Field(
        None,
        ge=MIN_MEMORY_MB,
        description="address space per process (RLIMIT_AS), and the memory of all the sandbox's processes together "
        "(see GET /v1/info's enforcement.memory)",
    )
    pids: int | None = Field(None, ge=MIN_PIDS, description="processes of the sandbox's own host uid (RLIMIT_NPROC)")
    cpu_seconds: int | None = Field(None, gt=0, description="CPU time per process (RLIMIT_CPU)")
    file_size_mb: int | None = Field(
        None, gt=0, description="largest file a process or the file API may write (RLIMIT_FSIZE)"
    )
    open_files: int | None = Field(
        None, ge=MIN_OPEN_FILES, description="open file descriptors per process (RLIMIT_NOFILE)"
    )
    disk_mb: int | None = Field(
        None,
        gt=0,
        description="bytes of the workspace and /tmp together (see GET /v1/info's enforcement.disk), and what the "
        "file API may bring into the sandbox in all (archives counted expanded)",
    )
    inodes: int | None = Field(
        None,
        ge=MIN_INODES,
        description="files, directories and links of the workspace and /tmp together (see enforcement.inodes)",
    )


# Variables the runtime's shell owns (its completion marker, its prompt), bash keeps read-only, or that would end
# the session behind the runtime's back (TMOUT: bash logs out when idle that long).
RESERVED_ENV = frozenset(
    {"PROMPT_COMMAND", "PS0", "PS1", "PS2", "PS4", "SHELLOPTS", "BASHOPTS", "BASH_ENV", "ENV"}
    | {"UID", "EUID", "PPID", "BASH_VERSINFO", "TMOUT"}
)
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_ENV_NAME = re.compile(ENV_NAME_PATTERN)
# Shell identifiers as keys, and only those (pydantic writes `patternProperties`, which alone would let any other
# key through in JSON Schema); the reserved ones are refused by check_env.
Environment = Annotated[
    dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN)], Annotated[str, Field(pattern=r"^[^\x00]*$")]],
    Field(json_schema_extra={"additionalProperties": False}),
]
MAX_WORKDIR_BYTES = 1024
# A path below an image directory, then an optional `:TAG` for OCI layouts and docker archives.
IMAGE_NAME = re.compile(
    r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$"
)
MAX_FORWARDS = 8


class PortForward(_Strict):
    """A port on the sandbox's own loopback that leads to one address the server reaches (forwards.py), e.g. an
    agent harness's LLM gateway; the sandbox reaches nothing else. Only with `network: none`."""

    port: int = Field(ge=1, le=65535, description="the port on 127.0.0.1 inside the sandbox")
    target: str = Field(
        pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$",
        description="HOST:PORT as the server reaches it ([::1]:PORT for IPv6)",
        examples=["127.0.0.1:8766"],
    )

    @field_validator("target")
    @classmethod
    def _target_port(cls, value: str) -> str:
        if not 0 < int(value.rpartition(":")[2]) < 65536:
            raise ValueError(f"target {value!r} names no port between 1 and 65535")
        return value

    @property
    def target_host(self) -> str:
        return self.target.rpartition(":")[0].strip("[]")

    @property
    def target_port(self) -> int:
        return int(self.target.rpartition(":")[2])


class SandboxSpec(_Strict):
    """Body of POST /v1/sandboxes."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"limits": {"memory_mb": 2048, "pids": 256}, "ttl_s": 600, "labels": {"job": "a"}}]
        }
    )

    backend: str | None = None
    image: str | None = Field(
        None,
        max_length=255,
        description="an image by name, relative to one of the server's --image-dir directories: a SIF file, an "
        "OCI layout directory or a docker save archive (either with an optional `:TAG`), or a root filesystem "
        "directory; never a host path. GET /v1/images lists them",
        examples=["debian-python.sif", "swe/sweb.eval.x86_64.astropy__astropy-12907.sif", "python.oci:3.11"],
    )
    env: Environment = Field(default_factory=dict, description="environment of the sandboxed shell only")
    workdir: str = Field("/workspace", max_length=1024)
    seed_workdir: bool = Field(
        False,
        description="the workspace, mounted at `workdir`, starts as a copy of what the image holds at `workdir` "
        "(a SWE-bench image's /testbed), and again after each wipe; needs `image`, whose `workdir` must be a "
        "directory. The copy counts against limits.disk_mb",
    )
    network: Literal["none", "host"] = "none"
    forwards: list[PortForward] = Field(
        default_factory=list,
        max_length=MAX_FORWARDS,
        description="ports on the sandbox's loopback, each leading to one address (network: none only)",
    )
    limits: Limits = Field(default_factory=Limits)
    ttl_s: float | None = Field(None, gt=0, description="delete the sandbox this long after creation")
    idle_timeout_s: float | None = Field(None, gt=0, description="delete it after this long without a request")
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        normal = "/" + posixpath.normpath(value).lstrip("/")  # normpath keeps a leading '//'
        if not value.startswith("/") or ".." in value.split("/") or normal == "/":
            raise ValueError("workdir must be an absolute path below / without '..', e.g. /workspace")
        if any(ord(c) < 0x20 or c == "\x7f" for c in value):
            raise ValueError("workdir may not contain control characters (NUL, newline, ...)")
        if len(normal.encode()) > MAX_WORKDIR_BYTES or any(len(p.encode()) > 255 for p in normal.split("/")):
            raise ValueError(
                f"workdir is too long: at most {MAX_WORKDIR_BYTES} bytes, each name in it at most 255 bytes"
            )
        if normal.split("/")[1] in {"proc", "dev", "sys", "tmp", "etc", "usr", "bin", "lib", "lib64", "sbin"}:
            raise ValueError(f"workdir {value!r} would hide a system directory; use e.g. /workspace")
        return normal

    @field_validator("image")
    @classmethod
    def _image_name(cls, value: str | None) -> str | None:
        if value is not None and (not IMAGE_NAME.fullmatch(value) or ".." in value.split("/")):
            raise ValueError(
                f"image {value!r} is not an image name: names are relative to the server's image directories "
                "(letters, digits, '._+-', '/' between parts, an optional ':TAG'; no '..', no absolute path)"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @model_validator(mode="after")
    def _forwards_need_own_network(self) -> SandboxSpec:
        if self.forwards and self.network != "none":
            raise ValueError("forwards need network: none (with network: host the sandbox has the host's ports)")
        ports = [f.port for f in self.forwards]
        if len(set(ports)) != len(ports):
            raise ValueError(f"two forwards on one port: {sorted(ports)}")
        return self

    @model_validator(mode="after")
    def _seed_needs_image(self) -> SandboxSpec:
        if self.seed_workdir and self.image is None:
            raise ValueError("seed_workdir copies the image's workdir into the workspace: it needs an `image`")
        return self


MAX_ENV_ENTRY_BYTES = 128 * 1024  # the kernel's MAX_ARG_STRLEN: one NAME=value string, its NUL included
# Every NAME=value together. The kernel's ARG_MAX (a quarter of the stack limit: 2 MiB under the usual 8 MiB)
# bounds a program's environment and arguments together; past it, every program the shell starts fails with
# E2BIG. Half of it leaves room for the arguments and the runtime's own variables.
MAX_ENV_BYTES = 1024 * 1024


def check_env(value: dict[str, str]) -> dict[str, str]:
    """Environment variables for a sandboxed process: shell identifiers, no NUL, none the runtime owns."""
    for name, text in value.items():
        if not _ENV_NAME.match(name) or "\0" in text:
            raise ValueError(f"invalid environment variable {name!r}: names are shell identifiers, values have no NUL")
        if name in RESERVED_ENV or name.startswith("__prorl"):
            raise ValueError(f"environment variable {name!r} is reserved by the runtime's shell")
        if len(name) + 1 + len(text.encode()) >= MAX_ENV_ENTRY_BYTES:
            raise ValueError(
                f"environment variable {name!r} is over {MAX_ENV_ENTRY_BYTES} bytes: the kernel refuses to start a "
                "program with it (MAX_ARG_STRLEN); pass large data as a file"
            )
    total = sum(len(name) + len(text.encode()) + 2 for name, text in value.items())
    if total > MAX_ENV_BYTES:
        raise ValueError(
            f"the environment is {total} bytes in all, over {MAX_ENV_BYTES}: no program could start with it "
            "beside its arguments (ARG_MAX); pass large data as a file"
        )
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
    image_digest: str | None = Field(
        None,
        description="sha256 of the image it runs (the SIF or archive file, or the OCI manifest); null for "
        "the host's root or a root directory",
    )
    workdir: str
    network: str
    forwards: list[PortForward] = Field(default_factory=list)
    limits: Limits
    labels: dict[str, str]
    created_at: float
    ttl_s: float | None
    idle_timeout_s: float | None
    sessions: list[SessionInfo]


class ExecRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/exec."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"command": "ls -la && cd /tmp", "timeout": 30}]})

    command: str = Field(min_length=1)
    timeout: float | None = Field(None, gt=0)
    session: SessionName = "default"
    max_output_bytes: int | None = Field(None, gt=0)
    on_timeout: Literal["kill", "keep"] = "kill"


def _no_default(schema: dict) -> None:
    """For a field that is left out rather than null: no `"default": null` in its schema, which the type
    (a string, a list) would contradict."""
    schema.pop("default", None)


def _not_null(value: object) -> object:
    if value is None:
        raise ValueError("leave the field out instead of sending null")
    return value


def exactly_one_of(*names: str) -> dict:
    """The JSON Schema of a body that must give exactly one of these fields (the model validator checks it)."""
    return {"oneOf": [{"required": [name]} for name in names]}


class InputRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/sessions/{name}/input: text to type, or named keys such as C-c."""

    model_config = ConfigDict(json_schema_extra=exactly_one_of("text", "keys"))

    text: Annotated[str | SkipJsonSchema[None], BeforeValidator(_not_null)] = Field(None, json_schema_extra=_no_default)
    keys: Annotated[list[str] | str | SkipJsonSchema[None], BeforeValidator(_not_null)] = Field(
        None,
        description="key names such as C-c, Enter, Up; one name alone may be given as a string",
        json_schema_extra=_no_default,
    )
    timeout: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _text_or_keys(self) -> InputRequest:
        if (self.text is None) == (self.keys is None):
            raise ValueError("give exactly one of `text` or `keys`")
        if isinstance(self.keys, str):
            self.keys = [self.keys]
        return self


class RunRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/run: one process, started fresh, whose exit status the server takes
    from the kernel (waitpid), not from terminal output. What evaluation should run."""

    model_config = ConfigDict(json_schema_extra=exactly_one_of("argv", "script"))

    argv: Annotated[list[str] | SkipJsonSchema[None], BeforeValidator(_not_null)] = Field(
        None, min_length=1, description="the program and its arguments", json_schema_extra=_no_default
    )
    script: Annotated[str | SkipJsonSchema[None], BeforeValidator(_not_null)] = Field(
        None, min_length=1, description="a bash script, run as `bash -c script`", json_schema_extra=_no_default
    )
    cwd: str | None = Field(None, description="working directory inside the sandbox (default: the workdir)")
    env: Environment = Field(default_factory=dict, description="added to the sandbox's environment")
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


class LimitEnforcement(BaseModel):
    """What bounds a sandbox as a whole on this server; where nothing can, the value says what still holds."""

    memory: Literal["cgroup v2", "cgroup v1", "watchdog", "per process"] = Field(
        description="limits.memory_mb for all the sandbox's processes together: a memory cgroup of its own (the "
        "kernel reclaims, then OOM-kills inside it), a watchdog that sums their resident memory and ends them "
        "above the limit, or only RLIMIT_AS per process"
    )
    disk: Literal["filesystem", "per file"] = Field(
        description="limits.disk_mb for the workspace and /tmp together: a file system of the sandbox's own (its "
        "writes fail with ENOSPC, nobody else's do), or only limits.file_size_mb per file (and disk_mb for what "
        "the file API brings in)"
    )
    inodes: Literal["filesystem", "none"] = Field(description="limits.inodes: the same file system, or nothing")
    detail: str = Field(description="why, where something could not be used")


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
    host_paths: list[str] = Field(
        default_factory=list,
        description="host paths that a bwrap sandbox without an image sees read-only (--host-path), beside /usr, "
        "its own minimal /etc, /dev, /proc, its workspace and /tmp",
    )
    sandbox_uids: str | None = Field(description="host uids sandboxes run as (one each), or None: the server's own")
    max_timeout_s: float
    max_output_bytes: int
    max_body_bytes: int
    enforcement: LimitEnforcement = Field(description="what holds each limit for the whole sandbox on this server")


# -- replies of the smaller operations ------------------------------------------------------------------
class Health(BaseModel):
    ok: bool


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class ImageInfo(BaseModel):
    name: str = Field(description="what a spec's `image` names it by")
    format: ImageFormat
    digest: str | None = Field(
        description="sha256 the cache keys it by: an OCI layout's manifest digest; for a SIF file or an archive, "
        "the file's, known once it has been used (null until then); null for a root directory"
    )
    cache: ImageCacheState = Field(
        description="a root directory is used in place; the others are unpacked once, at their first use"
    )
    bytes: int | None = Field(
        description="size of the unpacked root where it is unpacked, else of the file; null for a root directory"
    )


class ImageList(BaseModel):
    images: list[ImageInfo]
    truncated: bool = Field(False, description="the listing stopped at its maximum number of images")


class SandboxDeleted(BaseModel):
    id: str
    deleted: Literal[True] = True
    already_deleted: bool = Field(description="the sandbox was gone already (deleting is idempotent)")


class ProcessesEnded(BaseModel):
    id: str
    sessions_ended: list[str] = Field(description="the shell sessions that were ended")


class SandboxWiped(ProcessesEnded):
    wiped: Literal[True] = True


class SessionDeleted(BaseModel):
    id: str
    session: str
    deleted: Literal[True] = True


class FileWritten(BaseModel):
    path: str
    bytes: int


class ArchiveWritten(BaseModel):
    path: str
    members: int = Field(description="files, directories and links extracted")


class PathQuery(BaseModel):
    """Query of the file and archive operations."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, max_length=4096, description="a path inside the sandbox (relative: to the workdir)")


# -- registration: what a runtime tells the rollout services it works for (`--register`) ------------------------
RUNTIME_URL_PATTERN = r"https?://[^\s/?#]+"  # where a runtime is reached: scheme, host and port, no path
RUNTIME_NAME_PATTERN = r"[A-Za-z0-9_.:-]{1,128}"  # how services know a runtime (a path segment)


class RuntimeHeartbeat(_Strict):
    """Sent by a runtime to each service it registers with, every `interval_s` seconds: where it is reached and
    how much room it has. A service stops placing sandboxes on a runtime it has not heard from for three
    intervals; `leaving` (sent once on a clean shutdown) stops it at once."""

    url: str = Field(
        pattern=f"^{RUNTIME_URL_PATTERN}$", max_length=512, description="where services reach this runtime"
    )
    capacity: int = Field(ge=0, description="the most sandboxes it holds at once (--max-sandboxes)")
    sandboxes: int = Field(ge=0, description="sandboxes it holds now")
    backend: str = Field(max_length=64, description="its default backend")
    version: str = Field(max_length=64)
    interval_s: float = Field(gt=0, le=3600, description="seconds until the next heartbeat")
    leaving: bool = False
    token: str | None = Field(
        None,
        max_length=512,
        description="the runtime's own API token, which the services call it with (never the registration token)",
    )
