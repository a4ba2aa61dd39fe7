"""bubblewrap: rootless sandboxes from user namespaces, the embedded default where Apptainer is absent.

Each session (and each one-shot run) is one `bwrap` process holding fresh user, pid, ipc, uts, cgroup and
(unless asked) network namespaces. The root is bwrap's own tmpfs, remounted read-only, with the host's (or an
image directory's) top-level directories bound read-only into it; only the workspace and /tmp are writable, and
they are the sandbox's own host directories, shared by its sessions. Home directories, /root, /run and the
server's state dir are not visible. `--die-with-parent` takes the sandbox down if the server dies; killing the
namespace's init takes down every process in it, `setsid` daemons included, so a session's processes end with
the session. `--disable-userns` keeps the sandbox from making nested user namespaces (in which it would hold
capabilities over its own mounts). bwrap runs unprivileged: under a root server, `setpriv` has already made
it the sandbox's own uid (base.drop_privileges), so its sandbox holds no capability and maps no host root.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from ..models import SandboxSpec
from ..session import Launch
from .base import LAUNCHER_ENV, SHELL_ARGV, Backend, BackendError, SandboxDirs, drop_privileges, ulimit_args

# Top-level host entries never bound into a sandbox: per-user data, runtime sockets, mounts, and the
# kernel filesystems that bwrap provides fresh.
HIDDEN = frozenset({"proc", "dev", "sys", "tmp", "home", "root", "run", "mnt", "media", "lost+found", "boot"})
# In an image only what bwrap provides itself: the image's /root or /home (a conda set-up, say) is its own.
IMAGE_HIDDEN = frozenset({"proc", "dev", "sys", "tmp"})
# Where a SIF image (and an OCI image unpacked by Apptainer) keeps the scripts that set its environment.
ENV_SCRIPTS = "/.singularity.d/env"


class BwrapBackend(Backend):
    name = "bwrap"
    isolated = True
    forwards = True

    def __init__(self, state_dir: Path, binary: str = "bwrap") -> None:
        self.state_dir = state_dir.resolve()
        self.binary = binary

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        path = shutil.which("bwrap")
        if path is None:
            return False, "bubblewrap is not installed (apt-get install bubblewrap)"
        return True, path

    async def create(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        """Refuse what bwrap would fail on with a message for the client: an image that is not a directory, and
        a workdir it would have to create inside a directory it binds read-only from the root."""
        root = dirs.image_root or Path("/")
        if not root.is_dir():
            raise BackendError(
                f"image {spec.image!r} is not a directory: the bwrap backend takes a root filesystem directory", 400
            )
        if not _workdir_mountable(root, spec.workdir):
            top = "/" + spec.workdir.split("/")[1]
            raise BackendError(
                f"workdir {spec.workdir!r} does not exist inside {top}, which the sandbox sees read-only from "
                f"{'its image' if dirs.image_root else 'the host'}; choose one of its own, e.g. /workspace "
                f"(or {top} itself, which the workspace then replaces)",
                400,
            )

    def launch(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> Launch:
        scripts = dirs.image_root is not None and (dirs.image_root / ENV_SCRIPTS.lstrip("/")).is_dir()
        return Launch(
            argv=self.argv(dirs, spec, command),
            env=dict(LAUNCHER_ENV),
            sandbox_env=self.sandbox_env(dirs, spec),
            env_scripts=ENV_SCRIPTS if scripts else None,
            ulimits=ulimit_args(spec.limits),
            pid_namespace=True,
        )

    def argv(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> list[str]:
        root = dirs.image_root or Path("/")  # the manager unpacked the image into a directory (images.py)
        argv = [*drop_privileges(dirs.uid), self.binary, "--unshare-user", "--disable-userns"]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--die-with-parent", "--hostname", "sandbox"]
        if spec.network == "none":
            argv.append("--unshare-net")
        argv += self._root_binds(root)
        argv += ["--proc", "/proc", "--dev", "/dev"]
        if root == Path("/"):
            argv += ["--ro-bind", "/sys", "/sys"]
            argv += self._hide_state_dir()
        argv += ["--bind", str(dirs.tmp), "/tmp", "--bind", str(dirs.workspace), spec.workdir]
        argv += ["--remount-ro", "/", "--chdir", spec.workdir, "--", *command]
        return argv

    @staticmethod
    def _root_binds(root: Path) -> list[str]:
        argv: list[str] = []
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.name in _hidden(root):
                continue
            target = "/" + entry.name
            if entry.is_symlink():  # merged-/usr layouts: /bin -> usr/bin
                argv += ["--symlink", os.readlink(entry.path), target]
            elif entry.is_dir():
                argv += ["--ro-bind", entry.path, target]
        return argv

    def _hide_state_dir(self) -> list[str]:
        """Cover the server's state dir (other sandboxes' workspaces) where the host root exposes it."""
        top = self.state_dir.parts[1] if len(self.state_dir.parts) > 1 else ""
        if top in HIDDEN:
            return []
        return ["--tmpfs", str(self.state_dir)]


def _workdir_mountable(root: Path, workdir: str) -> bool:
    """Whether bwrap can mount the workspace at `workdir`: it makes missing directories on its own writable
    root, but not inside a top-level directory it binds read-only from `root` (there the whole path must exist
    already, as directories, no link on the way) nor through a top-level link it recreates."""
    names = workdir.strip("/").split("/")
    if len(names) == 1 or names[0] in _hidden(root) or not os.path.lexists(root / names[0]):
        return True
    path = root
    for name in names:
        path = path / name
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
    return True


def _hidden(root: Path) -> frozenset[str]:
    return HIDDEN if root == Path("/") else IMAGE_HIDDEN
