"""A file system of its own for each sandbox's workspace and /tmp: `limits.disk_mb` and `limits.inodes` for
both together, so that a sandbox over its limit fails its own writes (ENOSPC) and no other sandbox's.

The limit has to be on the host directories, not inside bwrap: a sandbox's sessions (each its own bwrap) and the
file API (files.py) all use the same `<sandbox>/workspace` and `<sandbox>/tmp`. So a root server, before the
sandbox's first process, makes a sparse image file `<sandbox>/disk.img`, an ext4 file system in it, mounts it
(loop, nosuid, nodev) and binds its two directories over the workspace and /tmp; the image's own mount is then
detached, which leaves the two binds holding the one file system. Unmounting both (a delete, or the start-up
after a crash) frees the loop device (autoclear) and the image goes with the sandbox's folder.

Why ext4 in a sparse file rather than tmpfs (`size=`, `nr_inodes=`), measured here (root, 2 cores):
- tmpfs mounts in ~1.3 ms, but keeps every byte in memory: a 1 GiB SWE repository would be 1 GiB of RAM per
  sandbox, charged to whichever memory cgroup writes it, so a sandbox's files would count against its memory.
- ext4 cost 7-18 ms of `mkfs.ext4` and 6-12 ms of `mount -o loop` per sandbox on this busy host; made as a copy
  of an empty file system kept per size (`template`: ~2 MB of metadata, ~1 ms) and mounted with in-process ioctls
  and mount(2) (`attached_loop`), it takes ~4-6 ms. It costs disk only for what is written: the image is sparse,
  no journal (a crashed server's sandboxes are reaped, never recovered), inode tables left uninitialised and not
  zeroed in the background (`lazy_itable_init`, `noinit_itable`: a fresh sparse file reads as zeros already).
The images are sparse, so nothing reserves the state disk: each image takes space as its sandbox writes, up to its
full size. Were the sum of the live sandboxes' sizes above the disk, a full disk would fail writes in innocent
sandboxes (EIO from the loop device, not their own ENOSPC). A creation is admitted (`admit`) only where the state
disk's free space leaves room for the new image and the floor that the image cache keeps free
(images.free_floor); with --reserve-disk, also less what the live images may still take (each one's full size
less what it holds now: a stat, no walk), so that the limits never add up past the disk; else it is a 507 that
says so. Reserving is not the default: it holds as many sandboxes as their limits add up to (a disk of 70 GB free,
about 16 of the default 4 GiB), where container runtimes overcommit.

An unprivileged server cannot mount (no loop device, no FUSE for it on the hosts measured here): there the disk
limit holds per file only (`limits.file_size_mb`), and GET /v1/info says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from server_kit.errors import ApiError

from .cgroups import unescape
from .images import free_floor
from .models import MIN_INODES

log = logging.getLogger(__name__)

IMAGE = "disk.img"
INODE_BYTES = 256  # ext4's default inode size (128 would lose nanosecond times and post-2038 dates)
BLOCK_BYTES = 4096
MKFS_TIMEOUT_S = 60.0
MAX_TEMPLATES = 16
LOOP_MAJOR = 7  # linux/major.h
_MS_BIND = 4096
_MOUNT_FLAGS = 2 | 4 | 1024  # MS_NOSUID | MS_NODEV | MS_NOATIME
_MNT_DETACH = 2
# linux/loop.h: the ioctls, the autoclear flag, and `struct loop_config` (a backing fd, a block size, a
# `struct loop_info64` of 232 bytes, 64 reserved bytes) with only the fd and the flags set.
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
_LOOP_CONFIG = struct.Struct("=II52xI176x64x")  # fd, block size, loop_info64 up to lo_flags, lo_flags, the rest
_libc = ctypes.CDLL(None, use_errno=True)


class DiskError(ApiError):
    """A sandbox's file system could not be made; `status` is 507 when the state disk has no room."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def image_bytes(disk_bytes: int, inodes: int) -> int:
    """The image's size for `disk_bytes` of files: the inode tables and ext4's own metadata (bitmaps and group
    descriptors, under 2% measured here) come on top, so the sandbox can store about what its limit says."""
    size = disk_bytes + inodes * INODE_BYTES + disk_bytes // 50 + (4 << 20)
    return -(-size // (1 << 20)) << 20  # whole MiB


def inode_count(disk_bytes: int, inodes: int) -> int:
    """The inodes a file system of `disk_bytes` gets for a limit of `inodes`: ext4 holds at most one inode per
    block (4 KiB), so a small disk caps the count; never fewer than MIN_INODES, for which the image's fixed margin
    (`image_bytes`) has room."""
    return max(min(inodes, disk_bytes // BLOCK_BYTES), MIN_INODES)


def full_size(disk_bytes: int, inodes: int) -> int:
    """How much of the state disk a sandbox's image may take at most: its size, for `limits.disk_mb` (in bytes)
    and `limits.inodes`."""
    return image_bytes(disk_bytes, inode_count(disk_bytes, inodes))


def unwritten(image: Path, size: int) -> int:
    """What the image of `size` bytes (full_size) may still take of the state disk: its size less the blocks it
    holds; all of it while it is not made yet. A file deleted in the sandbox frees no block of the image (there is
    no discard), but the file system reuses those, so this is an upper bound that only shrinks."""
    try:
        held = os.stat(image).st_blocks * 512
    except FileNotFoundError:
        return size
    return max(size - held, 0)


def admit(state_dir: Path, size: int, promised: int) -> None:
    """Refuse (DiskError, 507) a new image of `size` bytes where the state disk's free space, less `promised` (what
    the live sandboxes' images may still take, `unwritten`), would leave less than `size` and the image cache's
    floor (images.free_floor). The caller counts every live image, those being made too, with no await between
    the count and the registration of the new sandbox, so that concurrent creations cannot both take the room."""
    info = os.statvfs(state_dir)
    free, floor = info.f_bavail * info.f_frsize, free_floor(info)
    if free - promised - floor < size:
        raise DiskError(
            f"no space on the server's state disk for another sandbox: its file system may take {size} bytes "
            f"(limits.disk_mb and limits.inodes), {free} bytes are free, the live sandboxes' file systems may still "
            f"take {promised} of them, and {floor} stay free for the image cache; delete sandboxes or ask for a "
            "smaller limits.disk_mb",
            507,
        )


def make(root: Path, workspace: Path, tmp: Path, disk_bytes: int, inodes: int, templates: Path) -> None:
    """Mount a new file system of `disk_bytes` and `inode_count(inodes)` over the (empty, existing) `workspace`
    and `tmp`. It is a copy of an empty one made once per size in `templates` (`template`)."""
    inodes = inode_count(disk_bytes, inodes)
    info = os.statvfs(root)
    free = info.f_bavail * info.f_frsize
    if free < disk_bytes:
        raise DiskError(
            f"no space on the server's state disk for a sandbox of {disk_bytes} bytes (limits.disk_mb): {free} are "
            "free",
            507,
        )
    image = root / IMAGE
    staging = Path(tempfile.mkdtemp(prefix=".disk-", dir=root))
    try:
        try:
            copy_sparse(template(templates, disk_bytes, inodes), image)
        except FileNotFoundError:  # its template was pruned by a concurrent creation of another size: made anew
            with contextlib.suppress(FileNotFoundError):
                image.unlink()
            copy_sparse(template(templates, disk_bytes, inodes), image)
        with attached_loop(image) as device:
            _mount_call(_libc.mount(device.encode(), bytes(staging), b"ext4", _MOUNT_FLAGS, b"noinit_itable"))
        try:
            for name, target in (("workspace", workspace), ("tmp", tmp)):
                (staging / name).mkdir()
                _mount_call(_libc.mount(str(staging / name).encode(), str(target).encode(), None, _MS_BIND, None))
        except BaseException:
            unmount(workspace, tmp)
            raise
        finally:
            _detach(staging)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskError(f"no space on the state disk for the sandbox's file system: {exc}", 507) from None
        raise DiskError(f"cannot make the sandbox's file system: {exc}") from None
    finally:
        with contextlib.suppress(OSError):
            staging.rmdir()


def template(templates: Path, disk_bytes: int, inodes: int) -> Path:
    """An empty file system image of this size, made once (mkfs, 7-18 ms here) and then copied for each sandbox
    (its ~2 MB of metadata, ~1 ms). A copy shares the template's UUID, which nothing here reads."""
    size = image_bytes(disk_bytes, inodes)
    path = templates / f"ext4-{size}-{inodes}.img"
    if path.exists():
        return path
    templates.mkdir(mode=0o700, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".template-", dir=templates)
    try:
        os.ftruncate(fd, size)
        os.close(fd)
        _run(
            "mkfs.ext4",
            "-q", "-F", "-b", str(BLOCK_BYTES), "-N", str(inodes), "-m", "0", "-O", "^has_journal",
            "-E", "lazy_itable_init=1,root_owner=0:0", partial,
        )  # fmt: skip
        os.replace(partial, path)  # complete or absent: a concurrent creation makes its own and one wins
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    kept = sorted(templates.glob("ext4-*.img"), key=lambda p: p.stat().st_mtime)
    for old in kept[:-MAX_TEMPLATES]:  # each holds ~2 MB: a client asking for ever new sizes fills nothing
        with contextlib.suppress(OSError):
            old.unlink()
    return path


def copy_sparse(source: Path, target: Path) -> None:
    """Copy `source` into a new file `target`, its holes kept as holes: only the extents with data are copied.
    `target` is made 0600, whatever the umask: the image holds the sandbox's workspace, and its folder is
    traversable by every sandbox uid (0711)."""
    fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    with open(source, "rb") as src, open(fd, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        dst.truncate(size)
        offset = 0
        while offset < size:
            try:
                offset = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError as exc:  # ENXIO: no data after `offset`
                if exc.errno == errno.ENXIO:
                    break
                raise
            end = os.lseek(src.fileno(), offset, os.SEEK_HOLE)
            while offset < end:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), end - offset, offset, offset)
                if copied == 0:
                    raise OSError(errno.EIO, f"{source} ended early")
                offset += copied


@contextlib.contextmanager
def attached_loop(image: Path) -> Iterator[str]:
    """A free loop device backed by `image`, open for the block: its path. It detaches itself once its last user
    is gone (autoclear): after the block, that is the mount made in it, or nothing. In-process ioctls rather than
    `mount -o loop`: each program the server starts costs 1-10 ms on a busy host, measured here, and the loop
    set-up is two ioctls. A device another process takes first is skipped."""
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(64):
            device = loop_node(fcntl.ioctl(control, _LOOP_CTL_GET_FREE))
            loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(loop, _LOOP_CONFIGURE, _LOOP_CONFIG.pack(backing, 0, _LO_FLAGS_AUTOCLEAR))
            except OSError as exc:
                os.close(loop)
                if exc.errno != errno.EBUSY:
                    raise
                continue
            try:
                yield device
            finally:
                os.close(loop)
            return
        raise OSError(errno.EBUSY, "every free loop device was taken by another process first")
    finally:
        os.close(backing)
        os.close(control)


def loop_node(number: int, dev: Path = Path("/dev")) -> str:
    """The path of loop device `number`, its node made where it is missing: the kernel makes the device, but a
    static /dev (a container's) has nodes only for the loop devices that existed when it was made. OSError, naming
    the node, where it cannot be made (no CAP_MKNOD, a read-only /dev): then the probe says why the disk limit is
    not held."""
    path = dev / f"loop{number}"
    if not os.path.exists(path):
        try:
            os.mknod(path, stat.S_IFBLK | 0o660, os.makedev(LOOP_MAJOR, number))
        except FileExistsError:  # another process made it meanwhile
            pass
        except OSError as exc:
            raise OSError(
                exc.errno, f"loop device {number} has no node {path} and it cannot be made: {exc.strerror}"
            ) from None
    return str(path)


def unmount(*targets: Path) -> None:
    """Detach whatever is mounted at each target (nothing: no error). Detached, the file system lives on only while
    a process still uses it, and the loop device is freed after."""
    for target in targets:
        _detach(target)


def unmount_below(root: Path) -> int:
    """Detach every mount at or below `root`, deepest first (a crashed server's sandboxes); how many."""
    found = mounts_below(root)
    for point in sorted(found, key=lambda p: len(p.parts), reverse=True):
        _detach(point)
    return len(found)


def mounts_below(root: Path) -> list[Path]:
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            parts = line.split()
            if len(parts) > 4:
                point = Path(unescape(parts[4]))
                if point == root or point.is_relative_to(root):
                    points.append(point)
    return points


def _detach(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # not a mount point, or gone: nothing to undo
            log.warning("cannot unmount %s: %s", target, os.strerror(code))


def _mount_call(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=MKFS_TIMEOUT_S, check=False)
    if done.returncode != 0:
        output = " ".join((done.stderr or done.stdout).split())[-500:]
        code = errno.ENOSPC if "No space left" in output else errno.EIO
        raise OSError(code, f"{argv[0]} exited {done.returncode}: {output}")


def probe(state_dir: Path) -> tuple[bool, str]:
    """Whether this server can give sandboxes file systems of their own: tried for real with a small one (root,
    mkfs.ext4, loop devices, mount permission inside a container all have to be there). (usable, why or what)."""
    if os.geteuid() != 0:
        return False, "the server is not root: it cannot mount a file system per sandbox"
    for tool in ("mkfs.ext4", "mount"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not installed (apt-get install e2fsprogs mount)"
    trial = Path(tempfile.mkdtemp(prefix=".disk-probe-", dir=state_dir))
    try:
        (trial / "w").mkdir()
        (trial / "t").mkdir()
        make(trial, trial / "w", trial / "t", 1 << 20, 1024, trial / "templates")
        unmount(trial / "w", trial / "t")
        return True, "an ext4 file system per sandbox (a sparse loop image)"
    except DiskError as exc:
        return False, f"cannot mount a file system per sandbox: {exc}"
    finally:
        unmount_below(trial)
        shutil.rmtree(trial, ignore_errors=True)
