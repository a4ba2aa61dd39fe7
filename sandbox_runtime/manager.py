"""The sandbox manager: creates, finds and deletes sandboxes, reaps expired ones, and recovers from a crash.

State on disk, under `state_dir`: a lock file (one server per state dir) and one folder per sandbox with
its workspace, its /tmp and `record.json` (pids with start times, the sandbox's uid). A server that was
SIGKILLed leaves those folders behind; the next server on the same state dir kills what the records name (a
pid only if it still has its recorded start time; every process of a recorded sandbox uid) and removes them.

The manager is also where the server's policy is enforced, whoever the client is: the `local` backend only
where the operator allowed it, images only by name from the server's image directories, every limit below its
maximum, and, under a root server, one unprivileged host uid per live sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import secrets
import shutil
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from server_kit.cli import StartupError
from server_kit.errors import ApiError

from . import cgroups, memory_watch, procs, workspace_fs
from .backends import make_backend
from .backends.base import Backend, BackendError, SandboxDirs
from .config import ServerConfig
from .host_tree import remove_tree
from .images import ImageError, ImageStore, Unpacked
from .metrics import Metrics
from .models import LimitEnforcement, Limits, SandboxSpec
from .sandbox import Sandbox, own_dirs, state_disk
from .session import SessionError

log = logging.getLogger(__name__)


# Host-wide: which sandbox uids are held, by any server on this machine (root servers only use uids).
UID_LOCK_DIR = Path("/run/prorl-sandbox/uids")


CLEAN_UIDS_KEPT = 256  # released uids kept locked for reuse without a scan (an open file each)
FRESH_UIDS_PER_SCAN = 16  # fresh uids one scan of the host's processes clears for use


def hold_uid(uid: int) -> TextIO | None:
    """An flock held on `uid` (for as long as the file stays open), or None when another server holds it."""
    lock = open(UID_LOCK_DIR / f"{uid}.lock", "w")  # noqa: SIM115 - the caller keeps it open
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


class SandboxNotFound(ApiError):
    status = 404


class CapacityError(ApiError):
    status = 429


class ClientGone(ApiError):
    """The client of a request went away before its answer: nothing is made for it."""

    status = 499  # nginx's "client closed request": it is never sent, only logged


class PolicyError(ApiError):
    """A spec the server's policy refuses: 400, or 403 for a backend the operator did not allow."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# Which rlimit bounds each limit from above (an unprivileged sandbox cannot raise a hard limit), in our units.
_RLIMITS = {
    "memory_mb": (resource.RLIMIT_AS, 1 << 20),
    "pids": (resource.RLIMIT_NPROC, 1),
    "cpu_seconds": (resource.RLIMIT_CPU, 1),
    "file_size_mb": (resource.RLIMIT_FSIZE, 1 << 20),
    "open_files": (resource.RLIMIT_NOFILE, 1),
}


def effective_max_limits(asked: Limits) -> Limits:
    """The configured maxima, lowered to the server's own hard rlimits: bash in the sandbox could not set more."""
    values = asked.model_dump()
    for name, (which, unit) in _RLIMITS.items():
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY and values[name] is not None:
            values[name] = min(values[name], hard // unit)
    return Limits(**values)


def capped(limits: Limits, maxima: Limits) -> Limits:
    """`limits` with each value lowered to its maximum, where both are set."""
    ceiling = maxima.model_dump()
    return Limits(**{k: v if v is None or ceiling[k] is None else min(v, ceiling[k]) for k, v in limits})


def _check_image_dir(directory: Path) -> None:
    """An --image-dir the server can list, or a StartupError naming the flag."""
    try:
        with os.scandir(directory):
            pass
    except FileNotFoundError:
        raise StartupError(f"image directory {directory} does not exist: fix --image-dir") from None
    except NotADirectoryError:
        raise StartupError(f"image directory {directory} is not a directory: fix --image-dir") from None
    except OSError as exc:
        raise StartupError(
            f"cannot list the image directory {directory}: {exc.strerror}; give --image-dir one this user can read"
        ) from None


def unreachable_ancestor(path: Path) -> Path | None:
    """The first directory on the way to `path` that other users cannot traverse (no o+x), or None."""
    for directory in [*reversed(path.parents), path]:
        if directory.exists() and not directory.stat().st_mode & stat.S_IXOTH:
            return directory
    return None


class SandboxManager:
    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.state_dir = config.state_dir.resolve()
        self.boxes_dir = self.state_dir / "sandboxes"
        self._sandboxes: dict[str, Sandbox] = {}
        self._preparing = 0  # creations awaiting their image
        self._deleted: OrderedDict[str, None] = OrderedDict()  # recent ids, so DELETE stays idempotent
        self._bounding: dict[str, asyncio.Future[None]] = {}  # `_bound` under way, which `delete` waits for
        self._backends: dict[str, Backend] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._memory_watch: asyncio.Task[None] | None = None
        self._lock_file: TextIO | None = None
        self.default_backend = config.backend or self._pick_default()
        self.max_limits = effective_max_limits(config.max_limits)
        self.default_limits = capped(config.default_limits, self.max_limits)
        # Under root, each sandbox runs as a uid of its own; unprivileged, as the server's own uid.
        self.sandbox_uids = config.sandbox_uids if os.geteuid() == 0 else None
        self._free_uids: deque[int] = deque(self.sandbox_uids or ())
        # Uids this server released and still holds the lock of: nothing runs as them (the release killed every
        # process and waited), and no other server can have used them since, so they are handed out again
        # without another scan of every process on the host.
        self._clean_uids: deque[int] = deque()
        self._uid_locks: dict[int, TextIO] = {}  # uids in use and clean ones
        self._scanning = asyncio.Lock()
        self.images = ImageStore(
            config.image_dirs, self.state_dir / "images", int(config.image_cache_gb * 2**30), self._images_in_use
        )
        # What bounds a whole sandbox (memory, disk, inodes): found at start-up, tried for real.
        self.memory_cgroups: cgroups.MemoryCgroups | None = None
        self.own_disks = False
        self.enforcement = LimitEnforcement(memory="per process", disk="per file", inodes="none", detail="")

    # -- start and stop ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the state dir (StartupError when it cannot be used), clean up after a previous server, and find
        what bounds a sandbox here."""
        self._check_default_backend()
        try:
            self.boxes_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"cannot use the state dir {self.state_dir}: {exc.strerror} ({exc.filename}); give one this user can "
                "create and write with --state-dir"
            ) from None
        self._lock_state_dir()
        for directory in self.images.image_dirs:
            _check_image_dir(directory)
        try:
            self.images.start()
        except OSError as exc:
            raise StartupError(
                f"cannot use the state dir's image cache {self.images.cache_dir}: {exc.strerror} ({exc.filename}); "
                "give a state dir this user can write with --state-dir"
            ) from None
        if self.sandbox_uids is not None:
            self._check_reachable_by_sandboxes()
            UID_LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        reaped = await self.reap_leftovers()
        if reaped:
            log.warning("reaped %d sandboxes left by a previous server in %s", reaped, self.state_dir)
        await asyncio.to_thread(self._find_enforcement)
        self._reaper = asyncio.create_task(self._reap_expired_forever())
        if self.memory_cgroups is None:
            self._memory_watch = asyncio.create_task(self._watch_memory_forever())

    async def stop(self) -> None:
        for task in (self._reaper, self._memory_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.gather(*(self.delete(i) for i in list(self._sandboxes)), return_exceptions=True)
        await self.images.stop()
        while self._clean_uids:  # closing releases the lock: other servers may use them
            self._uid_locks.pop(self._clean_uids.pop()).close()
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the lock

    def _find_enforcement(self) -> None:
        """Find what can bound each sandbox as a whole here, and say it (in the log and in GET /v1/info)."""
        self.memory_cgroups, memory_why = cgroups.find()
        self.own_disks, disk_why = workspace_fs.probe(self.boxes_dir)
        memory = "watchdog" if self.memory_cgroups is None else self.memory_cgroups.version
        if self.memory_cgroups is None:
            memory_why += "; a watchdog sums the resident memory of each sandbox's processes every "
            memory_why += f"{memory_watch.WATCH_INTERVAL_S:g} s and ends them all above limits.memory_mb"
        disk = "filesystem" if self.own_disks else "per file"
        if self.own_disks:
            disk_why += (
                "; each sandbox's whole limit is reserved on the state disk (--reserve-disk)"
                if self.config.reserve_disk
                else "; the images are overcommitted: were the state disk full, writes would fail in any sandbox "
                "(--reserve-disk reserves each limit)"
            )
        self.enforcement = LimitEnforcement(
            memory=memory,
            disk=disk,
            inodes="filesystem" if self.own_disks else "none",
            detail=f"memory: {memory_why}; disk and inodes: {disk_why}",
        )
        for what, held in (("memory", self.memory_cgroups is not None), ("disk", self.own_disks)):
            if not held:
                log.warning("a sandbox's %s is bounded per process or per file only: %s", what, self.enforcement.detail)

    def _check_reachable_by_sandboxes(self) -> None:
        """Sandbox uids must reach their own workspaces (bwrap binds them as that uid) and the images."""
        for directory in (self.state_dir, self.boxes_dir):
            directory.chmod(0o711)  # traversable, not listable: a sandbox cannot list the others
        checked = [(self.boxes_dir, "the state dir", "--state-dir", "e.g. --state-dir /var/lib/prorl-sandbox")]
        checked += [(d, "the image directory", "--image-dir", "or give it o+x") for d in self.images.image_dirs]
        for path, what, flag, fix in checked:
            blocked = unreachable_ancestor(path)
            if blocked is None:
                continue
            shown = self.state_dir if flag == "--state-dir" else path
            where = f"lies below {blocked}, which the sandboxes' unprivileged uids cannot traverse"
            if blocked == path:
                where = "is one the sandboxes' unprivileged uids cannot traverse"
            raise StartupError(f"{what} {shown} {where} (no o+x); give {flag} one they can reach, {fix}")

    def _check_default_backend(self) -> None:
        """A backend named with --backend that can make no sandbox here fails the start: the server would serve
        nothing but errors. (Chosen by default, it is one that is installed: `_pick_default`.)"""
        from .backends import BACKENDS
        from .backends.apptainer import NOT_INSTALLED

        name = self.default_backend
        if name == "bwrap":
            available, detail = BACKENDS["bwrap"].probe()
            if not available:
                raise StartupError(f"--backend bwrap: {detail}; or choose another --backend")
        if name not in ("apptainer", "singularity"):
            return
        binary = self.config.apptainer_binary
        if binary is not None and shutil.which(binary) is None:
            raise StartupError(
                f"--apptainer-binary {binary} is not an executable; give the path of apptainer or singularity"
            )
        if binary is None and not BACKENDS[name].probe()[0]:
            raise StartupError(
                f"--backend {name}: {NOT_INSTALLED} (on PATH; --apptainer-binary names one elsewhere); or choose "
                "another --backend"
            )
        if self.sandbox_uids is not None:
            raise StartupError(
                f"--backend {name} runs only under an unprivileged server (started by root, Apptainer would run the "
                "sandboxes as root): run prorl-sandbox as a normal user, or choose --backend bwrap"
            )

    def _lock_state_dir(self) -> None:
        path = self.state_dir / "server.lock"
        try:
            lock = open(path, "w")  # noqa: SIM115 - held for the server's lifetime
        except OSError as exc:
            raise StartupError(
                f"cannot open the state dir's lock file {path}: {exc.strerror}; give a state dir this user can "
                "write with --state-dir"
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StartupError(
                f"another sandbox server is using state dir {self.state_dir} (it holds {path}): stop that server, "
                "or give this one a state dir of its own with --state-dir"
            ) from None
        self._lock_file = lock

    # -- backends ---------------------------------------------------------------------------------------
    def _pick_default(self) -> str:
        from .backends import BACKENDS

        for name in ("bwrap", "apptainer"):
            if BACKENDS[name].probe()[0]:
                return name
        raise StartupError(
            "no isolating backend is available: install bubblewrap (apt-get install bubblewrap) or Apptainer, "
            "or ask for `--backend local` explicitly (no isolation)"
        )

    def backend(self, name: str | None) -> Backend:
        name = name or self.default_backend
        if name not in self._backends:
            self._backends[name] = make_backend(name, self.config)
        return self._backends[name]

    # -- sandboxes --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sandboxes)

    def all(self) -> list[Sandbox]:
        return list(self._sandboxes.values())

    def get(self, sandbox_id: str) -> Sandbox:
        box = self._sandboxes.get(sandbox_id)
        if box is None or box.closing:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        box.touch()
        return box

    async def create(self, spec: SandboxSpec, wanted: Callable[[], bool] = lambda: True) -> Sandbox:
        """A new sandbox, its default session started. `wanted` is asked once its image is ready (a first use
        may take minutes) and again once the sandbox is made: a client that gave up meanwhile gets no sandbox
        that nobody would ever delete."""
        # Creations still preparing their image count: a burst of first uses may not unpack past the limit.
        if len(self._sandboxes) + self._preparing >= self.config.max_sandboxes:
            raise CapacityError(f"sandbox limit reached ({self.config.max_sandboxes}); delete some first")
        name = spec.backend or self.default_backend
        if name == "local" and not self.config.allow_local:
            raise PolicyError(
                "the local backend isolates nothing and this server does not offer it "
                "(start it with --allow-local to allow it)",
                403,
            )
        backend = self.backend(name)
        if spec.forwards and not backend.forwards:
            raise PolicyError(f"the {backend.name} backend cannot forward ports; the bwrap backend can")
        spec = spec.model_copy(update={"backend": backend.name, "limits": self._limits(spec.limits)})
        if self.sandbox_uids is not None:
            await self._keep_a_clean_uid()
        self._preparing += 1
        try:
            image = await self.prepare_image(spec.image, backend, seeded=spec.seed_workdir)
        finally:
            self._preparing -= 1
        if not wanted():
            raise ClientGone("the client went away while the image was being unpacked; no sandbox was created")
        # From here to the registration below nothing awaits: the image cache evicts only images that no
        # registered sandbox runs (ImageStore._evict), and this one is registered before anything can run.
        uid = self._allocate_uid() if self.sandbox_uids is not None else None
        sandbox_id = secrets.token_hex(6)
        dirs = SandboxDirs(
            sandbox_id,
            self.boxes_dir / sandbox_id,
            uid=uid,
            image_root=image.root,
            image_file=image.file,
            image_env=image.env,
            image_digest=image.digest,
        )
        try:
            self._make_dirs(dirs)
            box = Sandbox(dirs, spec, backend, self.config.default_output_bytes)
        except BaseException:  # nothing of it may stay behind: neither its folder nor its uid
            await asyncio.to_thread(remove_tree, dirs.root)
            await self._release_uid(uid)
            raise
        self._sandboxes[sandbox_id] = box
        try:
            if self.memory_cgroups is not None and spec.limits.memory_mb is not None:
                box.cgroup = self.memory_cgroups.path(sandbox_id)  # recorded before it is made: a crash leaks none
            box.write_record()
            if self._owns_disk(box):  # no await since its registration: concurrent creations count each other
                self._admit(box)
            await self._bind_limits(box)
            await box.seed()  # after the registration: the copy awaits, and the image must stay cached meanwhile
            await backend.create(dirs, spec)
            await box.session("default")
            if not wanted():  # asked again: a seed of a large workdir may take as long as an unpack
                raise ClientGone("the client went away while the sandbox was being created; it was deleted")
            box.created = True
        except BaseException as exc:
            await self.delete(sandbox_id)
            if isinstance(exc, SessionError) and exc.status >= 500 and spec.image:  # the client's image is at fault
                raise PolicyError(f"image {spec.image!r} cannot start a shell: {exc}") from exc
            raise
        self.metrics.sandboxes_created.labels(backend.name).inc()
        return box

    @staticmethod
    def _make_dirs(dirs: SandboxDirs) -> None:
        with state_disk(f"make sandbox {dirs.id}'s directories"):
            dirs.workspace.mkdir(parents=True)
            dirs.tmp.mkdir()
        if dirs.uid is not None:  # its folder is traversable, not listable
            dirs.root.chmod(0o711)
        own_dirs(dirs)  # the sandbox's own uid owns what it may write

    def _owns_disk(self, box: Sandbox) -> bool:
        limits = box.spec.limits
        return self.own_disks and limits.disk_mb is not None and limits.inodes is not None

    def _disk_size(self, box: Sandbox) -> int:
        limits = box.spec.limits
        assert limits.disk_mb is not None and limits.inodes is not None
        return workspace_fs.full_size(limits.disk_mb << 20, limits.inodes)

    def _admit(self, box: Sandbox) -> None:
        """Refuse (507) a sandbox whose file system the state disk has no room for now, or with --reserve-disk once
        the live ones have written all they may (workspace_fs.admit). A stat per live sandbox, on the event loop:
        microseconds each, and nothing may await between this count and the creation's registration."""
        promised = sum(
            workspace_fs.unwritten(other.dirs.root / workspace_fs.IMAGE, self._disk_size(other))
            for other in self._sandboxes.values()
            if self.config.reserve_disk and other is not box and self._owns_disk(other)
        )
        workspace_fs.admit(self.boxes_dir, self._disk_size(box), promised)

    async def _bind_limits(self, box: Sandbox) -> None:
        """`_bound` in a thread, run to its end even when the creation is cancelled (a mount or cgroup made after
        the clean-up would outlive the sandbox); a concurrent `delete` waits for it before it undoes it."""
        bounding = asyncio.ensure_future(asyncio.to_thread(self._bound, box))
        self._bounding[box.id] = bounding
        try:
            await asyncio.shield(bounding)  # as sandbox.to_the_end, with the future kept where `delete` finds it
        except asyncio.CancelledError:
            await asyncio.gather(bounding, return_exceptions=True)
            raise
        finally:
            self._bounding.pop(box.id, None)
        if box.closing:  # deleted meanwhile: that delete has undone what this made
            raise SandboxNotFound(f"sandbox {box.id} was deleted while it was being created")

    def _bound(self, box: Sandbox) -> None:
        """Give the sandbox what bounds it as a whole, before anything of it runs: a file system of its own for
        the workspace and /tmp, and a memory cgroup."""
        limits, dirs = box.spec.limits, box.dirs
        if self._owns_disk(box):
            assert limits.disk_mb is not None and limits.inodes is not None
            templates = self.state_dir / "disk-templates"
            workspace_fs.make(dirs.root, dirs.workspace, dirs.tmp, limits.disk_mb << 20, limits.inodes, templates)
            own_dirs(dirs)  # the new file system's directories, which now lie over the old ones
        if self.memory_cgroups is not None and box.cgroup is not None and limits.memory_mb is not None:
            self.memory_cgroups.create(box.id, limits.memory_mb << 20)

    def _unbound(self, dirs: SandboxDirs, cgroup: Path | None) -> None:
        """Undo `_bound` once nothing of the sandbox runs: its cgroup removed, its file system unmounted (only by a
        server that mounts them: another could not, and would log each refusal)."""
        if cgroup is not None:
            cgroups.remove(cgroup)
        if self.own_disks:
            workspace_fs.unmount(dirs.workspace, dirs.tmp)

    def _limits(self, asked: Limits) -> Limits:
        """What the spec asked for, each at most the server's maximum, the rest the server's defaults."""
        values, maxima, defaults = asked.model_dump(), self.max_limits.model_dump(), self.default_limits.model_dump()
        for name, value in values.items():
            if value is not None and maxima[name] is not None and value > maxima[name]:
                raise PolicyError(f"limits.{name} {value} is above this server's maximum {maxima[name]}")
        return Limits(**{k: v if v is not None else defaults[k] for k, v in values.items()})

    def _images_in_use(self) -> set[str]:
        return {box.dirs.image_digest for box in self._sandboxes.values() if box.dirs.image_digest}

    async def prepare_image(self, name: str | None, backend: Backend, seeded: bool = False) -> Unpacked:
        """What a sandbox of image `name` runs (the host's root when None), unpacked into the cache if it must
        be; an unknown or unusable image is the client's error (400), a failed unpack the server's. A `seeded`
        sandbox (`seed_workdir`) copies from the unpacked root, so a backend that runs SIF files itself
        (Apptainer) is given the unpacked root too."""
        if name is None:
            return Unpacked(root=None)
        try:
            return await self.images.prepare(self.images.find(name), runs_sif=backend.runs_sif and not seeded)
        except ImageError as exc:
            if exc.status >= 500:
                raise BackendError(str(exc), exc.status) from None
            raise PolicyError(str(exc)) from None

    async def delete(self, sandbox_id: str) -> bool:
        """Delete a sandbox; returns False if it was already deleted. Every process is gone on return."""
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            if sandbox_id in self._deleted:
                return False
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        if box.closing:  # a concurrent delete is under way: wait for the same outcome
            await box.deleted.wait()
            return False
        try:
            await box.close()
        finally:
            del self._sandboxes[sandbox_id]
            self._remember_deleted(sandbox_id)
            bounding = self._bounding.get(sandbox_id)
            if bounding is not None:  # its creation is mounting or making its cgroup: undone once that is done
                await asyncio.gather(bounding, return_exceptions=True)
            await asyncio.to_thread(self._unbound, box.dirs, box.cgroup)
            await asyncio.to_thread(remove_tree, box.dirs.root)
            await self._release_uid(box.dirs.uid)
            self.metrics.sandboxes_deleted.labels(box.backend.name).inc()
            box.deleted.set()
        return True

    def _allocate_uid(self) -> int:
        """A uid of the range that no other process on this host runs as, nor any other server holds: a clean
        one (see `_keep_a_clean_uid`), else a fresh one, scanned here."""
        if self._clean_uids:
            return self._clean_uids.pop()
        uid = self._lock_free_uid()
        procs.kill_user(uid)
        return uid

    async def _keep_a_clean_uid(self) -> None:
        """Have a clean uid at hand for the next allocation, scanning fresh ones off the event loop, up to
        FRESH_UIDS_PER_SCAN at a time: a scan reads the status of every process on the host (milliseconds,
        tens of them with thousands of processes), and one scan clears a batch as cheaply as one uid."""
        async with self._scanning:  # concurrent creations share one scan's uids
            if self._clean_uids:
                return
            fresh = [self._lock_free_uid()]  # CapacityError when there is none
            with contextlib.suppress(CapacityError):
                while len(fresh) < FRESH_UIDS_PER_SCAN:
                    fresh.append(self._lock_free_uid())
            # Shielded: a cancelled creation leaves the scan running in its thread, and the uids are clean once it
            # ends; were their locks let go of before, another server's sandbox could start as one under the kill.
            await asyncio.shield(self._clear_fresh_uids(fresh))

    async def _clear_fresh_uids(self, fresh: list[int]) -> None:
        try:
            await asyncio.to_thread(procs.kill_users, set(fresh))
        except BaseException:
            for uid in fresh:
                self._uid_locks.pop(uid).close()
                self._free_uids.append(uid)
            raise
        self._clean_uids.extend(fresh)

    def _lock_free_uid(self) -> int:
        """A uid of the free ones whose lock this server now holds.

        Each uid in use is held by an flock on a file in UID_LOCK_DIR, so servers with overlapping ranges never
        share one (sharing would let one server's delete kill the other's sandboxes). A lock that is free
        means no live server owns the uid: whatever still runs as it was left by a crash, and the caller kills it.
        """
        for _ in range(len(self._free_uids)):
            uid = self._free_uids.popleft()
            lock = hold_uid(uid)
            if lock is None:  # another server's sandbox runs as it
                self._free_uids.append(uid)
                continue
            self._uid_locks[uid] = lock
            return uid
        raise CapacityError("every sandbox uid is in use on this host; delete some sandboxes first")

    async def _release_uid(self, uid: int | None) -> None:
        """Hand a uid back only once no process runs as it (a straggler would join the next sandbox): clean,
        with its lock kept, up to CLEAN_UIDS_KEPT of them; the rest go back to the free ones. Shielded: a
        release cancelled half-way would lose the uid (its lock held, in no list)."""
        if uid is not None:
            await asyncio.shield(self._hand_back_uid(uid))

    async def _hand_back_uid(self, uid: int) -> None:
        await asyncio.to_thread(procs.kill_user, uid)
        self._clean_uids.append(uid)
        while len(self._clean_uids) > CLEAN_UIDS_KEPT:
            oldest = self._clean_uids.popleft()
            self._uid_locks.pop(oldest).close()
            self._free_uids.append(oldest)

    def _remember_deleted(self, sandbox_id: str) -> None:
        self._deleted[sandbox_id] = None
        while len(self._deleted) > 100_000:
            self._deleted.popitem(last=False)

    # -- the memory watchdog, where no cgroup bounds a sandbox (memory_watch.py) -------------------------------
    async def _watch_memory_forever(self) -> None:
        while True:
            await asyncio.sleep(memory_watch.WATCH_INTERVAL_S)
            limits = {
                box.id: box.spec.limits.memory_mb << 20
                for box in self._sandboxes.values()
                if box.spec.limits.memory_mb is not None and box.started
            }
            if not limits:
                continue
            found = await asyncio.to_thread(memory_watch.over_limit, os.getpid(), self.boxes_dir, limits)
            for sandbox_id, (held, pids) in found.items():
                log.warning(
                    "sandbox %s: its processes held %d bytes, over limits.memory_mb (%d bytes): ending them",
                    sandbox_id,
                    held,
                    limits[sandbox_id],
                )
                await asyncio.to_thread(memory_watch.kill, pids)

    # -- reaping ----------------------------------------------------------------------------------------
    async def _reap_expired_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            await self.reap_expired()

    async def reap_expired(self) -> int:
        now_wall, now_mono = time.time(), time.monotonic()
        expired = [(b.id, why) for b in self.all() if not b.closing and (why := b.expired(now_wall, now_mono))]
        for sandbox_id, why in expired:
            log.info("reaping sandbox %s (%s)", sandbox_id, why)
            self.metrics.sandboxes_reaped.labels(why).inc()
        await asyncio.gather(*(self.delete(i) for i, _ in expired), return_exceptions=True)
        return len(expired)

    async def reap_leftovers(self) -> int:
        """Kill what a crashed server left: only processes whose pid *and* start time match the record."""
        reaped = 0
        for root in sorted(p for p in self.boxes_dir.iterdir() if p.is_dir()):
            record = Sandbox.read_record(root) or {}
            for pid, started in record.get("sessions", {}).values():
                if procs.is_same_process(pid, started):
                    procs.kill_session(pid)
            uid = record.get("uid")
            if isinstance(uid, int) and self.sandbox_uids is not None and uid in self.sandbox_uids:
                lock = hold_uid(uid)  # another server may own it since the crash: then it is not ours to kill
                if lock is not None:
                    procs.kill_user(uid)  # setsid daemons, one-shot runs: everything that ran as the sandbox
                    lock.close()
            else:
                uid = None
            if record.get("backend"):
                with contextlib.suppress(BackendError, RuntimeError, ValueError):
                    spec = SandboxSpec.model_validate(record["spec"])
                    await self.backend(record["backend"]).destroy(SandboxDirs(root.name, root, uid=uid), spec)
            cgroup = record.get("cgroup")
            if isinstance(cgroup, str) and Path(cgroup).name == cgroups.PREFIX + root.name:
                await asyncio.to_thread(cgroups.remove, Path(cgroup))
            await asyncio.to_thread(workspace_fs.unmount_below, root)
            await asyncio.to_thread(remove_tree, root)
            reaped += 1
        return reaped
