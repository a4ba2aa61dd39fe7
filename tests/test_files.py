"""Tests for sandbox_runtime.files: confinement of the file API to a sandbox's mounts.

Everything runs against real files under tmp_path.  "outside" plays the host: a directory next
to the sandbox's mounts holding a secret the agent must not be able to read or overwrite through
symlinks it plants in its workspace.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import sys
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandbox_runtime.files import FileAccessError, SandboxFiles

SECRET = b"TOPSECRET-host-data"
MB = 1 << 20


@dataclass
class Env:
    files: SandboxFiles
    ws: Path
    tmp: Path
    outside: Path
    secret: Path


@pytest.fixture
def env(tmp_path: Path) -> Env:
    ws = tmp_path / "sb" / "workspace"
    tmp = tmp_path / "sb" / "tmp"
    outside = tmp_path / "outside"
    for d in (ws, tmp, outside):
        d.mkdir(parents=True)
    secret = outside / "secret.txt"
    secret.write_bytes(SECRET)
    files = SandboxFiles({"/workspace": ws, "/tmp": tmp}, workdir="/workspace")
    return Env(files, ws, tmp, outside, secret)


def assert_refused(exc: pytest.ExceptionInfo[FileAccessError], status: int, *fragments: str) -> None:
    assert exc.value.status == status, str(exc.value)
    for fragment in fragments:
        assert fragment in str(exc.value)


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None], gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def reg(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def sym(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


def hard(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE
    info.linkname = target
    return info, None


def special(name: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info, None


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- basic read / write ---------------------------------------------------------------------------


def test_write_read_round_trip_creates_parents(env: Env) -> None:
    assert env.files.write("/workspace/a/b/c.txt", b"hello") == 5
    assert (env.ws / "a" / "b" / "c.txt").read_bytes() == b"hello"
    assert (env.ws / "a" / "b").is_dir()
    assert env.files.read("/workspace/a/b/c.txt", max_bytes=100) == b"hello"
    # Overwrite truncates: a shorter write leaves no tail of the old content.
    assert env.files.write("/workspace/a/b/c.txt", b"hi") == 2
    assert env.files.read("/workspace/a/b/c.txt", max_bytes=100) == b"hi"
    # The second mount works too, and duplicate slashes / '.' are normalised away.
    env.files.write("//tmp/./x//y.bin", b"\x00\x01")
    assert (env.tmp / "x" / "y.bin").read_bytes() == b"\x00\x01"


def test_relative_path_resolves_against_workdir(env: Env) -> None:
    env.files.write("src/a.py", b"print(1)\n")
    assert (env.ws / "src" / "a.py").read_bytes() == b"print(1)\n"
    assert env.files.read("/workspace/src/a.py", 100) == b"print(1)\n"

    nested = SandboxFiles({"/workspace": env.ws, "/tmp": env.tmp}, workdir="/workspace/proj")
    nested.write("x.txt", b"x")
    assert (env.ws / "proj" / "x.txt").read_bytes() == b"x"
    assert nested.read("./x.txt", 10) == b"x"


def test_workdir_must_be_inside_a_mount(env: Env) -> None:
    with pytest.raises(ValueError):
        SandboxFiles({"/workspace": env.ws}, workdir="/home")


@pytest.mark.parametrize("path", ["/workspace/../etc/passwd", "../x", "/workspace/a/../../b", "a/.."])
def test_dotdot_refused(env: Env, path: str) -> None:
    with pytest.raises(FileAccessError) as exc:
        env.files.write(path, b"x")
    assert_refused(exc, 400, "'..'")
    with pytest.raises(FileAccessError) as exc:
        env.files.read(path, 100)
    assert_refused(exc, 400, "'..'")
    assert tree(env.ws) == set() and tree(env.tmp) == set()


@pytest.mark.parametrize("path", ["/etc/passwd", "/workspacefoo/x", "/", "/state/sb/abc/workspace/x"])
def test_absolute_path_outside_mounts_refused(env: Env, path: str) -> None:
    with pytest.raises(FileAccessError) as exc:
        env.files.read(path, 100)
    assert_refused(exc, 400, "outside the sandbox's writable areas: /workspace, /tmp", repr(path))
    with pytest.raises(FileAccessError) as exc:
        env.files.write(path, b"x")
    assert_refused(exc, 400, "outside")


def test_nul_byte_refused(env: Env) -> None:
    with pytest.raises(FileAccessError) as exc:
        env.files.write("/workspace/a\0b", b"x")
    assert_refused(exc, 400, "NUL")
    with pytest.raises(FileAccessError) as exc:
        env.files.read("a\0", 10)
    assert_refused(exc, 400, "NUL")
    assert tree(env.ws) == set()


def test_read_missing_is_404(env: Env) -> None:
    with pytest.raises(FileAccessError) as exc:
        env.files.read("/workspace/nope/x.txt", 10)
    assert_refused(exc, 404, "/workspace/nope")


def test_read_directory_is_409(env: Env) -> None:
    (env.ws / "d").mkdir()
    with pytest.raises(FileAccessError) as exc:
        env.files.read("/workspace/d", 100)
    assert_refused(exc, 409, "'/workspace/d' is a directory")
    with pytest.raises(FileAccessError) as exc:
        env.files.read("/workspace", 100)
    assert_refused(exc, 409, "directory")
    with pytest.raises(FileAccessError) as exc:
        env.files.write("/workspace/d", b"x")
    assert_refused(exc, 409, "directory")


def test_file_used_as_directory_is_409(env: Env) -> None:
    (env.ws / "f").write_bytes(b"x")
    with pytest.raises(FileAccessError) as exc:
        env.files.write("/workspace/f/g.txt", b"y")
    assert_refused(exc, 409, "'/workspace/f'", "not a directory")
    assert (env.ws / "f").read_bytes() == b"x"


def test_read_over_limit_is_413(env: Env) -> None:
    (env.ws / "big").write_bytes(b"x" * 1001)
    with pytest.raises(FileAccessError) as exc:
        env.files.read("/workspace/big", max_bytes=1000)
    assert_refused(exc, 413, "1001 bytes", "1000-byte limit")
    assert env.files.read("/workspace/big", max_bytes=1001) == b"x" * 1001


def test_read_fifo_does_not_hang(env: Env) -> None:
    os.mkfifo(env.ws / "pipe")
    result: list[BaseException | bytes] = []

    def attempt() -> None:
        try:
            result.append(env.files.read("/workspace/pipe", 100))
        except BaseException as exc:  # handed to the main thread
            result.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "read() blocked opening a FIFO"
    assert isinstance(result[0], FileAccessError) and result[0].status == 400


# -- symlinks planted by the agent ----------------------------------------------------------------


def test_symlink_to_outside_refused_for_read(env: Env) -> None:
    (env.ws / "link").symlink_to(env.secret)
    with pytest.raises(FileAccessError) as exc:
        env.files.read("/workspace/link", 1000)
    assert_refused(exc, 400, "'/workspace/link' is a symbolic link; the file API does not follow links")


def test_symlink_to_outside_refused_for_write(env: Env) -> None:
    (env.ws / "link").symlink_to(env.secret)
    (env.ws / "dangling").symlink_to(env.outside / "created-by-server")
    for path in ("/workspace/link", "dangling"):
        with pytest.raises(FileAccessError) as exc:
            env.files.write(path, b"pwned")
        assert_refused(exc, 400, "symbolic link")
    assert env.secret.read_bytes() == SECRET  # not truncated, not overwritten
    assert not (env.outside / "created-by-server").exists()
    assert (env.ws / "link").is_symlink()


def test_symlink_in_intermediate_component_refused(env: Env) -> None:
    (env.ws / "dirlink").symlink_to(env.outside)
    (env.ws / "a").mkdir()
    (env.ws / "a" / "l").symlink_to(env.outside, target_is_directory=True)
    with pytest.raises(FileAccessError) as exc:
        env.files.read("/workspace/dirlink/secret.txt", 1000)
    assert_refused(exc, 400, "'/workspace/dirlink' is a symbolic link")
    for path in ("/workspace/dirlink/new.txt", "/workspace/a/l/new.txt", "a/l/deeper/new.txt"):
        with pytest.raises(FileAccessError) as exc:
            env.files.write(path, b"pwned")
        assert_refused(exc, 400, "symbolic link")
    assert sorted(os.listdir(env.outside)) == ["secret.txt"]
    assert env.secret.read_bytes() == SECRET


def test_pack_stores_symlinks_as_links_never_dereferenced(env: Env) -> None:
    proj = env.ws / "proj"
    proj.mkdir()
    (proj / "ok.txt").write_bytes(b"fine")
    (proj / "leakdir").symlink_to(env.outside)
    (proj / "leakfile").symlink_to(env.secret)
    archive = env.files.pack("/workspace/proj", 10 * MB)
    assert SECRET not in gzip.decompress(archive)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"ok.txt", "leakdir", "leakfile"}
    assert members["leakdir"].issym() and members["leakdir"].linkname == str(env.outside)
    assert members["leakfile"].issym() and members["leakfile"].linkname == str(env.secret)


def test_pack_refuses_symlink_path(env: Env) -> None:
    (env.ws / "dirlink").symlink_to(env.outside)
    (env.ws / "filelink").symlink_to(env.secret)
    for path in ("/workspace/dirlink", "/workspace/filelink", "/workspace/dirlink/secret.txt"):
        with pytest.raises(FileAccessError) as exc:
            env.files.pack(path, 10 * MB)
        assert_refused(exc, 400, "symbolic link")


def test_unpack_refuses_to_write_through_planted_symlink_dir(env: Env) -> None:
    (env.ws / "out").symlink_to(env.outside)
    archive = tar_bytes(reg("out/secret.txt", b"pwned"), reg("out/new.txt", b"pwned"))
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace", archive)
    assert_refused(exc, 400, "'/workspace/out' is a symbolic link")
    # Target path itself going through the link is refused as well.
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/out/sub", tar_bytes(reg("x", b"pwned")))
    assert_refused(exc, 400, "symbolic link")
    assert sorted(os.listdir(env.outside)) == ["secret.txt"]
    assert env.secret.read_bytes() == SECRET


def test_unpack_replaces_planted_file_symlink_without_following(env: Env) -> None:
    (env.ws / "dst").mkdir()
    (env.ws / "dst" / "f").symlink_to(env.secret)
    (env.ws / "dst" / "l").symlink_to(env.secret)
    assert env.files.unpack("/workspace/dst", tar_bytes(reg("f", b"new"), sym("l", "f"))) == 2
    assert env.secret.read_bytes() == SECRET
    assert not (env.ws / "dst" / "f").is_symlink()
    assert (env.ws / "dst" / "f").read_bytes() == b"new"
    assert os.readlink(env.ws / "dst" / "l") == "f"


# -- pack / unpack --------------------------------------------------------------------------------


def test_pack_unpack_round_trip(env: Env) -> None:
    src = env.ws / "src"
    (src / "pkg" / "deep" / "er").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "top.txt").write_bytes(b"top")
    (src / "pkg" / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "pkg" / "private").write_bytes(b"p")
    (src / "pkg" / "private").chmod(0o600)
    (src / "pkg" / "deep" / "er" / "blob.bin").write_bytes(os.urandom(50_000))
    (src / "pkg" / "deep").chmod(0o750)
    (src / "link-to-file").symlink_to("pkg/run.sh")
    (src / "pkg" / "deep" / "up").symlink_to("../../top.txt")
    (src / "dirlink").symlink_to("pkg")

    archive = env.files.pack("/workspace/src", 10 * MB)
    assert archive[:2] == b"\x1f\x8b"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = tar.getnames()
    assert all(not n.startswith(("/", "./")) and ".." not in n.split("/") for n in names)
    assert "pkg/deep/er/blob.bin" in names

    count = env.files.unpack("/tmp/restore", archive)
    dst = env.tmp / "restore"
    assert count == len(names)
    assert tree(dst) == tree(src)
    for rel in tree(src):
        a, b = src / rel, dst / rel
        sa, sb = a.lstat(), b.lstat()
        assert stat.S_IFMT(sa.st_mode) == stat.S_IFMT(sb.st_mode), rel
        if a.is_symlink():
            assert os.readlink(a) == os.readlink(b), rel
            continue
        assert stat.S_IMODE(sa.st_mode) == stat.S_IMODE(sb.st_mode), rel
        if stat.S_ISREG(sa.st_mode):
            assert a.read_bytes() == b.read_bytes(), rel
            assert int(sa.st_mtime) == int(sb.st_mtime), rel


def test_pack_single_file(env: Env) -> None:
    (env.ws / "one.txt").write_bytes(b"solo")
    with tarfile.open(fileobj=io.BytesIO(env.files.pack("one.txt", MB))) as tar:
        (member,) = tar.getmembers()
        assert member.name == "one.txt"
        extracted = tar.extractfile(member)
        assert extracted is not None and extracted.read() == b"solo"


def test_pack_over_limit_is_413(env: Env) -> None:
    (env.ws / "d").mkdir()
    (env.ws / "d" / "noise").write_bytes(os.urandom(200_000))
    with pytest.raises(FileAccessError) as exc:
        env.files.pack("/workspace/d", 100_000)
    assert_refused(exc, 413, "'/workspace/d'", "100000-byte limit")
    assert len(env.files.pack("/workspace/d", 300_000)) > 100_000


def test_unpack_plain_tar_and_hardlink(env: Env) -> None:
    archive = tar_bytes(reg("a/b.txt", b"data", mode=0o640), hard("a/c.txt", "a/b.txt"), gz=False)
    assert env.files.unpack("out", archive) == 2
    assert (env.ws / "out" / "a" / "b.txt").read_bytes() == b"data"
    assert (env.ws / "out" / "a" / "c.txt").read_bytes() == b"data"
    assert stat.S_IMODE((env.ws / "out" / "a" / "b.txt").stat().st_mode) == 0o640


def test_unpack_strips_setuid_and_group_write(env: Env) -> None:
    env.files.unpack("/workspace", tar_bytes(reg("suid", b"x", mode=0o4777)))
    assert stat.S_IMODE((env.ws / "suid").stat().st_mode) == 0o755


@pytest.mark.parametrize(
    ("members", "fragment"),
    [
        ([reg("ok.txt", b"x"), reg("../evil", b"pwned")], "'..'"),
        ([reg("ok.txt", b"x"), reg("a/../../evil", b"pwned")], "'..'"),
        ([reg("ok.txt", b"x"), reg("/abs/evil", b"pwned")], "absolute"),
        ([sym("esc", "../../../outside"), reg("esc/evil", b"pwned")], "points outside"),
        ([sym("esc", "sub"), reg("esc/evil", b"pwned")], "lies below symlink member"),
        ([sym("abs", "/etc/passwd")], "points outside"),
        ([sym("s", "."), sym("e", "s/../outside")], "points outside"),
        ([hard("h", "../../outside/secret.txt")], "'..'"),
        ([hard("h", "nothing-before-me")], "earlier regular file"),
        ([reg("ok.txt", b"x"), special("dev", tarfile.CHRTYPE)], "special file"),
        ([special("fifo", tarfile.FIFOTYPE)], "special file"),
    ],
)
def test_unpack_hostile_archive_refused_and_writes_nothing(
    env: Env, members: list[tuple[tarfile.TarInfo, bytes | None]], fragment: str
) -> None:
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/dst", tar_bytes(*members))
    assert_refused(exc, 400, fragment)
    assert tree(env.ws) == set()  # validated up front: not even the target dir was created
    assert sorted(os.listdir(env.outside)) == ["secret.txt"]
    assert env.secret.read_bytes() == SECRET
    assert not (env.ws.parent / "evil").exists() and not (env.ws.parent.parent / "evil").exists()


@pytest.mark.parametrize("blob", [b"", b"this is not a tar archive at all" * 40, gzip.compress(b"x" * 5000)])
def test_unpack_garbage_is_400(env: Env, blob: bytes) -> None:
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/dst", blob)
    assert_refused(exc, 400, "malformed archive", "'/workspace/dst'")


def test_unpack_truncated_archive_is_400(env: Env) -> None:
    archive = tar_bytes(reg("big.bin", os.urandom(100_000)))
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/dst", archive[: len(archive) // 2])
    assert_refused(exc, 400, "malformed archive")


def test_concurrent_symlink_swaps_never_escape(env: Env) -> None:
    """The agent atomically re-points ``race`` between a workspace dir and the host while we work.

    A check-then-open implementation (realpath says "inside", then open the string) loses this
    race; the O_NOFOLLOW fd walk refuses every time and never reads or writes outside.
    """
    real = env.ws / "real"
    real.mkdir()
    (real / "secret.txt").write_bytes(b"decoy")
    race, fresh = env.ws / "race", env.ws / "race-new"
    race.symlink_to(real)
    stop = threading.Event()
    flips = 0

    def flip() -> None:
        nonlocal flips
        while not stop.is_set():
            for target in (env.outside, real):
                os.symlink(target, fresh)
                os.rename(fresh, race)  # atomic replace: race is always a link
                flips += 1

    flipper = threading.Thread(target=flip, daemon=True)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as the GIL allows
    flipper.start()
    try:
        for i in range(300):
            with pytest.raises(FileAccessError):
                env.files.write(f"/workspace/race/w{i % 7}.txt", b"pwned")
            with pytest.raises(FileAccessError):
                env.files.read("/workspace/race/secret.txt", 1000)
            with pytest.raises(FileAccessError):
                env.files.pack("/workspace/race", MB)
            with pytest.raises(FileAccessError):
                env.files.unpack("/workspace/race/sub", tar_bytes(reg("x", b"pwned")))
    finally:
        stop.set()
        flipper.join(5)
        sys.setswitchinterval(old_interval)
    assert flips > 20  # the flipper really ran concurrently
    assert sorted(os.listdir(env.outside)) == ["secret.txt"]
    assert sorted(os.listdir(real)) == ["secret.txt"]
    assert env.secret.read_bytes() == SECRET
