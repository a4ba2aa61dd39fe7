"""The interface every sandbox backend implements, and what they share.

A backend turns a sandbox spec into processes: `create` prepares whatever outlives a single shell (an
Apptainer instance), `launch` returns the command line of one process inside the sandbox (a bash session, or
the bash of a one-shot run), `end_processes` ends whatever the sandbox's processes left running outside their
sessions (`reset` calls it, and runs a wipe's cleaning after it), `destroy` removes what `create` made. The
sandbox manager owns the directories, the uids and the sessions; backends own argv.

Two rules every backend keeps:
- Under a root server, every process of a sandbox runs as the sandbox's own unprivileged host uid, with no
  capabilities (`setpriv` drops them before the backend's launcher starts): nothing the sandbox runs is
  host root, and rlimits such as the pids limit count per sandbox.
- The launcher's own environment is fixed and minimal. The spec's `env` is exported by the sandboxed shell
  itself, so no variable a client chooses (LD_PRELOAD, say) ever reaches a host-side process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from server_kit.errors import ApiError

from ..models import Limits, SandboxSpec
from ..session import Launch

SHELL_ARGV = ["bash", "--norc", "--noprofile", "--noediting", "-i"]
# A one-shot run: bash reads its (trusted) script from stdin; the script redirects the program's stdin.
ONESHOT_ARGV = ["bash", "--norc", "--noprofile", "-s"]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The whole environment of a host-side launcher (setpriv, bwrap): nothing of the server's, nothing of a spec's.
LAUNCHER_ENV = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
# What every session's bash starts with: no prompt text (the runtime's marker is the only prompt) and a
# terminal type that makes well-behaved programs print no colour or cursor codes.
SHELL_ENV = {"TERM": "dumb", "PS1": "", "PS2": "", "PATH": DEFAULT_PATH}

# bash `ulimit` flags and the factor from our units to bash's (KiB for -v and -f).
_ULIMIT_FLAGS = {
    "memory_mb": ("-v", 1024),
    "pids": ("-u", 1),
    "cpu_seconds": ("-t", 1),
    "file_size_mb": ("-f", 1024),
    "open_files": ("-n", 1),
}


def ulimit_args(limits: Limits) -> list[str]:
    """`ulimit -HS` arguments that enforce `limits` (memory and pids cgroup controllers are not delegated here).

    They are applied by the sandbox's shell, not set on the launcher: RLIMIT_NPROC set before a user
    namespace is created also caps the creator's whole uid on the host (the kernel checks every level of
    the namespace chain against the limit the namespace was created with), so a pids limit of 64 would make
    the sandbox fail to start on any host running more than 64 processes as that user.
    """
    args: list[str] = []
    for name, (flag, scale) in _ULIMIT_FLAGS.items():
        value = getattr(limits, name)
        if value is not None:
            args += [flag, str(value * scale)]
    return args


def drop_privileges(uid: int | None) -> list[str]:
    """argv prefix that runs the rest as `uid` (its own group, no supplementary groups), with no capabilities
    in any set, the bounding set emptied and no_new_privs: a root server's sandbox can never regain root.
    Empty when `uid` is None (an unprivileged server: its sandboxes run as its own uid)."""
    if uid is None:
        return []
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


@dataclass(frozen=True)
class SandboxDirs:
    """What the server decided for one sandbox on the host: its directories under the state dir, the host uid
    its processes run as (None: the server's own), and its image: `image_root` the root directory of its
    image (None: the host's), unpacked from the image's file where it has one (sandbox_runtime/images.py), or
    `image_file`, a SIF file, for a backend that runs SIF files itself (`runs_sif`); one of the two at most.
    `image_env` is the image's own environment (an OCI config's `Env`), `image_digest` its cache key."""

    id: str
    root: Path
    uid: int | None = None
    image_root: Path | None = None
    image_file: Path | None = None
    image_env: dict[str, str] = field(default_factory=dict)
    image_digest: str | None = None

    @property
    def has_image(self) -> bool:
        return self.image_root is not None or self.image_file is not None

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"


class Backend(ABC):
    name: str
    isolated: bool = True
    forwards: bool = False  # whether its sessions have a network namespace of their own to open forwards in
    runs_sif: bool = False  # whether it takes a SIF image as the file itself (Apptainer) rather than unpacked

    @classmethod
    @abstractmethod
    def probe(cls) -> tuple[bool, str]:
        """(available, detail): whether this backend can run here, and what it found or what is missing."""

    async def create(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        """Prepare what outlives a session. Raise BackendError with a clear message on failure."""
        return None

    @abstractmethod
    def launch(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> Launch:
        """How to start `command` (a bash session by default) inside the sandbox."""

    async def end_processes(self, dirs: SandboxDirs, spec: SandboxSpec) -> int:
        """End what the sandbox's processes left running beyond their sessions (daemons, `setsid`); called
        after every session is closed. Returns how many processes were signalled."""
        return 0

    async def reset(
        self, dirs: SandboxDirs, spec: SandboxSpec, clean: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """End what the sandbox's processes left running (`end_processes`), then run `clean` (a wipe's emptying and
        seeding of the workspace) while nothing of the sandbox runs; called after every session is closed."""
        await self.end_processes(dirs, spec)
        if clean is not None:
            await clean()

    async def destroy(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        """Remove what `create` made; called after every session of the sandbox is gone. Idempotent."""
        return None

    def visible_paths(self, dirs: SandboxDirs, spec: SandboxSpec) -> dict[str, Path]:
        """In-sandbox path -> host directory, for the file API."""
        return {spec.workdir: dirs.workspace, "/tmp": dirs.tmp}

    def workdir(self, dirs: SandboxDirs, spec: SandboxSpec) -> str:
        """The sandbox's working directory as its processes see it."""
        return spec.workdir

    def sandbox_env(self, dirs: SandboxDirs, spec: SandboxSpec) -> dict[str, str]:
        """The environment of the sandboxed shell, exported by that shell (never a launcher's environment).

        In an image, PATH is the image's: its config's `Env`, or what its `/.singularity.d/env` scripts make of
        the default (a conda image puts its own bin first). TERM, the prompts and HOME stay the runtime's; the
        spec's `env` wins over everything."""
        base = {k: v for k, v in SHELL_ENV.items() if k != "PATH"} if dirs.has_image else SHELL_ENV
        return {**dirs.image_env, **base, "HOME": self.workdir(dirs, spec), **spec.env}


class BackendError(ApiError):
    """A backend could not create or reach a sandbox; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status
