"""No isolation at all: bash runs on the host in the sandbox's workspace directory.

For development on machines without bubblewrap or Apptainer. A server offers it only when started with
`--allow-local` (or `--backend local`), and /v1/info reports it as not isolated. Paths the agent sees are host
paths. Under a root server its processes still run as the sandbox's own unprivileged uid.

Its processes are not held by a pid namespace, so a `setsid` daemon outlives its session; `end_processes`
finds them all: by uid where the sandbox has its own (exact: no other process runs as it), else by the
`PRORL_SANDBOX` variable every process of the sandbox inherits (a process that clears its environment
escapes that; the local backend is not a sandbox).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import procs
from ..models import SandboxSpec
from ..session import Launch
from .base import LAUNCHER_ENV, SHELL_ARGV, Backend, BackendError, SandboxDirs, drop_privileges, ulimit_args

MARKER = "PRORL_SANDBOX"


class LocalBackend(Backend):
    name = "local"
    isolated = False

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        path = shutil.which("bash")
        return (path is not None), "NOT ISOLATED: runs commands as the server's user on the host"

    def launch(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> Launch:
        if spec.image:
            raise BackendError("the local backend runs on the host and takes no image", 400)
        # `env -C`: the shell starts in its workspace, not in the server's directory (which the sandbox's uid may
        # not be allowed to enter); launchers are spawned without a working directory of their own (spawn.py).
        return Launch(
            argv=[*drop_privileges(dirs.uid), "env", "-C", str(dirs.workspace), *command],
            env={**LAUNCHER_ENV, MARKER: str(dirs.root)},
            sandbox_env={**self.sandbox_env(dirs, spec), "TMPDIR": str(dirs.tmp)},
            ulimits=ulimit_args(spec.limits),
        )

    async def end_processes(self, dirs: SandboxDirs, spec: SandboxSpec) -> int:
        if dirs.uid is not None:
            return procs.kill_user(dirs.uid)
        return procs.kill_marked(MARKER, str(dirs.root))

    async def destroy(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        await self.end_processes(dirs, spec)

    def visible_paths(self, dirs: SandboxDirs, spec: SandboxSpec) -> dict[str, Path]:
        return {str(dirs.workspace): dirs.workspace, str(dirs.tmp): dirs.tmp}

    def workdir(self, dirs: SandboxDirs, spec: SandboxSpec) -> str:
        return str(dirs.workspace)
