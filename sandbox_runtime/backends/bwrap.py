"""bubblewrap: rootless sandboxes from user namespaces, the embedded default where Apptainer is absent.

Each session (and each one-shot run) is one `bwrap` process holding fresh user, pid, ipc, uts, cgroup and
(unless asked) network namespaces. The root is bwrap's own tmpfs, remounted read-only. With an image, the image
directory's top-level directories are bound read-only into it. Without one, only what a shell needs of the host
(host_view.py): /usr and its merged-/usr links, a minimal /etc made for sandboxes, and the host paths the operator
named (`--host-path`), read-only; not /srv, /var, /opt, /home, /root, /run, /sys, nor the server's state dir. Only
the workspace and /tmp are writable, and they are the sandbox's own host directories, shared by its sessions.
`--die-with-parent` takes the sandbox down if the server dies; killing the namespace's init takes down every
process in it, `setsid` daemons included, so a session's processes end with the session. `--disable-userns` keeps
the sandbox from making nested user namespaces (in which it would hold capabilities over its own mounts). bwrap
runs unprivileged: under a root server, `setpriv` has already made it the sandbox's own uid
(base.drop_privileges), so its sandbox holds no capability and maps no host root.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from .. import host_view
from ..models import SandboxSpec
from ..session import Launch
from .base import LAUNCHER_ENV, SHELL_ARGV, Backend, BackendError, SandboxDirs, drop_privileges, ulimit_args

# In an image only what bwrap provides itself: the image's /root or /home (a conda set-up, say) is its own.
IMAGE_HIDDEN = frozenset({"proc", "dev", "sys", "tmp"})
# Where a SIF image (and an OCI image unpacked by Apptainer) keeps the scripts that set its environment.
ENV_SCRIPTS = "/.singularity.d/env"


class BwrapBackend(Backend):
    name = "bwrap"
    isolated = True
    forwards = True

    def __init__(self, state_dir: Path, binary: str = "bwrap", host_paths: Sequence[Path] = ()) -> None:
        self.state_dir = state_dir.resolve()
        self.binary = binary
        # Parents before children, so that a child's bind lands inside its parent's, not under it.
        self.host_paths = sorted(host_paths, key=str)
        self.etc_dir = self.state_dir / "host-etc"  # host_view.build_etc, at the first image-less sandbox
        self._etc_built: asyncio.Future[None] | None = None
        self._usr = host_view.usr_args()

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        path = shutil.which("bwrap")
        if path is None:
            return False, "bubblewrap is not installed (apt-get install bubblewrap)"
        return True, path

    async def create(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        """Refuse what bwrap would fail on with a message for the client: an image that is not a directory, and
        a workdir it would have to create inside a directory it binds read-only. Without an image, make the
        sandboxes' /etc (once per server) and this sandbox's passwd and group."""
        if dirs.image_root is not None and not dirs.image_root.is_dir():
            raise BackendError(
                f"image {spec.image!r} is not a directory: the bwrap backend takes a root filesystem directory", 400
            )
        binds, links = self.read_only(dirs)
        blocked = unmountable_in(binds, links, spec.workdir)
        if blocked is not None:
            raise BackendError(
                f"workdir {spec.workdir!r} does not exist inside {blocked}, which the sandbox sees read-only from "
                f"{'its image' if dirs.image_root else 'the host'}; choose one of its own, e.g. /workspace "
                f"(or {blocked} itself, which the workspace then replaces)",
                400,
            )
        if dirs.image_root is None:
            await self._build_etc()
            self._write_identity(dirs, spec)

    def prepare(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        """What `create` makes for a sandbox without an image, at once and without checks: for code that runs
        `argv` itself (the benchmarks' baselines). The shared /etc is built only where there is none yet."""
        if dirs.image_root is None:
            if not self.etc_dir.is_dir():
                host_view.build_etc(self.etc_dir)
            self._write_identity(dirs, spec)

    @staticmethod
    def _write_identity(dirs: SandboxDirs, spec: SandboxSpec) -> None:
        uid, gid = (os.getuid(), os.getgid()) if dirs.uid is None else (dirs.uid, dirs.uid)
        host_view.write_identity(dirs.root, uid, gid, spec.workdir)

    async def _build_etc(self) -> None:
        """The shared /etc, made once per server however many creations wait for it; a failure is retried by the
        next creation."""
        if self._etc_built is None:
            self._etc_built = asyncio.ensure_future(asyncio.to_thread(host_view.build_etc, self.etc_dir))
        try:
            await asyncio.shield(self._etc_built)
        except OSError as exc:
            self._etc_built = None
            raise BackendError(f"the sandboxes' /etc could not be made in {self.etc_dir}: {exc}", 500) from None

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
        argv = [*drop_privileges(dirs.uid), self.binary, "--unshare-user", "--disable-userns"]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--die-with-parent", "--hostname", "sandbox"]
        if spec.network == "none":
            argv.append("--unshare-net")
        if dirs.image_root is not None:  # the manager unpacked the image into a directory (images.py)
            argv += self._image_binds(dirs.image_root)
        else:
            argv += self._host_binds(dirs, spec)
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--bind", str(dirs.tmp), "/tmp", "--bind", str(dirs.workspace), spec.workdir]
        argv += ["--remount-ro", "/", "--chdir", spec.workdir, "--", *command]
        return argv

    def _host_binds(self, dirs: SandboxDirs, spec: SandboxSpec) -> list[str]:
        """What a sandbox without an image sees of the host (host_view.py), all read-only."""
        argv = [*self._usr, "--ro-bind", str(self.etc_dir), "/etc"]
        argv += [
            "--ro-bind",
            str(dirs.root / "passwd"),
            "/etc/passwd",
            "--ro-bind",
            str(dirs.root / "group"),
            "/etc/group",
        ]
        if spec.network != "none":  # its empty stand-in otherwise; -try: a host may have none
            argv += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        for path in self.host_paths:
            argv += ["--ro-bind", str(path), str(path)]
        return argv

    @staticmethod
    def _image_binds(root: Path) -> list[str]:
        argv: list[str] = []
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.name in IMAGE_HIDDEN:
                continue
            target = "/" + entry.name
            if entry.is_symlink():  # merged-/usr layouts: /bin -> usr/bin
                argv += ["--symlink", os.readlink(entry.path), target]
            elif entry.is_dir():
                argv += ["--ro-bind", entry.path, target]
        return argv

    def read_only(self, dirs: SandboxDirs) -> tuple[dict[str, Path], set[str]]:
        """The sandbox's read-only binds (its path -> the host directory) and the links bwrap makes at its root."""
        binds: dict[str, Path] = {}
        links: set[str] = set()
        if dirs.image_root is not None:
            entries = [(e.name, Path(e.path)) for e in os.scandir(dirs.image_root) if e.name not in IMAGE_HIDDEN]
        else:
            entries = [(name, Path("/", name)) for name in ("usr", *host_view.MERGED_USR)]
            binds["/etc"] = self.etc_dir
            binds.update({str(path): path for path in self.host_paths})
        for name, path in entries:
            if path.is_symlink():
                links.add("/" + name)
            elif path.is_dir():
                binds["/" + name] = path
        return binds, links


def unmountable_in(binds: dict[str, Path], links: set[str], workdir: str) -> str | None:
    """Where bwrap could not mount the workspace at `workdir`, or None: it makes missing directories on its own
    writable root, but not inside a directory it binds read-only (there the whole path must exist already, as
    directories, no link on the way) nor through a link it makes."""
    for link in links:
        if workdir.startswith(link + "/"):
            return link
    for target, source in binds.items():
        if not workdir.startswith(target + "/"):
            continue
        path = source
        for name in workdir[len(target) + 1 :].split("/"):
            path = path / name
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    return target
            except OSError:
                return target
    return None
