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

    backend: str | None = Field(
        None,
        description="bwrap, apptainer, singularity or local (local only where the server allows it); null: the "
        "server's default_backend (GET /v1/info)",
    )
    image: str | None = Field(
        None,
        max_length=255,
        description="an image by name, relative to one of the server's --image-dir directories: a SIF file, an "
        "OCI layout directory or a docker save archive (either with an optional `:TAG`), or a root filesystem "
        "directory; never a host path. GET /v1/images lists them",
        examples=["debian-python.sif", "swe/sweb.eval.x86_64.astropy__astropy-12907.sif", "python.oci:3.11"],
    )
    env: Environment = Field(
        default_factory=dict,
        description="environment variables of every shell and run in the sandbox (never the server's own)",
    )
    workdir: str = Field(
        "/workspace",
        max_length=1024,
        description="absolute path of the writable workspace inside the sandbox, where shells start",
    )
    seed_workdir: bool = Field(
        False,
        description="the workspace, mounted at `workdir`, starts as a copy of what the image holds at `workdir` "
        "(a SWE-bench image's /testbed), and again after each wipe; needs `image`, whose `workdir` must be a "
        "directory. The copy counts against limits.disk_mb",
    )
    network: Literal["none", "host"] = Field(
        "none", description="none: no network but loopback (and `forwards`); host: the host's network"
    )
    forwards: list[PortForward] = Field(
        default_factory=list,
        max_length=MAX_FORWARDS,
        description="ports on the sandbox's loopback, each leading to one address (network: none only)",
    )
    limits: Limits = Field(
        default_factory=Limits, description="resource limits; a field left out takes the server's default"
    )
    ttl_s: float | None = Field(
        None, gt=0, description="seconds after creation when the sandbox is deleted; null: never"
    )
    idle_timeout_s: float | None = Field(
        None, gt=0, description="seconds without a request after which the sandbox is deleted; null: never"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="free-form tags, given back as they are")

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
    """One persistent shell session of a sandbox."""

    name: str = Field(description="the name exec's `session` gives it")
    busy: bool = Field(description="a command runs in it (one kept with on_timeout: keep)")
    pid: int = Field(description="host pid of its shell's launcher")
    cwd: str = Field(description="the shell's working directory after its last command")


class SandboxInfo(BaseModel):
    """A sandbox as the server holds it: its spec, as applied, and its sessions."""

    id: str = Field(description="what every /v1/sandboxes/{id} operation takes")
    backend: str = Field(description="the backend that runs it")
    isolated: bool = Field(description="false only for the local backend, which isolates nothing")
    image: str | None = Field(description="the image it runs; null: none (the backend's read-only view of the host)")
    image_digest: str | None = Field(
        None,
        description="sha256 of the image it runs (the SIF or archive file, or the OCI manifest); null for "
        "the host's root or a root directory",
    )
    workdir: str = Field(description="absolute path of its workspace inside the sandbox")
    network: str = Field(description="none or host")
    forwards: list[PortForward] = Field(default_factory=list, description="its port forwards")
    limits: Limits = Field(description="its limits, the server's defaults filled in")
    labels: dict[str, str] = Field(description="as the spec gave them")
    created_at: float = Field(description="Unix time of its creation, in seconds")
    ttl_s: float | None = Field(description="seconds after created_at when it is deleted; null: never")
    idle_timeout_s: float | None = Field(description="seconds without a request before it is deleted; null: never")
    sessions: list[SessionInfo] = Field(description="its live shell sessions")


class ExecRequest(_Strict):
    """Body of POST /v1/sandboxes/{id}/exec."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"command": "ls -la && cd /tmp", "timeout": 30}]})

    command: str = Field(
        min_length=1,
        description="bash source, run verbatim by the session's shell (several lines, pipes and `cd` included); "
        "`$?` in it is the previous command's exit code",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        description="seconds the command may run; null: the server's default_timeout_s (GET /v1/info; 60 s "
        "unless the server was configured otherwise); at most max_timeout_s (a 400 above it)",
    )
    session: SessionName = Field(
        "default",
        description="the shell session to run in, created on first use; cwd, variables and background jobs "
        "persist in it across calls",
    )
    max_output_bytes: int | None = Field(
        None,
        gt=0,
        description="bytes of output kept, head and tail (`truncated` says when); null: the server's "
        "default_output_bytes (GET /v1/info; 64 KiB unless configured); at most max_output_bytes",
    )
    on_timeout: Literal["kill", "keep"] = Field(
        "kill",
        description="past `timeout`: kill interrupts the command (C-c, then SIGKILL of its process group); keep "
        "leaves it running, to be continued with the session's input and output operations",
    )


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

    text: Annotated[str | SkipJsonSchema[None], BeforeValidator(_not_null)] = Field(
        None,
        description="typed as it is; end it with a newline to press Enter",
        json_schema_extra=_no_default,
    )
    keys: Annotated[list[str] | str | SkipJsonSchema[None], BeforeValidator(_not_null)] = Field(
        None,
        description="key names such as C-c, Enter, Up; one name alone may be given as a string",
        json_schema_extra=_no_default,
    )
    timeout: float = Field(
        1.0,
        gt=0,
        description="seconds to wait, after the input is delivered, for the command to finish; the reply carries "
        "what it printed until then (status running if it still runs); capped at the server's max_timeout_s",
    )

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
    timeout: float | None = Field(
        None,
        gt=0,
        description="seconds the process may run before it is killed (status timeout); null: the server's "
        "default_timeout_s (GET /v1/info; 60 s unless configured); at most max_timeout_s (a 400 above it)",
    )
    max_output_bytes: int | None = Field(
        None,
        gt=0,
        description="bytes of output kept, head and tail; null: the server's default_output_bytes (GET /v1/info; "
        "64 KiB unless configured); at most max_output_bytes",
    )

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
    """What a one-shot run did."""

    output: str = Field(description="stdout and stderr together, head and tail kept when over the cap")
    exit_code: int | None = Field(description="from waitpid; 128+N when killed by signal N; null on timeout")
    status: Literal["completed", "timeout"] = Field(description="timeout: it ran past `timeout` and was killed")
    truncated: bool = Field(description="output was over max_output_bytes: its middle was left out")
    duration_s: float = Field(description="seconds from its start to its end")


class ExecResult(BaseModel):
    """What a command of a shell session did, or has done so far."""

    output: str = Field(
        description="what the command printed (stdout and stderr, as a terminal shows them), head and tail kept "
        "when over the cap; for input and output of a kept command, what it printed since the last read"
    )
    exit_code: int | None = Field(
        description="the command's exit status, once it has finished (also when read through the output "
        "operation after a timeout with keep); null while it runs"
    )
    status: ExecStatus = Field(
        description="completed, timeout, interrupted (it ended after a C-c), dead (the shell exited) or running"
    )
    truncated: bool = Field(description="output was over max_output_bytes: its middle was left out")
    duration_s: float = Field(description="seconds from the command's start to its end (to now, while it runs)")
    cwd: str = Field(description="the shell's working directory after the command (or when it was last known)")


class BackendInfo(BaseModel):
    name: str = Field(description="what a spec's `backend` names it by")
    available: bool = Field(description="it can be used on this machine")
    isolated: bool = Field(description="it isolates a sandbox from the host (false only for local)")
    detail: str = Field(description="what was found, or why it is not available")


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
    """GET /v1/info: what this server offers, its defaults and its maxima."""

    version: str = Field(description="the runtime's version")
    default_backend: str = Field(description="the backend a spec without `backend` gets")
    backends: list[BackendInfo] = Field(description="every backend and whether it can be used here")
    max_sandboxes: int = Field(description="sandboxes the server holds at once at most (--max-sandboxes)")
    sandboxes: int = Field(description="sandboxes it holds now")
    default_limits: Limits = Field(description="what a limit left out of a spec takes")
    max_limits: Limits = Field(description="the most a spec may ask for")
    local_backend_allowed: bool = Field(description="the local backend may be asked for (--allow-local)")
    image_dirs: int = Field(description="how many image directories the server takes images from")
    host_paths: list[str] = Field(
        default_factory=list,
        description="host paths that a bwrap sandbox without an image sees read-only (--host-path), beside /usr, "
        "its own minimal /etc, /dev, /proc, its workspace and /tmp",
    )
    sandbox_uids: str | None = Field(description="host uids sandboxes run as (one each), or None: the server's own")
    default_timeout_s: float = Field(
        description="seconds an exec or run without `timeout` may take (60 unless the server was configured otherwise)"
    )
    max_timeout_s: float = Field(description="the largest `timeout` an exec or run may ask for, in seconds")
    default_output_bytes: int = Field(
        description="bytes of output an exec or run without `max_output_bytes` keeps (65536 unless configured)"
    )
    max_output_bytes: int = Field(description="the largest `max_output_bytes` an exec or run may ask for")
    max_body_bytes: int = Field(description="the largest request body, and the largest file or archive read")
    enforcement: LimitEnforcement = Field(description="what holds each limit for the whole sandbox on this server")


# -- replies of the smaller operations ------------------------------------------------------------------
class Health(BaseModel):
    ok: bool = Field(description="always true: the server answers")


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo] = Field(description="every live sandbox (not those being deleted)")


class ImageInfo(BaseModel):
    name: str = Field(description="what a spec's `image` names it by")
    format: ImageFormat = Field(description="a root directory, a SIF file, an OCI layout or a docker save archive")
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
    images: list[ImageInfo] = Field(description="every image below the server's image directories")
    truncated: bool = Field(False, description="the listing stopped at its maximum number of images")


class SandboxDeleted(BaseModel):
    id: str = Field(description="the sandbox's id")
    deleted: Literal[True] = Field(True, description="always true")
    already_deleted: bool = Field(description="the sandbox was gone already (deleting is idempotent)")


class ProcessesEnded(BaseModel):
    id: str = Field(description="the sandbox's id")
    sessions_ended: list[str] = Field(description="the shell sessions that were ended")


class SandboxWiped(ProcessesEnded):
    wiped: Literal[True] = Field(True, description="always true")


class SessionDeleted(BaseModel):
    id: str = Field(description="the sandbox's id")
    session: str = Field(description="the session's name")
    deleted: Literal[True] = Field(True, description="always true")


class FileWritten(BaseModel):
    path: str = Field(description="the path as the request gave it")
    bytes: int = Field(description="bytes written")


class ArchiveWritten(BaseModel):
    path: str = Field(description="the directory as the request gave it")
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
    version: str = Field(max_length=64, description="the runtime's version")
    interval_s: float = Field(gt=0, le=3600, description="seconds until the next heartbeat")
    leaving: bool = Field(False, description="sent once on a clean shutdown: place no more sandboxes here")
    token: str | None = Field(
        None,
        max_length=512,
        description="the runtime's own API token, which the services call it with (never the registration token)",
    )
