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
import time
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


def folder(name: str, mode: int = 0o755) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
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
    assert (env.ws / "out" / "a" / "c.txt").samefile(env.ws / "out" / "a" / "b.txt")
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
        i = 0
        # 300 rounds, and on until the flipper has really run alongside (a loaded machine may starve it)
        while i < 300 or (flips <= 20 and i < 30_000):
            with pytest.raises(FileAccessError):
                env.files.write(f"/workspace/race/w{i % 7}.txt", b"pwned")
            with pytest.raises(FileAccessError):
                env.files.read("/workspace/race/secret.txt", 1000)
            with pytest.raises(FileAccessError):
                env.files.pack("/workspace/race", MB)
            with pytest.raises(FileAccessError):
                env.files.unpack("/workspace/race/sub", tar_bytes(reg("x", b"pwned")))
            i += 1
    finally:
        stop.set()
        flipper.join(5)
        sys.setswitchinterval(old_interval)
    assert flips > 20  # the flipper really ran concurrently
    assert sorted(os.listdir(env.outside)) == ["secret.txt"]
    assert sorted(os.listdir(real)) == ["secret.txt"]
    assert env.secret.read_bytes() == SECRET


# -- ownership ------------------------------------------------------------------------------------

OWNER = (4242, 4343)


def owned_files(env: Env) -> SandboxFiles:
    if os.geteuid() != 0:
        pytest.skip("only root can chown to another uid")
    return SandboxFiles({"/workspace": env.ws, "/tmp": env.tmp}, workdir="/workspace", owner=OWNER)


def owner_of(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid


def test_owner_gets_what_write_creates_and_overwrites(env: Env) -> None:
    files = owned_files(env)
    (env.ws / "old.txt").write_bytes(b"root's")
    files.write("/workspace/a/b/c.txt", b"hello")
    files.write("old.txt", b"new")
    for rel in ("a", "a/b", "a/b/c.txt", "old.txt"):
        assert owner_of(env.ws / rel) == OWNER, rel
    assert owner_of(env.ws) == (os.geteuid(), os.getegid())  # the mount itself is not ours to give


def test_owner_gets_everything_unpack_makes(env: Env) -> None:
    files = owned_files(env)
    archive = tar_bytes(
        folder("d", mode=0o700),
        reg("d/f", b"data"),
        reg("implicit/deep/g", b"g"),
        sym("d/l", "f"),
        hard("d/h", "d/f"),
        hard("other/h2", "implicit/deep/g"),
    )
    assert files.unpack("/workspace/out", archive) == 6
    out = env.ws / "out"
    for rel in ("", "d", "d/f", "implicit", "implicit/deep", "implicit/deep/g", "d/l", "d/h", "other", "other/h2"):
        assert owner_of(out / rel) == OWNER, rel
    assert (out / "d" / "l").is_symlink()
    assert (out / "d" / "h").samefile(out / "d" / "f")
    assert stat.S_IMODE((out / "d").stat().st_mode) == 0o700  # chown did not undo the mode


def test_no_owner_chowns_nothing(env: Env) -> None:
    env.files.write("a/b.txt", b"x")
    env.files.unpack("out", tar_bytes(folder("d"), reg("d/f", b"y"), sym("d/l", "f"), hard("d/h", "d/f")))
    me = (os.geteuid(), os.getegid())
    for rel in ("a", "a/b.txt", "out", "out/d", "out/d/f", "out/d/l", "out/d/h"):
        assert owner_of(env.ws / rel) == me, rel


def test_owner_not_given_to_a_hardlink_planted_to_a_host_file(env: Env) -> None:
    """The agent links a host file into its workspace and asks us to write it: no chown."""
    files = owned_files(env)
    os.link(env.secret, env.ws / "planted")
    files.write("planted", b"x")
    files.unpack("/workspace", tar_bytes(reg("planted", b"y")))
    assert owner_of(env.secret) == (os.geteuid(), os.getegid())


# -- size limits and disk budget ------------------------------------------------------------------


def test_write_over_file_limit_is_413_and_writes_nothing(env: Env) -> None:
    (env.ws / "keep.txt").write_bytes(b"old")
    for path in ("/workspace/new/dir/big.bin", "keep.txt"):
        with pytest.raises(FileAccessError) as exc:
            env.files.write(path, b"x" * 11, max_file_bytes=10)
        assert_refused(exc, 413, "11 bytes", "10-byte per-file limit")
    assert tree(env.ws) == {"keep.txt"}
    assert (env.ws / "keep.txt").read_bytes() == b"old"
    assert env.files.write("keep.txt", b"x" * 10, max_file_bytes=10) == 10


def test_unpack_member_over_file_limit_is_413_and_writes_nothing(env: Env) -> None:
    archive = tar_bytes(reg("small", b"x"), reg("dir/big", b"y" * 2000))
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/dst", archive, max_file_bytes=1000)
    assert_refused(exc, 413, "'dir/big'", "2000 bytes", "1000-byte per-file limit")
    assert tree(env.ws) == set()
    assert env.files.unpack("/workspace/dst", archive, max_file_bytes=2000) == 2


def test_unpack_over_disk_budget_is_413_and_writes_nothing(env: Env) -> None:
    archive = tar_bytes(*(reg(f"f{i}", b"z" * 400) for i in range(3)))
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/dst", archive, max_total_bytes=1000)
    assert_refused(exc, 413, "'/workspace/dst'", "1200 bytes", "1000-byte disk budget")
    assert tree(env.ws) == set()
    assert env.files.unpack("/workspace/dst", archive, max_total_bytes=1200) == 3


def test_unpack_hardlinks_stay_links_and_cost_no_budget(env: Env) -> None:
    """100 hardlinks to a 1 MB file: one inode on disk, not 101 MB of copies."""
    data = os.urandom(MB)
    archive = tar_bytes(reg("f", data), *(hard(f"links/h{i:03}", "f") for i in range(100)))
    before = env.files.usage()
    assert env.files.unpack("/workspace/dst", archive, max_file_bytes=MB, max_total_bytes=MB) == 101
    dst = env.ws / "dst"
    original = os.lstat(dst / "f")
    assert original.st_nlink == 101
    assert {os.lstat(p).st_ino for p in (dst / "links").iterdir()} == {original.st_ino}
    assert (dst / "links" / "h042").read_bytes() == data
    assert MB <= env.files.usage() - before < 2 * MB
    # Unpacking again over the result finds the links already in place.
    assert env.files.unpack("/workspace/dst", archive) == 101
    assert os.lstat(dst / "f").st_nlink == 101


def test_unpack_hardlink_replaces_file_or_link_but_not_directory(env: Env) -> None:
    dst = env.ws / "dst"
    dst.mkdir()
    (dst / "h").write_bytes(b"old")
    (dst / "planted").symlink_to(env.secret)
    (dst / "d").mkdir()
    archive = tar_bytes(reg("a/f", b"new"), hard("h", "a/f"), hard("planted", "a/f"), hard("h", "h"))
    assert env.files.unpack("/workspace/dst", archive) == 4
    for name in ("h", "planted"):
        assert not (dst / name).is_symlink() and (dst / name).samefile(dst / "a" / "f"), name
    assert env.secret.read_bytes() == SECRET
    with pytest.raises(FileAccessError) as exc:
        env.files.unpack("/workspace/dst", tar_bytes(reg("a/f", b"new"), hard("d", "a/f")))
    assert_refused(exc, 409, "'/workspace/dst/d' is a directory")
    assert (dst / "d").is_dir()


def test_pack_refuses_sparse_file_by_uncompressed_size(env: Env) -> None:
    """A sparse 1 GiB file gzips to a few KB; the content cap stops pack before reading it."""
    (env.ws / "d").mkdir()
    sparse = env.ws / "d" / "sparse"
    sparse.touch()
    os.truncate(sparse, 1 << 30)
    start = time.monotonic()
    for path in ("/workspace/d", "/workspace/d/sparse"):
        with pytest.raises(FileAccessError) as exc:
            env.files.pack(path, 10 * MB, max_content_bytes=10 * MB)
        assert_refused(exc, 413, repr(path), f"holds more than {10 * MB} bytes uncompressed")
    assert time.monotonic() - start < 2


def test_pack_content_cap_is_a_running_total(env: Env) -> None:
    for i in range(3):
        env.files.write(f"d/sub{i}/f", b"q" * 400)
    with pytest.raises(FileAccessError) as exc:
        env.files.pack("/workspace/d", MB, max_content_bytes=1000)
    assert_refused(exc, 413, "more than 1000 bytes uncompressed")
    assert env.files.pack("/workspace/d", MB, max_content_bytes=1200)


def test_usage_grows_by_what_was_written_and_never_follows_links(env: Env) -> None:
    before = env.files.usage()
    env.files.write("/workspace/a/blob", os.urandom(300_000))
    env.files.write("/tmp/b", os.urandom(100_000))
    grown = env.files.usage() - before
    assert 400_000 <= grown < 400_000 + 64 * 1024
    # A link to a big host file or directory costs only the link; a second name costs nothing.
    (env.outside / "huge").write_bytes(os.urandom(MB))
    (env.ws / "escape-dir").symlink_to(env.outside)
    (env.ws / "escape-file").symlink_to(env.outside / "huge")
    os.link(env.ws / "a" / "blob", env.ws / "blob-again")
    assert env.files.usage() - before - grown < 64 * 1024


def test_usage_is_quick_for_thousands_of_files(env: Env) -> None:
    for i in range(30):
        sub = env.ws / f"dir{i}"
        sub.mkdir()
        for j in range(100):
            (sub / f"f{j}").write_bytes(b"x")
    start = time.monotonic()
    assert env.files.usage() >= 3000  # at least one byte each; a block each on most filesystems
    assert time.monotonic() - start < 2


def test_usage_refuses_too_deep_a_tree(env: Env) -> None:
    """Rather than undercount: nesting must not hide data from the disk budget."""
    deep = env.tmp.joinpath(*["d"] * 257)
    deep.mkdir(parents=True)
    with pytest.raises(FileAccessError) as exc:
        env.files.usage()
    assert_refused(exc, 400, "nested more than 256 directories deep")
