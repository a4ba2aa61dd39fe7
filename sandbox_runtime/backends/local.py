"""No isolation at all: bash runs on the host in the sandbox's workspace directory.

For development on machines without bubblewrap or Apptainer. It is used only when asked for by name and
/v1/info reports it as not isolated. Paths the agent sees are host paths.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..models import SandboxSpec
from ..session import Launch
from .base import SHELL_ARGV, Backend, BackendError, SandboxDirs, ulimit_args


class LocalBackend(Backend):
    name = "local"
    isolated = False

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        path = shutil.which("bash")
        return (path is not None), "NOT ISOLATED: runs commands as the server's user on the host"

    def launch(self, dirs: SandboxDirs, spec: SandboxSpec) -> Launch:
        if spec.image:
            raise BackendError("the local backend runs on the host and takes no image", 400)
        env = {**self.session_env(dirs, spec), "TMPDIR": str(dirs.tmp)}
        return Launch(argv=list(SHELL_ARGV), env=env, ulimits=ulimit_args(spec.limits), cwd=str(dirs.workspace))

    def visible_paths(self, dirs: SandboxDirs, spec: SandboxSpec) -> dict[str, Path]:
        return {str(dirs.workspace): dirs.workspace, str(dirs.tmp): dirs.tmp}

    def workdir(self, dirs: SandboxDirs, spec: SandboxSpec) -> str:
        return str(dirs.workspace)
