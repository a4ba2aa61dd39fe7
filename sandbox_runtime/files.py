"""Race-free file access to a sandbox's writable directories.

The server runs as root while the sandboxed agent can create arbitrary symlinks in the very
directories we serve, concurrently with our requests.  Resolving a path string with the kernel
(``open("/state/sb/abc/workspace/out/passwd")``) would therefore let the agent redirect a root
write anywhere on the host by swapping ``out`` for a link to ``/etc`` at the right moment.  So no
path string below a mount's host directory is ever handed to the kernel: every component is
opened with ``openat(dir_fd, name, O_NOFOLLOW)`` starting from an fd on the mount's host
directory, and a symlink anywhere along the way is an error (or, for a file that ``unpack`` is
about to replace, it is unlinked -- never followed).  For the same reason, what we create is
given to the sandbox's uid with ``fchown`` on the fd we already hold, never by path.

Everything here is synchronous and stateless beyond the mount table; the server calls it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from server_kit.errors import ApiError, ProrlError

from .host_tree import DIR_FLAGS

__all__ = ["FileAccessError", "SandboxFiles"]

# O_NONBLOCK on every open of a final component: the agent can plant a FIFO where we expect a
# file, and a blocking open of a FIFO would hang the server thread until someone opens the other
# end.  With O_NONBLOCK the open returns at once (or fails with ENXIO) and fstat() then tells us
# it is not a regular file.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_CHUNK = 1 << 20
# A directory tree deeper than this is refused by pack(): we hold one fd per level while walking.
_MAX_PACK_DEPTH = 256
# Same bound as the kernel's symlink-follow limit, for resolving archive symlinks on paper.
_MAX_LINK_HOPS = 40


class FileAccessError(ApiError):
    """A file API request that cannot be served, with the HTTP status the server should answer.

    ``status`` is 400 for a malformed path, a path outside every mount, a symbolic link, a special
    file or a bad archive; 404 for a missing path; 409 for "is a directory" / "is not a directory"
    conflicts and for a program that is running; 413 when the data is larger than the caller's
    limit; 403 and 507 for permission and out-of-space errors from the filesystem.  The message is
    meant to be shown to the agent as is, so it names the in-sandbox path and says what is wrong
    with it.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class _Target:
    """A request path resolved on paper: which mount it is in and its components below it."""

    display: str  # normalised in-sandbox path, used in error messages
    mount: str  # in-sandbox mount point, e.g. "/workspace"
    host_root: Path  # host directory behind the mount
    parts: tuple[str, ...]  # components below the mount point; () is the mount point itself


def _split(path: str) -> list[str]:
    """Components of a slash path with empty and '.' components dropped ('..' kept)."""
    return [p for p in path.split("/") if p not in ("", ".")]


def _join(base: str, parts: tuple[str, ...] | list[str]) -> str:
    """In-sandbox display path for ``parts`` below ``base``."""
    if not parts:
        return base
    return base.rstrip("/") + "/" + "/".join(parts)


def _fs_error(err: OSError, display: str) -> FileAccessError:
    """Map a filesystem error on ``display`` to a FileAccessError the agent can act on."""
    code = err.errno
    if code == errno.ENOENT:
        return FileAccessError(404, f"{display!r} does not exist")
    if code == errno.EISDIR:
        return FileAccessError(409, f"{display!r} is a directory")
    if code == errno.ENOTDIR:
        return FileAccessError(409, f"{display!r} (or one of its parents) is not a directory")
    if code in (errno.EEXIST, errno.ENOTEMPTY):
        return FileAccessError(409, f"{display!r} already exists and cannot be replaced")
    if code == errno.ELOOP:
        return FileAccessError(400, f"{display!r} is a symbolic link; the file API does not follow links")
    if code == errno.ENAMETOOLONG:
        return FileAccessError(400, f"{display!r}: name too long")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return FileAccessError(403, f"{display!r}: permission denied ({os.strerror(code)})")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return FileAccessError(507, f"{display!r}: no space left in the sandbox ({os.strerror(code)})")
    if code == errno.ENXIO:
        return FileAccessError(400, f"{display!r} is not a regular file")
    if code == errno.ETXTBSY:
        return FileAccessError(409, f"{display!r} is a program running in the sandbox; end it before replacing it")
    if code == errno.EMLINK:
        return FileAccessError(400, f"{display!r}: too many hard links to one file for the sandbox's filesystem")
    return FileAccessError(500, f"{display!r}: {os.strerror(code) if code else err}")


def _classify_open_failure(dir_fd: int, name: str, display: str, err: OSError) -> FileAccessError:
    """Explain why an O_NOFOLLOW open of ``name`` failed.

    ELOOP vs ENOTDIR for a symlink opened with O_DIRECTORY|O_NOFOLLOW is not something worth
    relying on, so look at what is actually there.  The lstat is only used to word the refusal;
    racing it changes the message, never what we touch.
    """
    if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return _fs_error(err, display)
        if stat.S_ISLNK(st.st_mode):
            return FileAccessError(400, f"{display!r} is a symbolic link; the file API does not follow links")
        if err.errno == errno.ENOTDIR:
            return FileAccessError(409, f"{display!r} is not a directory")
    return _fs_error(err, display)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _fchown(fd: int, owner: tuple[int, int] | None, display: str) -> None:
    """chown the file or directory open on ``fd`` to ``owner``; no-op when there is no owner."""
    if owner is None:
        return
    try:
        os.fchown(fd, *owner)
    except OSError as err:
        raise _fs_error(err, display) from None


def _open_dir(dir_fd: int, name: str, display: str, create: bool, owner: tuple[int, int] | None = None) -> int:
    """Open directory ``name`` inside ``dir_fd`` without following a link, creating it if asked.

    A directory we create is given to ``owner``; one that already exists is left as it is.
    """
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError as err:
        if not create:
            raise _fs_error(err, display) from None
    except OSError as err:
        raise _classify_open_failure(dir_fd, name, display, err) from None
    created = True
    try:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    except FileExistsError:
        created = False  # created concurrently (possibly as a link): the open below decides
    except OSError as err:
        raise _fs_error(err, display) from None
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        raise _classify_open_failure(dir_fd, name, display, err) from None
    if created:
        try:
            _fchown(fd, owner, display)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _walk(
    dir_fd: int, base: str, parts: tuple[str, ...] | list[str], create: bool, owner: tuple[int, int] | None = None
) -> int:
    """Open the directory ``parts`` below ``dir_fd`` one component at a time; return a new fd.

    ``base`` is the in-sandbox path of ``dir_fd``, for messages.  The caller owns the returned fd
    (a dup of ``dir_fd`` when ``parts`` is empty); ``dir_fd`` itself is left open.  Directories
    created on the way are given to ``owner``.
    """
    fd = os.dup(dir_fd)
    try:
        for i, name in enumerate(parts):
            nxt = _open_dir(fd, name, _join(base, parts[: i + 1]), create, owner)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _closing_fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_upto(fd: int, limit: int) -> bytes:
    """Read until EOF or until more than ``limit`` bytes have been read (at most limit + 1)."""
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


class _ArchiveTooLarge(ProrlError):
    pass


class _CappedBuffer(io.BytesIO):
    """In-memory sink that aborts the pack as soon as the compressed output passes the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit = limit

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        if self.tell() + memoryview(b).nbytes > self._limit:
            raise _ArchiveTooLarge
        return super().write(b)


class _ContentTooLarge(ProrlError):
    pass


class _ContentCap:
    """Running total of file bytes put into an archive, checked before each file is read.

    The compressed-size cap alone does not bound the work: a sparse 100 GB file compresses to
    almost nothing, so ``pack`` would read (and the kernel would zero-fill) 100 GB for it.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.total = 0

    def take(self, size: int) -> None:
        self.total += size
        if self.limit is not None and self.total > self.limit:
            raise _ContentTooLarge


class _FixedSizeReader:
    """File-like over an fd that yields exactly ``size`` bytes.

    The agent may grow or shrink a file while we pack it; the tar header already carries the
    fstat size, so we truncate or zero-pad the data to match rather than produce a corrupt
    archive or fail the whole pack.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._left = size

    def read(self, n: int = -1) -> bytes:
        want = self._left if n is None or n < 0 else min(n, self._left)
        chunks: list[bytes] = []
        got = 0
        while got < want:
            chunk = os.read(self._fd, want - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        self._left -= want
        return b"".join(chunks).ljust(want, b"\0")


def _archive_error(display: str, err: BaseException) -> FileAccessError:
    return FileAccessError(400, f"cannot unpack into {display!r}: malformed archive ({err})")


_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError, ValueError, KeyError)


def _open_archive(archive: bytes, display: str) -> tarfile.TarFile:
    """Open a tar archive of any compression tarfile knows (gzip'd and plain at least)."""
    try:
        return tarfile.open(fileobj=io.BytesIO(archive), mode="r:*")
    except _ARCHIVE_ERRORS as err:
        raise _archive_error(display, err) from None


def _member_parts(name: str, what: str) -> tuple[str, ...]:
    """Validated components of an archive member name (or hardlink target)."""
    if "\0" in name:
        raise FileAccessError(400, f"archive {what} {name!r} contains a NUL byte")
    if name.startswith("/"):
        raise FileAccessError(400, f"archive {what} {name!r} is an absolute path; only relative names")
    parts = _split(name)
    if ".." in parts:
        raise FileAccessError(400, f"archive {what} {name!r} contains '..'; it would escape the target")
    return tuple(parts)


def _resolve_archive_link(
    start: list[str], target: str, links: dict[tuple[str, ...], str], hops: int = 0
) -> list[str] | None:
    """Where symlink text ``target`` written in directory ``start`` points, or None if it escapes.

    Resolution happens on paper against the archive's own symlinks (like ``realpath`` would once
    they exist), so chains such as ``s -> .`` plus ``e -> s/../x`` are caught: lexically
    ``e`` stays inside, physically it reaches the parent of the target directory.
    """
    if target.startswith("/") or hops > _MAX_LINK_HOPS:
        return None
    stack = list(start)
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not stack:
                return None
            stack.pop()
            continue
        stack.append(comp)
        inner = links.get(tuple(stack))
        if inner is not None:
            stack.pop()
            resolved = _resolve_archive_link(stack, inner, links, hops + 1)
            if resolved is None:
                return None
            stack = resolved
    return stack


@dataclass
class _Plan:
    """A validated member of an archive being unpacked."""

    member: tarfile.TarInfo
    parts: tuple[str, ...]
    link_to: tuple[str, ...] = ()  # for hardlinks: the earlier member whose inode they share


def _plan_unpack(
    tar: tarfile.TarFile, display: str, max_file_bytes: int | None, max_total_bytes: int | None
) -> list[_Plan]:
    """Check every member before anything is written, so a bad archive writes nothing at all.

    Rules (``tarfile.data_filter`` or stricter): only regular files, directories, symlinks and
    hardlinks; no absolute names or '..'; symlinks must be relative and resolve inside the target
    even through the archive's other symlinks; no member may sit below a symlink member (we
    would have to follow it); hardlinks must name an earlier regular file (or hardlink to one)
    in the archive, and become links to the inode extracted for it, so they can never be tied
    to an inode outside the target.  Sizes: no regular file over ``max_file_bytes``, and their
    sum (hardlinks add no data) at most ``max_total_bytes``.
    """
    try:
        members = tar.getmembers()
    except _ARCHIVE_ERRORS as err:
        raise _archive_error(display, err) from None

    links: dict[tuple[str, ...], str] = {}
    for m in members:
        if m.issym():
            parts = _member_parts(m.name, "member")
            if parts in links and links[parts] != m.linkname:
                raise FileAccessError(400, f"archive symlink {m.name!r} appears twice with different targets")
            links[parts] = m.linkname

    plans: list[_Plan] = []
    regular: set[tuple[str, ...]] = set()  # paths a hardlink may point at
    total = 0
    kinds: dict[tuple[str, ...], str] = {}
    for m in members:
        parts = _member_parts(m.name, "member")
        if not parts:
            if m.isdir():
                continue  # "./" entry for the target directory itself
            raise FileAccessError(400, f"archive member {m.name!r} has an empty name")
        for i in range(1, len(parts)):
            if parts[:i] in links:
                raise FileAccessError(
                    400,
                    f"archive member {m.name!r} lies below symlink member {'/'.join(parts[:i])!r}; "
                    "the file API does not follow links",
                )
        kind = "dir" if m.isdir() else "sym" if m.issym() else "file"
        previous = kinds.setdefault(parts, kind)
        if previous != kind and "sym" in (previous, kind):
            raise FileAccessError(400, f"archive member {m.name!r} appears twice, once as a symlink")

        if m.isreg():
            if max_file_bytes is not None and m.size > max_file_bytes:
                raise FileAccessError(
                    413,
                    f"archive member {m.name!r} is {m.size} bytes, more than the {max_file_bytes}-byte per-file limit",
                )
            total += m.size
            plan = _Plan(m, parts)
            regular.add(parts)
        elif m.isdir():
            plan = _Plan(m, parts)
        elif m.issym():
            if not m.linkname:
                raise FileAccessError(400, f"archive symlink {m.name!r} has an empty target")
            if "\0" in m.linkname or _resolve_archive_link(list(parts[:-1]), m.linkname, links) is None:
                raise FileAccessError(
                    400,
                    f"archive symlink {m.name!r} -> {m.linkname!r} points outside the target directory",
                )
            plan = _Plan(m, parts)
        elif m.islnk():
            src = _member_parts(m.linkname, "hardlink target")
            if src not in regular:
                raise FileAccessError(
                    400,
                    f"archive hardlink {m.name!r} -> {m.linkname!r} does not name an earlier "
                    "regular file in the archive",
                )
            plan = _Plan(m, parts, link_to=src)
            regular.add(parts)
        else:
            raise FileAccessError(
                400,
                f"archive member {m.name!r} is a device, FIFO or other special file; "
                "only files, directories and links can be unpacked",
            )
        plans.append(plan)
    if max_total_bytes is not None and total > max_total_bytes:
        raise FileAccessError(
            413,
            f"cannot unpack into {display!r}: the archive's files total {total} bytes, "
            f"more than the sandbox's remaining {max_total_bytes}-byte disk budget",
        )
    return plans


def _make_room(parent: int, name: str, display: str, what: str) -> None:
    """Remove the file or link at ``name`` so a link member can take its place, as tar does.

    unlinkat never follows a link; a directory is kept and refused.
    """
    if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
        raise FileAccessError(409, f"{display!r} is a directory; cannot replace it with {what}")
    os.unlink(name, dir_fd=parent)


def _file_mode(mode: int) -> int:
    """``tarfile.data_filter``'s mode rule for files: no set-id/sticky or group/other write bits,
    no execute bits unless the owner has one, and always owner read/write."""
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _dir_mode(mode: int) -> int:
    """Directory modes are kept (unlike data_filter) so a pack/unpack round trip preserves them,
    minus set-id/sticky and group/other write bits; the owner always keeps rwx."""
    return (mode & 0o755) | 0o700


def _set_mtime(fd: int, mtime: float) -> None:
    with suppress(OverflowError, ValueError):  # absurd timestamp in the archive: keep "now"
        os.utime(fd, (mtime, mtime))


def _dir_usage(dir_fd: int, display: str, depth: int, seen: set[tuple[int, int]]) -> int:
    """Allocated bytes of everything below ``dir_fd``, like ``du``: links never followed.

    A file with several links is counted once (``seen`` holds their inodes); entries that vanish
    or turn into something else while we look (the agent is live) are skipped.  Too deep a tree
    is an error rather than a silent undercount, so nesting cannot hide data from the budget.
    """
    if depth >= _MAX_PACK_DEPTH:
        raise FileAccessError(400, f"{display!r} is nested more than {_MAX_PACK_DEPTH} directories deep")
    total = 0
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as err:  # a directory the sandbox made untraversable (chmod a-x)
                raise _fs_error(err, display) from None
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
            if not stat.S_ISDIR(st.st_mode):
                continue
            sub = _join(display, [entry.name])
            try:
                fd = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as err:
                if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # removed, or swapped for a file or link since the stat
                raise _fs_error(err, sub) from None
            with _closing_fd(fd):
                total += _dir_usage(fd, sub, depth + 1, seen)
    return total


def _open_mount(host: Path, point: str) -> int:
    """fd of a mount's host directory; the sandbox may have made it unreadable (``chmod 0 /workspace``)."""
    try:
        return os.open(host, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise _fs_error(err, point) from None


class SandboxFiles:
    """File operations on one sandbox's mounted directories, addressed by in-sandbox paths.

    ``mounts`` maps an in-sandbox mount point (``"/workspace"``) to the host directory behind it;
    ``workdir`` is the in-sandbox directory that relative request paths are resolved against.
    ``owner`` is the (uid, gid) the sandbox's processes run as: when the server runs as root,
    everything the file API creates or writes is given to it, so the agent can edit (and delete)
    what it was handed.  ``None`` chowns nothing (a server that runs as the sandbox's own user).
    """

    def __init__(self, mounts: dict[str, Path], workdir: str, owner: tuple[int, int] | None = None) -> None:
        if not mounts:
            raise ValueError("SandboxFiles needs at least one mount")
        self._mounts: dict[tuple[str, ...], tuple[str, Path]] = {}
        for point, host in mounts.items():
            parts = _split(point)
            if not point.startswith("/") or ".." in parts or "\0" in point:
                raise ValueError(f"mount point {point!r} must be an absolute path without '..'")
            self._mounts[tuple(parts)] = ("/" + "/".join(parts), Path(host).absolute())
        if not workdir.startswith("/") or ".." in _split(workdir):
            raise ValueError(f"workdir {workdir!r} must be an absolute path without '..'")
        self._workdir = "/" + "/".join(_split(workdir))
        if self._find_mount(tuple(_split(workdir))) is None:
            raise ValueError(f"workdir {workdir!r} is not inside any mount: {self._mount_list()}")
        self._owner = owner

    # -- path resolution ------------------------------------------------------------------------

    def _mount_list(self) -> str:
        return ", ".join(point for point, _ in self._mounts.values())

    def _find_mount(self, parts: tuple[str, ...]) -> tuple[tuple[str, ...], str, Path] | None:
        """Longest mount point that is a prefix of ``parts``."""
        for n in range(len(parts), -1, -1):
            hit = self._mounts.get(parts[:n])
            if hit is not None:
                return parts[n:], hit[0], hit[1]
        return None

    def _resolve(self, path: str) -> _Target:
        """Turn a request path into (mount, components) without touching the filesystem."""
        if "\0" in path:
            raise FileAccessError(400, f"path {path!r} contains a NUL byte")
        full = path if path.startswith("/") else f"{self._workdir}/{path}"
        parts = _split(full)
        if ".." in parts:
            raise FileAccessError(
                400, f"path {path!r} contains '..'; the file API only accepts paths without parent references"
            )
        found = self._find_mount(tuple(parts))
        if found is None:
            raise FileAccessError(400, f"path {path!r} is outside the sandbox's writable areas: {self._mount_list()}")
        rest, mount, host_root = found
        return _Target(display="/" + "/".join(parts), mount=mount, host_root=host_root, parts=rest)

    def _open_parent(self, t: _Target, create: bool) -> int:
        """fd of the directory holding ``t``'s last component (``t.parts`` must be non-empty)."""
        with _closing_fd(_open_mount(t.host_root, t.mount)) as root:
            return _walk(root, t.mount, t.parts[:-1], create, owner=self._owner)

    def _open_dir_target(self, t: _Target, create: bool) -> int:
        """fd of the directory ``t`` itself."""
        with _closing_fd(_open_mount(t.host_root, t.mount)) as root:
            return _walk(root, t.mount, t.parts, create, owner=self._owner)

    def _own_file(self, fd: int, st: os.stat_result, display: str) -> None:
        """Give the regular file open on ``fd`` to the owner, unless it has other links.

        Files are written in place, so the agent could have hard-linked a host file it can write
        (but does not own) at the path, and chowning that inode would hand the host file over.
        A file with one link lives only here.  One with more is left as it is: if ``unpack``
        made the links, they share an inode that was given away when it had one link.
        """
        if st.st_nlink == 1:
            _fchown(fd, self._owner, display)

    def _open_existing(self, t: _Target) -> int:
        """Open whatever ``t`` names (file or directory) read-only, refusing a symlink."""
        if not t.parts:
            return self._open_dir_target(t, create=False)
        with _closing_fd(self._open_parent(t, create=False)) as parent:
            try:
                return os.open(t.parts[-1], _READ_FLAGS, dir_fd=parent)
            except OSError as err:
                raise _classify_open_failure(parent, t.parts[-1], t.display, err) from None

    # -- public API -----------------------------------------------------------------------------

    def write(self, path: str, data: bytes, max_file_bytes: int | None = None) -> int:
        """Write ``data`` to the file at ``path``, creating missing parent directories.

        Existing files are overwritten in place (mode kept); a symlink at ``path`` is refused
        rather than followed, so a link to a host file can never be truncated.  The file is
        truncated only after fstat confirms it is a regular file.  The file and any directories
        created go to the sandbox's owner (see the class).  More than ``max_file_bytes`` of data
        is refused with 413 before anything is touched.  Returns bytes written.
        """
        t = self._resolve(path)
        if not t.parts:
            raise FileAccessError(409, f"{t.display!r} is a directory")
        if max_file_bytes is not None and len(data) > max_file_bytes:
            raise FileAccessError(
                413, f"{t.display!r}: {len(data)} bytes is more than the {max_file_bytes}-byte per-file limit"
            )
        with _closing_fd(self._open_parent(t, create=True)) as parent:
            try:
                fd = os.open(t.parts[-1], _WRITE_FLAGS, 0o644, dir_fd=parent)
            except OSError as err:
                raise _classify_open_failure(parent, t.parts[-1], t.display, err) from None
        with _closing_fd(fd):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileAccessError(400, f"{t.display!r} is not a regular file")
            self._own_file(fd, st, t.display)
            try:
                os.ftruncate(fd, 0)
                _write_all(fd, data)
            except OSError as err:
                raise _fs_error(err, t.display) from None
        return len(data)

    def read(self, path: str, max_bytes: int) -> bytes:
        """Return the contents of the regular file at ``path``.

        Raises 413 rather than returning a prefix when the file holds more than ``max_bytes``
        (checked by fstat and again while reading, since the agent may be growing the file).
        """
        t = self._resolve(path)
        with _closing_fd(self._open_existing(t)) as fd:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise FileAccessError(
                    409,
                    f"{t.display!r} is a directory; fetch a directory as a tar.gz with GET /v1/sandboxes/{{id}}/archive"
                    f"?path={t.display} (the Python client's download_archive)",
                )
            if not stat.S_ISREG(st.st_mode):
                raise FileAccessError(400, f"{t.display!r} is not a regular file")
            if st.st_size > max_bytes:
                raise FileAccessError(413, f"{t.display!r} is {st.st_size} bytes, more than the {max_bytes}-byte limit")
            data = _read_upto(fd, max_bytes)
            if len(data) > max_bytes:
                raise FileAccessError(413, f"{t.display!r} is more than the {max_bytes}-byte limit")
            return data

    def pack(self, path: str, max_bytes: int, max_content_bytes: int | None = None) -> bytes:
        """Return a ``tar.gz`` of the directory (or single file) at ``path``.

        Member names are relative to ``path`` (a single file is stored under its base name).
        Symlinks are stored as symlinks with their text, never dereferenced; FIFOs, sockets and
        devices are skipped.  Raises 413 as soon as the compressed output exceeds ``max_bytes``,
        or once the files' sizes add up to more than ``max_content_bytes`` (checked before each
        file is read: a sparse file compresses to nothing but still costs its full size to read).
        """
        t = self._resolve(path)
        sink = _CappedBuffer(max_bytes)
        cap = _ContentCap(max_content_bytes)
        try:
            with _closing_fd(self._open_existing(t)) as fd:
                st = os.fstat(fd)
                with tarfile.open(fileobj=sink, mode="w:gz", compresslevel=6) as tar:
                    if stat.S_ISDIR(st.st_mode):
                        self._pack_dir(tar, fd, "", t.display, 0, cap)
                    elif stat.S_ISREG(st.st_mode):
                        cap.take(st.st_size)
                        tar.addfile(self._tarinfo(t.parts[-1], st), _FixedSizeReader(fd, st.st_size))
                    else:
                        raise FileAccessError(400, f"{t.display!r} is not a regular file or directory")
        except _ArchiveTooLarge:
            raise FileAccessError(413, f"archive of {t.display!r} is larger than the {max_bytes}-byte limit") from None
        except _ContentTooLarge:
            raise FileAccessError(
                413, f"{t.display!r} holds more than {max_content_bytes} bytes uncompressed; pack a smaller directory"
            ) from None
        return sink.getvalue()

    def unpack(
        self, path: str, archive: bytes, max_file_bytes: int | None = None, max_total_bytes: int | None = None
    ) -> int:
        """Extract a tar (gzip'd or plain, auto-detected) into directory ``path``; return members extracted.

        The whole archive is validated first (see ``_plan_unpack``), so a hostile archive writes
        nothing; that includes the sizes: a regular file over ``max_file_bytes``, or files adding
        up to more than ``max_total_bytes`` (the caller's remaining disk budget; hardlinks add
        nothing since they stay links), is refused with 413.  Extraction then walks every
        member's parents with O_NOFOLLOW, so a symlink the agent already planted in the tree
        (``out -> /etc``) makes ``out/passwd`` fail with 400 instead of writing through it.  A
        symlink sitting exactly where a file or link member goes is unlinked and replaced
        (unlinking never follows), as tar does.  Ownership in the archive is ignored: what is
        made goes to the sandbox's owner (see the class); modes lose set-id/sticky and
        group/other write bits.
        """
        t = self._resolve(path)
        with _open_archive(archive, t.display) as tar:
            plans = _plan_unpack(tar, t.display, max_file_bytes, max_total_bytes)
            with _closing_fd(self._open_dir_target(t, create=True)) as top:
                dirs: list[_Plan] = []
                inodes: dict[tuple[str, ...], tuple[int, int]] = {}  # what each file member became
                for plan in plans:
                    display = _join(t.display, plan.parts)
                    parent = _walk(top, t.display, plan.parts[:-1], create=True, owner=self._owner)
                    with _closing_fd(parent):
                        if plan.member.isdir():
                            os.close(_open_dir(parent, plan.parts[-1], display, create=True, owner=self._owner))
                            dirs.append(plan)
                        elif plan.member.issym():
                            self._unpack_symlink(parent, plan, display)
                        elif plan.member.islnk():
                            inodes[plan.parts] = self._unpack_hardlink(top, t.display, parent, plan, inodes)
                        else:
                            inodes[plan.parts] = self._unpack_file(tar, parent, plan, display)
                # Directory modes last, so a read-only directory cannot block its own contents.
                for plan in dirs:
                    display = _join(t.display, plan.parts)
                    with _closing_fd(_walk(top, t.display, plan.parts, create=False)) as fd:
                        _fchown(fd, self._owner, display)
                        os.fchmod(fd, _dir_mode(plan.member.mode))
                        _set_mtime(fd, plan.member.mtime)
        return len(plans)

    def usage(self) -> int:
        """Bytes of disk used under all mounts now: allocated blocks, each inode once, as ``du``.

        The server passes ``budget - usage()`` to ``unpack`` as ``max_total_bytes``, so this has
        to be quick for a few thousand files: one fstatat per entry, nothing read.
        """
        seen: set[tuple[int, int]] = set()
        total = 0
        for point, host in self._mounts.values():
            with _closing_fd(_open_mount(host, point)) as fd:
                total += _dir_usage(fd, point, 0, seen)
        return total

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _tarinfo(name: str, st: os.stat_result) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.uid, info.gid = st.st_uid, st.st_gid
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
        else:
            info.type = tarfile.REGTYPE
            info.size = st.st_size
        return info

    def _pack_dir(
        self, tar: tarfile.TarFile, dir_fd: int, prefix: str, display: str, depth: int, cap: _ContentCap
    ) -> None:
        """Add the contents of ``dir_fd`` under ``prefix``, opening every entry with O_NOFOLLOW.

        Entries that vanish or change type while we look (the agent is live) are skipped rather
        than failing the whole pack; an entry that turns into a symlink is never opened through.
        """
        if depth >= _MAX_PACK_DEPTH:
            raise FileAccessError(400, f"{display!r} is nested more than {_MAX_PACK_DEPTH} directories deep")
        for name in sorted(os.listdir(dir_fd)):
            arcname = prefix + name
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    info = self._tarinfo(arcname, st)
                    info.linkname = os.readlink(name, dir_fd=dir_fd)
                    tar.addfile(info)
                    continue
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    continue  # FIFO, socket, device: not file content
                fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.EINVAL, errno.ENXIO):
                    continue  # swapped for a link / non-link / socket between lstat and open
                raise _fs_error(err, _join(display, [name])) from None
            with _closing_fd(fd):
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    tar.addfile(self._tarinfo(arcname, st))
                    self._pack_dir(tar, fd, arcname + "/", _join(display, [name]), depth + 1, cap)
                elif stat.S_ISREG(st.st_mode):
                    cap.take(st.st_size)
                    tar.addfile(self._tarinfo(arcname, st), _FixedSizeReader(fd, st.st_size))

    def _unpack_symlink(self, parent: int, plan: _Plan, display: str) -> None:
        name = plan.parts[-1]
        try:
            try:
                os.symlink(plan.member.linkname, name, dir_fd=parent)
            except FileExistsError:
                _make_room(parent, name, display, "a symlink")
                os.symlink(plan.member.linkname, name, dir_fd=parent)
            if self._owner is not None:
                # A symlink cannot be opened for fchown, so this goes by name (never following).
                # The agent could swap in another non-directory in the instant since symlinkat;
                # it can only plant what it may hard-link, i.e. files it can already write.
                os.chown(name, *self._owner, dir_fd=parent, follow_symlinks=False)
        except OSError as err:
            raise _fs_error(err, display) from None

    def _unpack_hardlink(
        self, top: int, base: str, parent: int, plan: _Plan, inodes: dict[tuple[str, ...], tuple[int, int]]
    ) -> tuple[int, int]:
        """Hard-link ``plan``'s path to the inode extracted for its target; return that inode.

        The link shares the target's inode, owner and mode, so no data is written and nothing is
        chowned.  The agent may swap the target's name for another file while we link; the
        new link is checked against the inode we extracted, and removed if it is anything else.
        """
        name = plan.parts[-1]
        display = _join(base, plan.parts)
        want = inodes[plan.link_to]
        with _closing_fd(_walk(top, base, plan.link_to[:-1], create=False)) as src_dir:
            try:
                try:
                    os.link(plan.link_to[-1], name, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
                except FileExistsError:
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == want:
                        return want  # already that file: a link to itself, or unpacked before
                    _make_room(parent, name, display, "a hardlink")
                    os.link(plan.link_to[-1], name, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except OSError as err:
                raise _fs_error(err, display) from None
        if (st.st_dev, st.st_ino) != want:
            with suppress(OSError):
                os.unlink(name, dir_fd=parent)
            raise FileAccessError(409, f"{_join(base, plan.link_to)!r} changed while {display!r} was linked to it")
        return want

    def _unpack_file(self, tar: tarfile.TarFile, parent: int, plan: _Plan, display: str) -> tuple[int, int]:
        """Write a regular member's data at ``plan``'s path; return the (st_dev, st_ino) written."""
        name = plan.parts[-1]
        try:
            fd = os.open(name, _WRITE_FLAGS, 0o600, dir_fd=parent)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EMLINK) or not _is_symlink(parent, name):
                raise _classify_open_failure(parent, name, display, err) from None
            # A link sits where the file goes: replace the link itself, then insist on a fresh
            # file (O_EXCL) so a link re-planted in between makes us fail, not follow.
            try:
                os.unlink(name, dir_fd=parent)
                fd = os.open(name, _WRITE_FLAGS | os.O_EXCL, 0o600, dir_fd=parent)
            except OSError as err2:
                raise _classify_open_failure(parent, name, display, err2) from None
        with _closing_fd(fd):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileAccessError(400, f"{display!r} exists and is not a regular file")
            self._own_file(fd, st, display)
            try:
                os.ftruncate(fd, 0)
            except OSError as err:
                raise _fs_error(err, display) from None
            try:
                src = tar.extractfile(plan.member)
            except _ARCHIVE_ERRORS as err:
                raise _archive_error(display, err) from None
            assert src is not None
            left = plan.member.size
            while left > 0:
                try:
                    chunk = src.read(min(_CHUNK, left))
                except _ARCHIVE_ERRORS as err:
                    raise _archive_error(display, err) from None
                if not chunk:
                    raise _archive_error(display, EOFError(f"member {plan.member.name!r} is truncated"))
                try:
                    _write_all(fd, chunk)
                except OSError as err:
                    raise _fs_error(err, display) from None
                left -= len(chunk)
            os.fchmod(fd, _file_mode(plan.member.mode))
            _set_mtime(fd, plan.member.mtime)
            return st.st_dev, st.st_ino
