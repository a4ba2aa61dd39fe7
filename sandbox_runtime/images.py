"""Images by name: what a spec's `image` names under the server's image directories, unpacked once into a
content-addressed cache. What each kind of image is and how it is read: image_formats.py.

The cache is `<state dir>/images/<sha256>/root`, keyed by the digest of the SIF file or tarball (a docker archive
with the tag chosen in it) or by the OCI manifest's own digest: the same image under two names is unpacked once,
and a changed file is a new image. A file's digest is remembered by its device, inode, size, mtime and ctime (ctime
cannot be set back by the file's owner), also across restarts; a file that changes while it is unpacked is
refused. An unpack runs as a task of its own, shielded from the request that started it: a client that gives up
leaves it to finish for the next one, and concurrent first uses all wait for the one unpack. An entry is complete
once its directory is renamed into place, so a crash mid-unpack leaves only a temporary directory, removed at the
next start.

What is unpacked is made safe to leave on the host: under a root server everything is owned by root, and
nothing is setuid, setgid, group- or world-writable, or a device node, a FIFO or a socket. The sandboxes see the
root read-only (bwrap mounts it nosuid and nodev anyway); other users of the host may traverse to it (sandbox uids
must), and find nothing they could run as anyone else or change.

Why umoci and unsquashfs rather than Python's tarfile: a layer may hold a link at a path that a later layer writes
through (`etc -> /`, then `etc/passwd`), device nodes and whiteouts; umoci resolves every path inside the root
(securejoin) and applies whiteouts as the image spec says, and both tools are Debian's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .image_formats import (
    ImageError,
    UnpackBudget,
    archive_tags,
    check_layers,
    choose_tag,
    detect_format,
    docker_archive_to_layout,
    entry_bytes,
    file_sha256,
    oci_config,
    oci_manifest,
    oci_tags,
    sif_root_partition,
    single_tag_layout,
    spend_layers,
)
from .models import IMAGE_NAME, ImageCacheState, ImageFormat, ImageInfo, ImageList

log = logging.getLogger(__name__)

UNPACK_TIMEOUT_S = 1800.0  # a multi-GB SWE-bench image on a slow shared file system
MAX_UNPACKS = 2  # at once: each one is disk- and CPU-bound, and the sandboxes share both
# What an unpack leaves free on the state disk at least, which the sandboxes' workspaces share: this much, or
# this share of a smaller disk.
FREE_FLOOR_BYTES = 1 << 30
FREE_FLOOR_SHARE = 0.05
MAX_LISTED = 10_000  # GET /v1/images stops walking after this many images
MAX_DEPTH = 4  # how deep below an image directory the listing looks for images
DIGESTS = "digests.json"
UNPACK_TAG = "prorl"  # the one tag of the layout handed to umoci
_UNSAFE_MODE_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH

__all__ = ["Image", "ImageError", "ImageStore", "Unpacked", "detect_format", "sif_root_partition", "tree_bytes"]


@dataclass(frozen=True)
class Image:
    """An image as found: the name a spec gave, where it is, what it is, and the tag asked for (OCI only)."""

    name: str
    path: Path
    format: ImageFormat
    tag: str | None = None


@dataclass(frozen=True)
class Unpacked:
    """What a sandbox runs: the root directory (or, for a backend that runs SIF itself, the SIF file), the
    image's own environment (an OCI config's `Env`), and the digest it is known by (None: a root directory)."""

    root: Path | None
    file: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    digest: str | None = None


def file_key(path: Path) -> str:
    """What identifies a file's content without reading it: its owner can set mtime back, not ctime."""
    info = path.stat()
    return f"{path} {info.st_dev} {info.st_ino} {info.st_size} {info.st_mtime_ns} {info.st_ctime_ns}"


def tree_bytes(root: Path) -> int:
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def squashfs_entry_bytes(line: bytes) -> int:
    """What one line of `unsquashfs -lln` (mode, uid/gid, size, date, time, path) takes unpacked; a device node's
    line has `major, minor` where the size is, and takes an inode only."""
    fields = line.split(None, 3)
    size = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() and fields[0][:1] == b"-" else 0
    return entry_bytes(size)


def free_bytes(path: Path) -> int:
    """What an unprivileged writer may still put on the file system of `path`."""
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


_NO_SPACE = ("no space left on device", "disk quota exceeded")


def _out_of_space(exc: BaseException) -> bool:
    """Whether an unpack failed for want of room: an OSError of ours, or the tools' own words for it."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, ImageError) and any(words in str(exc).lower() for words in _NO_SPACE)


def make_safe(root: Path, as_root: bool) -> None:
    """Leave nothing under `root` that another host user could run with privileges or change: no device nodes,
    FIFOs or sockets, no setuid/setgid or group/world write bits, and (unpacked by root) everything root's."""
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) or stat.S_ISFIFO(info.st_mode):
                os.unlink(path)
                continue
            if stat.S_ISSOCK(info.st_mode):
                os.unlink(path)
                continue
            if as_root and (info.st_uid or info.st_gid):
                os.lchown(path, 0, 0)
            if not stat.S_ISLNK(info.st_mode) and info.st_mode & _UNSAFE_MODE_BITS:
                os.chmod(path, stat.S_IMODE(info.st_mode) & ~_UNSAFE_MODE_BITS)
    os.chmod(root, 0o755)


async def _run(argv: list[str], what: str, cwd: Path | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=cwd,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), UNPACK_TIMEOUT_S)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if isinstance(exc, TimeoutError):
            raise ImageError(f"unpacking {what} took over {UNPACK_TIMEOUT_S:g} s", 500) from None
        raise
    return proc.returncode or 0, output.decode("utf-8", errors="replace")[-2000:]


def free_floor(info: os.statvfs_result) -> int:
    """What is kept free on the state disk (`info`, its statvfs): unpacks stop short of it, and a sandbox whose
    file system could reach into it is not created (workspace_fs.admit)."""
    return min(FREE_FLOOR_BYTES, int(info.f_blocks * info.f_frsize * FREE_FLOOR_SHARE))


class ImageStore:
    """Finds images under the image directories and unpacks them into a content-addressed cache."""

    def __init__(
        self,
        image_dirs: list[Path],
        cache_dir: Path,
        max_bytes: int | None = None,
        in_use: Callable[[], set[str]] = set,
    ) -> None:
        self.image_dirs = [d.resolve() for d in image_dirs]
        self.cache_dir = cache_dir
        self.max_bytes = max_bytes
        self._in_use = in_use  # digests that live sandboxes run: never evicted
        self._unpacks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(MAX_UNPACKS)
        self._digests: dict[str, str] = {}  # file_key -> sha256 of the file; persisted in DIGESTS
        self._tags: dict[str, list[str]] = {}  # file_key -> a docker archive's tags

    def start(self) -> None:
        """Create the cache and remove what a crash cut short (temporary directories only)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.chmod(0o711)  # sandbox uids traverse to their image's root; nobody lists the cache
        for entry in self.cache_dir.iterdir():
            if entry.name.startswith((".unpack-", ".evict-")):
                shutil.rmtree(entry, ignore_errors=True)
        with contextlib.suppress(OSError, ValueError):
            memo = json.loads((self.cache_dir / DIGESTS).read_text())
            self._digests = {k: v for k, v in memo.items() if isinstance(k, str) and isinstance(v, str)}

    # -- names ----------------------------------------------------------------------------------------------
    def find(self, name: str) -> Image:
        """The image `name` (validated by the spec: relative, no '..', an optional ':TAG') names."""
        base, _, tag = name.partition(":")
        for directory in self.image_dirs:
            candidate = (directory / base).resolve()
            if not candidate.is_relative_to(directory) or candidate == directory or not candidate.exists():
                continue  # a link out of the image directory is as good as absent
            kind = detect_format(candidate)
            if kind is None:
                raise ImageError(
                    f"image {base!r} is neither a SIF file, an OCI layout, a docker save archive nor a root "
                    "directory (one with usr, bin or etc)"
                )
            if tag and kind not in ("oci", "docker-archive"):
                raise ImageError(f"image {base!r} is a {kind}: only OCI layouts and docker archives have tags")
            return Image(name, candidate, kind, tag or None)
        if not self.image_dirs:
            raise ImageError(
                f"no image named {base!r} on this server: it has no image directories (start it with --image-dir DIR)"
            )
        raise ImageError(f"no image named {base!r} in this server's image directories (GET /v1/images lists them)")

    # -- digests --------------------------------------------------------------------------------------------
    async def digest(self, image: Image) -> str | None:
        """sha256 of what the cache is keyed by: the SIF file or tarball (with the tag chosen in an archive), or
        the OCI manifest; None for a directory (it is used in place)."""
        if image.format == "directory":
            return None
        if image.format == "oci":
            _tag, manifest = await asyncio.to_thread(oci_manifest, image.path, image.tag, image.name)
            return manifest.removeprefix("sha256:")
        key = await asyncio.to_thread(file_key, image.path)
        if key not in self._digests:
            self._digests[key] = await asyncio.to_thread(file_sha256, image.path)
            await asyncio.to_thread(self._save_digests)
        return await asyncio.to_thread(self._keyed, image, key, self._digests[key])

    def known_digest(self, image: Image) -> str | None:
        """The digest if it is known without hashing the file (for listings)."""
        with contextlib.suppress(OSError, ImageError):
            if image.format == "oci":
                return oci_manifest(image.path, image.tag, image.name)[1].removeprefix("sha256:")
            if image.format in ("sif", "docker-archive"):
                key = file_key(image.path)
                if key in self._digests:
                    return self._keyed(image, key, self._digests[key])
        return None

    def _keyed(self, image: Image, key: str, file_digest: str) -> str:
        """A docker archive may hold several images: its key names the one chosen."""
        if image.format != "docker-archive":
            return file_digest
        if key not in self._tags:
            self._tags[key] = archive_tags(image.path, image.name)
        tag = choose_tag(self._tags[key], image.tag, image.name)
        return hashlib.sha256(f"{file_digest}:{tag}".encode()).hexdigest()

    def _save_digests(self) -> None:
        temporary = self.cache_dir / (DIGESTS + ".tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(self._digests))
            temporary.chmod(0o600)  # it names the host paths of the images
            temporary.replace(self.cache_dir / DIGESTS)

    def state(self, digest: str | None) -> ImageCacheState:
        if digest is None:
            return "in place"
        if digest in self._unpacks:
            return "unpacking"
        return "unpacked" if (self.cache_dir / digest / "image.json").is_file() else "not unpacked"

    # -- unpacking ------------------------------------------------------------------------------------------
    async def prepare(self, image: Image, runs_sif: bool = False) -> Unpacked:
        """What a sandbox of `image` runs; unpacks it first if it is not in the cache yet (once, however many
        ask at the same time, and to the end even if they all give up)."""
        if image.format == "directory":
            return Unpacked(root=image.path)
        digest = await self.digest(image)
        assert digest is not None
        if image.format == "sif" and runs_sif:
            await asyncio.to_thread(sif_root_partition, image.path)  # a SIF Apptainer could not run is refused
            return Unpacked(root=None, file=image.path, digest=digest)
        entry = self.cache_dir / digest
        if not (entry / "image.json").is_file():
            task = self._unpacks.get(digest)
            if task is None:
                task = asyncio.ensure_future(self._unpack_once(image, digest))
                self._unpacks[digest] = task
                task.add_done_callback(lambda done, d=digest: self._unpack_done(d, done))
            await asyncio.shield(task)
        try:
            meta = json.loads((entry / "image.json").read_text())
            os.utime(entry / "image.json")  # its last use: eviction goes by it
        except (OSError, ValueError) as exc:  # evicted the moment it was unpacked (the cache is too small)
            raise ImageError(f"image {image.name!r} left the cache as it was unpacked ({exc})", 500) from None
        return Unpacked(root=entry / "root", env=dict(meta.get("env") or {}), digest=digest)

    def _unpack_done(self, digest: str, task: asyncio.Task[None]) -> None:
        self._unpacks.pop(digest, None)
        if not task.cancelled() and task.exception() is not None:  # retrieved: its waiters may all have gone
            log.warning("unpacking image %s failed: %s", digest[:12], task.exception())

    async def stop(self) -> None:
        """Cancel the unpacks under way (their temporary directories go with them)."""
        for task in list(self._unpacks.values()):
            task.cancel()
        await asyncio.gather(*self._unpacks.values(), return_exceptions=True)

    async def _unpack_once(self, image: Image, digest: str) -> None:
        async with self._slots:
            if not (self.cache_dir / digest / "image.json").is_file():
                await self._unpack(image, self.cache_dir / digest)
                await self._evict(keep=digest)

    async def _unpack(self, image: Image, entry: Path) -> None:
        started = time.monotonic()
        before = await asyncio.to_thread(file_key, image.path) if image.path.is_file() else None
        await asyncio.to_thread(self._check_room, image)
        budget = await asyncio.to_thread(self._budget)
        try:
            work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.cache_dir))
        except OSError as exc:  # a full disk has no room for even the directory
            if _out_of_space(exc):
                raise ImageError(
                    f"no space left in the image cache ({self.cache_dir}) to unpack {image.name}", 507
                ) from None
            raise
        try:
            root = work / "root"
            env: dict[str, str] = {}
            if image.format == "sif":
                await self._spend_sif(image, budget)
                await self._unpack_sif(image, root)
            else:
                layout, tag = image.path, image.tag
                if image.format == "docker-archive":
                    layout = await asyncio.to_thread(
                        docker_archive_to_layout, image.path, work / "archive", image.name, budget
                    )
                    tag = await asyncio.to_thread(choose_tag, oci_tags(layout, image.name), tag, image.name)
                _tag, manifest = await asyncio.to_thread(oci_manifest, layout, tag, image.name)
                env, media_types = await asyncio.to_thread(oci_config, layout, manifest, image.name)
                check_layers(media_types, image.name)
                await asyncio.to_thread(spend_layers, layout, manifest, image.name, budget)
                single = await asyncio.to_thread(single_tag_layout, layout, manifest, UNPACK_TAG, work / "layout")
                await self._unpack_oci(image, single, root)
                for leftover in ("layout", "archive"):
                    await asyncio.to_thread(shutil.rmtree, work / leftover, True)
            if before is not None and await asyncio.to_thread(file_key, image.path) != before:
                raise ImageError(f"image {image.name!r} changed while it was unpacked; try again", 409)
            await asyncio.to_thread(make_safe, root, os.geteuid() == 0)
            size = await asyncio.to_thread(tree_bytes, root)
            meta = {"source": image.name, "format": image.format, "env": env, "bytes": size}
            (work / "image.json").write_text(json.dumps(meta))
            work.chmod(0o711)
            os.rename(work, entry)
        except BaseException as exc:
            await asyncio.to_thread(shutil.rmtree, work, True)
            if _out_of_space(exc):
                raise ImageError(
                    f"no space left in the image cache ({self.cache_dir}) to unpack {image.name}: {exc}", 507
                ) from None
            raise
        log.info("unpacked image %s (%s) in %.1f s", image.name, image.format, time.monotonic() - started)

    def _check_room(self, image: Image) -> None:
        """Refuse (507) an unpack that cannot fit: the image unpacks to at least its own (compressed) bytes. One
        that passes may still run out of room midway, which `_unpack` reports as a 507 too."""
        packed = tree_bytes(image.path) if image.path.is_dir() else image.path.stat().st_size
        free = free_bytes(self.cache_dir)
        if free < packed:
            raise ImageError(
                f"no space in the image cache ({self.cache_dir}) to unpack {image.name}: it takes at least "
                f"{packed} bytes and {free} are free",
                507,
            )

    def _budget(self) -> UnpackBudget:
        """What one unpack may write: a root no larger than the cache's bound (an image larger than the whole cache
        could never stay), and in all no more than leaves the state disk its floor of free space (concurrent
        unpacks each check the disk as they start; the tools' own ENOSPC is the last resort)."""
        info = os.statvfs(self.cache_dir)
        floor = free_floor(info)
        free = info.f_bavail * info.f_frsize
        why = f"{free} bytes are free on the state disk, and unpacks leave {floor} free"
        return UnpackBudget(self.max_bytes, max(free - floor, 0), why)

    async def _spend_sif(self, image: Image, budget: UnpackBudget) -> None:
        """Spend on `budget` what the SIF's squashfs unpacks to, from unsquashfs's listing of its entries and
        sizes (nothing is written), stopping the listing as soon as it is over."""
        if shutil.which("unsquashfs") is None:
            raise ImageError("SIF images need unsquashfs on the server (apt-get install squashfs-tools)", 500)
        offset, _size = await asyncio.to_thread(sif_root_partition, image.path)
        argv = ["unsquashfs", "-lln", "-no-progress", "-offset", str(offset), str(image.path)]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            assert proc.stdout is not None
            async with asyncio.timeout(UNPACK_TIMEOUT_S):
                try:
                    async for line in proc.stdout:
                        budget.spend(squashfs_entry_bytes(line), image.name)
                except ValueError:  # a line past the stream's limit (64 KiB): no path a root could hold is that long
                    raise ImageError(
                        f"image {image.name} lists an entry over 64 KiB long (unsquashfs -lln): it cannot be unpacked",
                        400,
                    ) from None
                await proc.wait()
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _unpack_sif(self, image: Image, root: Path) -> None:
        if shutil.which("unsquashfs") is None:
            raise ImageError("SIF images need unsquashfs on the server (apt-get install squashfs-tools)", 500)
        offset, _size = await asyncio.to_thread(sif_root_partition, image.path)
        argv = ["unsquashfs", "-no-progress", "-no-xattrs", "-offset", str(offset), "-dest", str(root), str(image.path)]
        code, output = await _run(argv, image.name)
        # 2: non-fatal errors, which only an unprivileged server may accept (device nodes it cannot create)
        accepted = (0,) if os.geteuid() == 0 else (0, 2)
        if code not in accepted or not root.is_dir():
            raise ImageError(f"cannot unpack {image.name}: unsquashfs exited {code}: {output.strip()}", 500)

    async def _unpack_oci(self, image: Image, layout: Path, root: Path) -> None:
        if shutil.which("umoci") is None:
            raise ImageError("OCI images and docker archives need umoci on the server (apt-get install umoci)", 500)
        # Relative to the work directory: umoci reads `--image` as PATH:TAG, split at the first ':'.
        argv = ["umoci", "raw", "unpack", "--image", f"{layout.name}:{UNPACK_TAG}", root.name]
        if os.geteuid() != 0:
            argv.insert(3, "--rootless")
        code, output = await _run(argv, image.name, cwd=layout.parent)
        if code != 0:
            raise ImageError(f"cannot unpack {image.name}: umoci exited {code}: {output.strip()}", 500)

    async def _evict(self, keep: str) -> None:
        """Remove the least recently used entries that no sandbox runs until the cache fits its maximum.

        Victims are chosen and renamed away with no await in between: a sandbox being created from an entry is
        already counted in `in_use` by then (the manager registers it without awaiting after `prepare`
        returns), and a later `prepare` of a renamed entry unpacks it again.
        """
        if self.max_bytes is None:
            return
        entries = []
        for path in self.cache_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                if not path.name.startswith(".") and (path / "image.json").is_file():
                    size = int(json.loads((path / "image.json").read_text()).get("bytes") or 0)
                    entries.append(((path / "image.json").stat().st_mtime, path, size))
        total = sum(size for _, _, size in entries)
        protected = self._in_use() | {keep}
        doomed = []
        for _, path, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if path.name in protected:
                continue
            away = self.cache_dir / f".evict-{path.name}-{time.monotonic_ns()}"
            try:
                os.rename(path, away)
            except OSError as exc:
                log.warning("image cache: cannot remove %s: %s", path.name, exc)
                continue
            doomed.append(away)
            total -= size
        for away in doomed:
            await asyncio.to_thread(shutil.rmtree, away, True)
        if doomed:
            log.info("image cache: removed %d unused images to stay within %d bytes", len(doomed), self.max_bytes)

    # -- listing ------------------------------------------------------------------------------------------
    def image_list(self) -> ImageList:
        """Every image below the image directories (an OCI layout once per tag), with its format, digest where
        known without hashing the file, and cache state; only names a spec can give."""
        found: list[Image] = []
        for directory in self.image_dirs:
            self._walk(directory, directory, 0, found)
        return ImageList(images=[self._info(image) for image in found], truncated=len(found) >= MAX_LISTED)

    def _info(self, image: Image) -> ImageInfo:
        digest = self.known_digest(image)
        state = self.state(digest) if digest or image.format == "directory" else "not unpacked"
        size: int | None = None
        if state == "unpacked":
            with contextlib.suppress(OSError, ValueError):
                size = json.loads((self.cache_dir / str(digest) / "image.json").read_text()).get("bytes")
        elif image.format in ("sif", "docker-archive"):
            with contextlib.suppress(OSError):
                size = image.path.stat().st_size
        return ImageInfo(name=image.name, format=image.format, digest=digest, cache=state, bytes=size)

    def _walk(self, base: Path, directory: Path, depth: int, found: list[Image]) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith(".") or len(found) >= MAX_LISTED:
                continue
            path = Path(entry.path)
            resolved = path.resolve()
            if not resolved.is_relative_to(base):
                continue  # a link out of the image directory: find() would not take it either
            name = str(path.relative_to(base))
            if ":" in name:  # a spec would name it as a tag of another image
                continue
            kind = detect_format(resolved)
            if kind == "oci":
                with contextlib.suppress(ImageError):
                    tags = oci_tags(resolved, name)
                    named = [f"{name}:{t}" for t in tags] if len(tags) > 1 else [name]
                    found += [
                        Image(n, resolved, kind, n.partition(":")[2] or None) for n in named if IMAGE_NAME.fullmatch(n)
                    ]
            elif kind is not None:
                if IMAGE_NAME.fullmatch(name):
                    found.append(Image(name, resolved, kind))
            elif entry.is_dir() and depth < MAX_DEPTH:
                self._walk(base, path, depth + 1, found)
