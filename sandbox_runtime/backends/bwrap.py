"""bubblewrap: rootless sandboxes from user namespaces, the embedded default where Apptainer is absent.

Each session (and each one-shot run) is one `bwrap` process holding fresh user, pid, ipc, uts, cgroup and
(unless asked) network namespaces. The root is bwrap's own tmpfs, remounted read-only. With an image, the image
directory's top-level directories are bound read-only into it. Without one, only what a shell needs of the host
(host_view.py): /usr and its merged-/usr links, a minimal /etc made for sandboxes, and the host paths the operator
named (`--host-path`), read-only; not /srv, /var, /opt, /home, /root, /run, /sys, nor the server's state dir. Only
the workspace and /tmp are writable, and they are the sandbox's own host directories, shared by its sessions;
besides them only /dev/shm, a tmpfs of at most 64 MiB (`shm_bytes`): /dev itself is read-only.
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
from ..host_view import ReadOnly
from ..models import SandboxSpec
from ..session import Launch
from .base import LAUNCHER_ENV, SHELL_ARGV, Backend, BackendError, SandboxDirs, drop_privileges, ulimit_args

# In an image only what bwrap provides itself: the image's /root or /home (a conda set-up, say) is its own.
IMAGE_HIDDEN = frozenset({"proc", "dev", "sys", "tmp"})
# Where a SIF image (and an OCI image unpacked by Apptainer) keeps the scripts that set its environment.
ENV_SCRIPTS = "/.singularity.d/env"
SHM_BYTES = 64 << 20  # a sandbox's /dev/shm at most (shm_bytes)


class BwrapBackend(Backend):
    name = "bwrap"
    isolated = True
    forwards = True

    def __init__(self, state_dir: Path, binary: str = "bwrap", host_paths: Sequence[Path] = ()) -> None:
        self.state_dir = state_dir.resolve()
        self.binary = binary
        # Parents before children, so that a child's bind lands inside its parent's, not under it. Each is bound
        # from where it resolves now (start-up checked both, host_view.check_host_path): a link changed later
        # cannot redirect it.
        self.host_paths = [(path, Path(os.path.realpath(path))) for path in sorted(host_paths, key=str)]
        self.etc_dir = self.state_dir / "host-etc"  # host_view.build_etc, at the first image-less sandbox
        self._etc_built: asyncio.Future[None] | None = None
        self._etc_fresh = False  # made afresh by this backend (create or prepare), once
        self._usr = host_view.usr_view()

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
        blocked = unmountable_in(self.read_only(dirs), spec.workdir)
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
        `argv` itself (the benchmarks' baselines). The shared /etc is made afresh once per backend, as by
        `create`."""
        if dirs.image_root is None:
            if not self._etc_fresh:
                host_view.build_etc(self.etc_dir)
                self._etc_fresh = True
            self._write_identity(dirs, spec)

    @staticmethod
    def _write_identity(dirs: SandboxDirs, spec: SandboxSpec) -> None:
        uid, gid = (os.getuid(), os.getgid()) if dirs.uid is None else (dirs.uid, dirs.uid)
        host_view.write_identity(dirs.root, uid, gid, spec.workdir)

    async def _build_etc(self) -> None:
        """The shared /etc, made once per server however many creations wait for it; a failure is retried by the
        next creation."""
        if self._etc_fresh:
            return
        if self._etc_built is None:
            self._etc_built = asyncio.ensure_future(asyncio.to_thread(host_view.build_etc, self.etc_dir))
        try:
            await asyncio.shield(self._etc_built)
        except OSError as exc:
            self._etc_built = None
            raise BackendError(f"the sandboxes' /etc could not be made in {self.etc_dir}: {exc}", 500) from None
        self._etc_fresh = True

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
        for entry in self.read_only(dirs):
            argv += entry.args()
        if dirs.image_root is None and spec.network != "none":  # its empty stand-in otherwise; a host may have none
            argv += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(shm_bytes(spec)), "--tmpfs", "/dev/shm"]
        argv += ["--bind", str(dirs.tmp), "/tmp", "--bind", str(dirs.workspace), spec.workdir]
        # Non-recursive, each: /dev/shm, /dev/pts and the device nodes bwrap bound stay as they are.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", spec.workdir, "--", *command]
        return argv

    def read_only(self, dirs: SandboxDirs) -> list[ReadOnly]:
        """Everything the sandbox sees read-only, in bwrap's order: the image's top-level entries (an image) or
        what it sees of the host (host_view.py). `argv` binds these and `create` checks the workdir against them."""
        if dirs.image_root is not None:  # the manager unpacked the image into a directory (images.py)
            names = sorted(name for name in os.listdir(dirs.image_root) if name not in IMAGE_HIDDEN)
            return list(host_view.top_level(dirs.image_root, names))
        return [
            *self._usr,
            ReadOnly("/etc", str(self.etc_dir)),
            ReadOnly("/etc/passwd", str(dirs.root / "passwd")),
            ReadOnly("/etc/group", str(dirs.root / "group")),
            *(ReadOnly(str(path), str(real)) for path, real in self.host_paths),
        ]


def shm_bytes(spec: SandboxSpec) -> int:
    """The size of the sandbox's /dev/shm: SHM_BYTES, or its memory limit where that is smaller. A tmpfs of its
    own, since bwrap's /dev is a tmpfs of half the host's memory that the sandbox could fill (and /dev itself is
    remounted read-only). Its pages are memory, not disk: a memory cgroup counts them, the watchdog does not, so
    the bound is small (Docker's default --shm-size), enough for POSIX shared memory and semaphores."""
    memory_mb = spec.limits.memory_mb
    return SHM_BYTES if memory_mb is None else min(SHM_BYTES, memory_mb << 20)


def unmountable_in(read_only: list[ReadOnly], workdir: str) -> str | None:
    """Where bwrap could not mount the workspace at `workdir`, or None: it makes missing directories on its own
    writable root, but not inside a directory it binds read-only (there the whole path must exist already, as
    directories, no link on the way) nor through a link it makes. What holds the workdir is the deepest entry
    above it (a host path bound inside another is what the sandbox sees there)."""
    above = [entry for entry in read_only if workdir.startswith(entry.target + "/")]
    if not above:
        return None
    entry = max(reversed(above), key=lambda e: len(e.target))  # of equal depths the last, bound on top
    if entry.link:
        return entry.target
    path = Path(entry.source)
    for name in workdir[len(entry.target) + 1 :].split("/"):
        path = path / name
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return entry.target
        except OSError:
            return entry.target
    return None
