"""Trees on the host, walked by descriptor so that no link is ever followed and no depth is too deep: the copy
that seeds a workspace from an image's directory (`seed_workdir`), the emptying of a workspace at a wipe, the
removal of a sandbox's folder. The file API's walks (files.py) open their directories the same way (DIR_FLAGS)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from pathlib import Path

from server_kit.errors import ApiError

log = logging.getLogger(__name__)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SeedError(ApiError):
    """The image cannot seed the workspace (400), its copy is over limits.disk_mb (413), or the host has no room
    for it (507)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def seed_workspace(
    image_root: Path,
    workdir: str,
    workspace: Path,
    uid: int | None,
    max_bytes: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Copy the directory `image_root`/`workdir` into the empty `workspace`; returns the bytes of its files.

    No link is ever followed, neither on the way to `workdir` (a link there is refused: in the image it could
    lead anywhere on the host) nor in the tree (links are copied as links). Regular files keep their mode less
    setuid and setgid, and their times (git's index stays valid); directories their mode (set once they are
    filled); device nodes, FIFOs and sockets are skipped. Under a root server (`uid`) every copy is given to
    the sandbox's uid, as the rest of its workspace. SeedError when the image holds no directory at `workdir`,
    part of it cannot be read, or its files hold more than `max_bytes`. One directory level at a time holds
    two descriptors: no recursion."""
    try:
        source = _image_directory(image_root, workdir)
    except OSError:
        raise SeedError(
            f"the image holds no directory at {workdir} to seed the workspace from (seed_workdir; a link there "
            "is not followed)"
        ) from None
    try:
        target = os.open(workspace, DIR_FLAGS)
    except BaseException:
        os.close(source)
        raise
    try:
        return _copy_tree(source, target, uid, max_bytes, stop or threading.Event(), workdir)
    except PermissionError as exc:
        raise SeedError(f"the image's {workdir} cannot be copied into the workspace: {exc}") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SeedError(f"no space left for the copy of the image's {workdir}: {exc}", 507) from None
        raise


def _image_directory(image_root: Path, workdir: str) -> int:
    """A descriptor of the directory at `workdir` in the image, each name of it opened without following links."""
    fd = os.open(image_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in workdir.strip("/").split("/"):
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _copy_tree(
    source: int, target: int, uid: int | None, max_bytes: int | None, stop: threading.Event, what: str
) -> int:
    total = 0
    # (source fd, target fd, names left, the source directory's stat): the levels from the top down.
    stack: list[tuple[int, int, list[str], os.stat_result | None]] = [(source, target, [], None)]
    try:
        stack[0] = (source, target, os.listdir(source), None)
        while stack:
            src, dst, names, directory = stack[-1]
            if not names:  # a level filled: its mode and times last (a read-only one could not be filled)
                stack.pop()
                if directory is not None:
                    os.fchmod(dst, _kept_mode(directory))
                    os.utime(dst, ns=(directory.st_atime_ns, directory.st_mtime_ns))
                os.close(src)
                os.close(dst)
                continue
            if stop.is_set():
                raise SeedError("the seeding of the workspace was cancelled", 500)
            name = names.pop()
            info = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                os.mkdir(name, 0o700, dir_fd=dst)
                child_src = os.open(name, DIR_FLAGS, dir_fd=src)
                try:
                    child_dst = os.open(name, DIR_FLAGS, dir_fd=dst)
                except BaseException:
                    os.close(child_src)
                    raise
                stack.append((child_src, child_dst, os.listdir(child_src), info))
                if uid is not None:
                    os.fchown(child_dst, uid, uid)
            elif stat.S_ISLNK(info.st_mode):
                link = os.readlink(name, dir_fd=src)
                total += len(os.fsencode(link))
                os.symlink(link, name, dir_fd=dst)
                if uid is not None:
                    os.chown(name, uid, uid, dir_fd=dst, follow_symlinks=False)
                os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
            elif stat.S_ISREG(info.st_mode):
                total += info.st_size
                if max_bytes is not None and total > max_bytes:
                    raise SeedError(
                        f"the image's {what} holds more than the sandbox's disk budget of {max_bytes} bytes "
                        "(limits.disk_mb)",
                        413,
                    )
                _copy_file(src, dst, name, info, uid)
    finally:
        for src, dst, _, _ in stack:
            os.close(src)
            os.close(dst)
    return total


def _kept_mode(info: os.stat_result) -> int:
    return stat.S_IMODE(info.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)


def _copy_file(src: int, dst: int, name: str, info: os.stat_result, uid: int | None) -> None:
    fd_in = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    try:
        fd_out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst)
        try:
            offset = 0
            while os.fstat(fd_in).st_size > offset:
                sent = os.sendfile(fd_out, fd_in, offset, 1 << 30)
                if sent == 0:
                    break
                offset += sent
            if uid is not None:
                os.fchown(fd_out, uid, uid)
            os.fchmod(fd_out, _kept_mode(info))
            os.utime(fd_out, ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def empty_directory(directory: Path) -> None:
    """Remove everything inside `directory`, never following a link, at any depth: one directory open at a time
    and a stack of names, not recursion (an agent's tree may be deeper than Python's recursion limit and than
    PATH_MAX). What its owner made unwritable or unreadable is made accessible again (an unprivileged server owns
    its sandboxes' files). Call it only once every process that could write there is gone: the walk climbs back
    through '..'."""
    fd = os.open(directory, DIR_FLAGS)
    below: list[str] = []  # the directories from `directory` down to the one open on fd
    try:
        while True:
            sub = _unlink_all_but_directories(fd)
            if sub is not None:
                child = _open_accessible(fd, sub)
                os.close(fd)
                fd = child
                below.append(sub)
            elif below:
                parent = os.open("..", DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                _writable_retry(fd, os.rmdir, below.pop())
            else:
                return
    finally:
        os.close(fd)


def remove_tree(directory: Path) -> None:
    """`directory` and everything in it, as empty_directory does; what cannot be removed stays (logged), for the
    next server on the state dir to reap."""
    try:
        empty_directory(directory)
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", directory, exc)


def _unlink_all_but_directories(fd: int) -> str | None:
    """Unlink the entries of the directory open on `fd` up to its first subdirectory, whose name is returned;
    None once only subdirectories were left (and there were none)."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            _writable_retry(fd, os.unlink, entry.name)
    return None


def _writable_retry(fd: int, remove, name: str) -> None:
    """`remove(name, dir_fd=fd)`; if the directory was made unwritable, make it writable (0700) and retry."""
    try:
        remove(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except PermissionError:
        os.fchmod(fd, 0o700)
        remove(name, dir_fd=fd)


def _open_accessible(fd: int, name: str) -> int:
    """Open subdirectory `name` of `fd` without following a link. If `fd` was made untraversable or `name`
    unreadable, both are given 0700 first."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except PermissionError:
        os.fchmod(fd, 0o700)
        os.chmod(name, 0o700, dir_fd=fd)  # a directory (scandir said so, and nothing runs to swap it)
        return os.open(name, DIR_FLAGS, dir_fd=fd)
