"""The image store on its own: formats told apart by their bytes, one unpack per content, the cache across
restarts and crashes, tags, and what it refuses. Real files (tests/image_fixtures.py), no sandbox."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

import pytest

from sandbox_runtime.images import ImageError, ImageStore, detect_format, sif_root_partition, tree_bytes
from sandbox_runtime.models import SandboxSpec

from . import image_fixtures

pytestmark = pytest.mark.skipif(bool(image_fixtures.MISSING_TOOLS), reason=image_fixtures.SKIP_REASON)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return image_fixtures.build_all(tmp_path_factory.mktemp("images"))


@pytest.fixture
def images(tmp_path, built) -> Path:
    directory = tmp_path / "images"
    shutil.copytree(built, directory, symlinks=True)
    return directory


def store(images: Path, cache: Path) -> ImageStore:
    result = ImageStore([images], cache)
    result.start()
    return result


def tree(root: Path) -> dict[str, str]:
    """Every path below `root` with what it is: a link's target, 'dir', or a file's leading bytes."""

    def what(path: Path) -> str:
        if path.is_symlink():
            return path.readlink().as_posix()
        return "dir" if path.is_dir() else path.read_bytes().hex()[:64]

    return {str(p.relative_to(root)): what(p) for p in sorted(root.rglob("*"))}


def test_formats_come_from_the_bytes_not_the_name(images):
    assert {n: detect_format(images / n) for n in ("tiny.rootfs", "tiny.sif", "tiny.oci", "tiny.docker.tar")} == {
        "tiny.rootfs": "directory",
        "tiny.sif": "sif",
        "tiny.oci": "oci",
        "tiny.docker.tar": "docker-archive",
    }
    (images / "renamed.tar").write_bytes((images / "tiny.sif").read_bytes())
    assert detect_format(images / "renamed.tar") == "sif"
    (images / "text.sif").write_text("not an image")
    assert detect_format(images / "text.sif") is None


async def test_every_format_unpacks_to_the_same_root(images, tmp_path):
    images_store = store(images, tmp_path / "cache")
    expected = tree(images / "tiny.rootfs")
    for name in ("tiny.sif", "tiny.docker.tar"):
        unpacked = await images_store.prepare(images_store.find(name))
        assert unpacked.root is not None and tree(unpacked.root) == expected, name
    oci = await images_store.prepare(images_store.find("tiny.oci"))
    assert oci.root is not None
    assert tree(oci.root) == {**expected, "etc/added": tree(oci.root)["etc/added"]}  # /etc/gone whited out
    assert oci.env == {"PRORL_IMAGE": "tiny", "PATH": "/usr/bin:/bin"}


async def test_one_unpack_per_content_however_many_ask(images, tmp_path):
    shutil.copy(images / "tiny.sif", images / "same-content.sif")
    images_store = store(images, tmp_path / "cache")
    calls = 0
    unpack = images_store._unpack

    async def counting(image, entry):
        nonlocal calls
        calls += 1
        await unpack(image, entry)

    images_store._unpack = counting  # type: ignore[method-assign]
    results = await asyncio.gather(
        *(images_store.prepare(images_store.find(n)) for n in ["tiny.sif", "same-content.sif"] * 4)
    )
    assert calls == 1 and len({r.root for r in results}) == 1


async def test_the_cache_survives_a_restart_and_a_crash_mid_unpack(images, tmp_path):
    cache = tmp_path / "cache"
    first = await store(images, cache).prepare(store(images, cache).find("tiny.sif"))
    (cache / ".unpack-cut-short").mkdir()  # what a server killed mid-unpack leaves
    restarted = store(images, cache)
    assert not (cache / ".unpack-cut-short").exists()
    assert restarted.state(first.digest) == "unpacked"
    assert restarted.known_digest(restarted.find("tiny.sif")) == first.digest  # not hashed again
    again = await restarted.prepare(restarted.find("tiny.sif"))
    assert again.root == first.root


async def test_a_changed_file_is_a_new_image(images, tmp_path):
    images_store = store(images, tmp_path / "cache")
    before = await images_store.prepare(images_store.find("tiny.docker.tar"))
    shutil.rmtree(images / "tiny.rootfs" / "etc")
    (images / "tiny.rootfs" / "etc").mkdir()
    (images / "tiny.rootfs" / "etc" / "hello").write_text("changed\n")
    image_fixtures.build_docker_archive(images / "tiny.rootfs", images / "tiny.docker.tar")
    after = await images_store.prepare(images_store.find("tiny.docker.tar"))
    assert after.digest != before.digest
    assert after.root is not None and (after.root / "etc" / "hello").read_text() == "changed\n"


async def test_a_backend_that_runs_sif_gets_the_file_and_nothing_is_unpacked(images, tmp_path):
    images_store = store(images, tmp_path / "cache")
    unpacked = await images_store.prepare(images_store.find("tiny.sif"), runs_sif=True)
    assert unpacked.file == images / "tiny.sif" and unpacked.root is None
    assert unpacked.digest == await images_store.digest(images_store.find("tiny.sif"))  # still known by its digest
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["digests.json"]  # hashed, not unpacked
    oci = await images_store.prepare(images_store.find("tiny.oci"), runs_sif=True)  # others still unpack
    assert oci.root is not None and oci.root.is_dir()


def test_sif_partitions(images, tmp_path):
    offset, size = sif_root_partition(images / "tiny.sif")
    with open(images / "tiny.sif", "rb") as handle:
        handle.seek(offset)
        assert handle.read(4) == b"hsqs"  # squashfs's magic, where the descriptor says
    assert size > 0
    no_root = tmp_path / "labels-only.sif"
    image_fixtures.subprocess.run(["siftool", "new", str(no_root)], check=True, capture_output=True)
    with pytest.raises(ImageError, match="no primary system partition"):
        sif_root_partition(no_root)


async def test_tags(images, tmp_path):
    images_store = store(images, tmp_path / "cache")
    assert images_store.find("tiny.oci:latest").tag == "latest"
    with pytest.raises(ImageError, match="only OCI layouts and docker archives have tags"):
        images_store.find("tiny.sif:latest")
    with pytest.raises(ImageError, match="no tag 'v2'"):
        await images_store.digest(images_store.find("tiny.oci:v2"))
    two = images / "two.docker.tar"
    image_fixtures.build_docker_archive(images / "tiny.rootfs", two, repo_tag="tiny:v1")
    with pytest.raises(ImageError, match="no tag 'latest'"):
        await images_store.digest(images_store.find("two.docker.tar:latest"))
    assert await images_store.digest(images_store.find("two.docker.tar")) == await images_store.digest(
        images_store.find("two.docker.tar:v1")
    )


def test_names_stay_below_the_image_directories(images, tmp_path):
    images_store = store(images, tmp_path / "cache")
    (images / "out").symlink_to(tmp_path)
    with pytest.raises(ImageError, match="no image named"):
        images_store.find("out")
    with pytest.raises(ImageError, match="no image named"):
        images_store.find("missing.sif")
    for bad in ["../x.sif", "/abs.sif", "a:b:c", "x:", ":tag", "x:-t"]:
        with pytest.raises(ValueError, match="image"):
            SandboxSpec(image=bad)
    assert SandboxSpec(image="sub/dir/python.oci:3.11-slim").image == "sub/dir/python.oci:3.11-slim"


async def test_the_listing(images, tmp_path):
    (images / "nested" / "deeper").mkdir(parents=True)
    shutil.copy(images / "tiny.sif", images / "nested" / "deeper" / "n.sif")
    (images / ".hidden.sif").write_bytes((images / "tiny.sif").read_bytes())
    (images / "notes.txt").write_text("not an image")
    images_store = store(images, tmp_path / "cache")
    listed = {i.name: i for i in images_store.image_list().images}
    assert set(listed) == {"tiny.rootfs", "tiny.sif", "tiny.oci", "tiny.docker.tar", "nested/deeper/n.sif"}
    assert listed["tiny.sif"].digest is None and listed["tiny.sif"].cache == "not unpacked"
    assert listed["tiny.oci"].digest is not None
    await images_store.prepare(images_store.find("tiny.sif"))
    relisted = {i.name: i for i in images_store.image_list().images}
    assert relisted["tiny.sif"].cache == "unpacked" and relisted["tiny.sif"].digest
    assert relisted["nested/deeper/n.sif"].digest is None  # another file: hashed at its first use, not listed
    memo = json.loads((tmp_path / "cache" / "digests.json").read_text())
    assert relisted["tiny.sif"].digest in memo.values()


async def test_the_cache_keeps_to_its_size_and_never_evicts_what_runs(images, tmp_path):
    running: set[str] = set()
    names = ["tiny.sif", "tiny.oci", "tiny.docker.tar"]
    probe = store(images, tmp_path / "probe")
    sizes = [(await probe.prepare(probe.find(n))).root for n in names]
    one = max(tree_bytes(root) for root in sizes if root)
    images_store = ImageStore([images], tmp_path / "cache", max_bytes=int(one * 1.5), in_use=lambda: running)
    images_store.start()
    first = await images_store.prepare(images_store.find("tiny.sif"))
    running.add(str(first.digest))  # a sandbox runs it
    second = await images_store.prepare(images_store.find("tiny.oci"))
    assert images_store.state(first.digest) == "unpacked"  # over the size, but in use: kept
    assert images_store.state(second.digest) == "unpacked"  # just unpacked for its caller: kept
    running.clear()
    third = await images_store.prepare(images_store.find("tiny.docker.tar"))
    states = {d: images_store.state(d) for d in (first.digest, second.digest, third.digest)}
    assert states[third.digest] == "unpacked"
    assert list(states.values()).count("unpacked") == 1  # the two least recently used went
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".evict-")]
    again = await images_store.prepare(images_store.find("tiny.sif"))  # an evicted image unpacks again
    assert again.root is not None and (again.root / "etc" / "hello").is_file()


def _sif_of(root: Path, sif: Path) -> Path:
    """A SIF of `root` keeping its owners (the fixture's builder makes everything root's)."""
    squashfs = sif.with_suffix(".squashfs")
    image_fixtures.subprocess.run(["mksquashfs", str(root), str(squashfs), "-quiet", "-no-progress"], check=True)
    image_fixtures.subprocess.run(["siftool", "new", str(sif)], check=True, capture_output=True)
    partition = ["--datatype", "4", "--parttype", "2", "--partfs", "1", "--partarch", "2", "--groupid", "1"]
    image_fixtures.subprocess.run(
        ["siftool", "add", str(sif), str(squashfs), *partition], check=True, capture_output=True
    )
    return sif


@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's unpack: needs root (as CI runs)")
async def test_what_a_root_server_unpacks_gives_no_host_user_anything(images, tmp_path):
    root = tmp_path / "hostile"
    shutil.copytree(images / "tiny.rootfs", root, symlinks=True)
    shutil.copy(root / "usr" / "bin" / "bash", root / "usr" / "bin" / "suid-bash")
    os.chmod(root / "usr" / "bin" / "suid-bash", 0o4755)
    (root / "opt" / "conda").mkdir(parents=True)
    os.chmod(root / "opt" / "conda", 0o777)
    (root / "etc" / "theirs").write_text("owned by uid 1000")
    os.chown(root / "etc" / "theirs", 1000, 1000)
    os.mkfifo(root / "etc" / "fifo")
    os.mknod(root / "etc" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    _sif_of(root, images / "hostile.sif")
    unpacked = await store(images, tmp_path / "cache").prepare(store(images, tmp_path / "cache").find("hostile.sif"))
    assert unpacked.root is not None
    found = {p.relative_to(unpacked.root).as_posix(): os.lstat(p) for p in unpacked.root.rglob("*")}
    assert "etc/fifo" not in found and "etc/null" not in found
    assert found["etc/theirs"].st_uid == 0 and found["usr/bin/suid-bash"].st_mode & stat.S_ISUID == 0
    assert all(not s.st_mode & (stat.S_IWGRP | stat.S_IWOTH) for s in found.values() if not stat.S_ISLNK(s.st_mode))
    assert all(s.st_uid == 0 for s in found.values())


async def test_a_file_rewritten_behind_the_cache_is_a_new_image(images, tmp_path):
    """Its owner can set the mtime back, not the ctime: the same size and mtime is not the same file."""
    images_store = store(images, tmp_path / "cache")
    first = await images_store.digest(images_store.find("tiny.sif"))
    sif = images / "tiny.sif"
    times = os.stat(sif)
    data = bytearray(sif.read_bytes())
    data[-1] ^= 0xFF
    sif.write_bytes(bytes(data))
    os.utime(sif, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert await images_store.digest(images_store.find("tiny.sif")) != first


async def test_an_unpack_outlives_the_request_that_started_it(images, tmp_path):
    images_store = store(images, tmp_path / "cache")
    image = images_store.find("tiny.docker.tar")
    request = asyncio.ensure_future(images_store.prepare(image))
    while not images_store._unpacks:  # the unpack task is under way
        await asyncio.sleep(0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    again = await images_store.prepare(image)  # waits for that same unpack, which went on
    assert again.root is not None and (again.root / "etc" / "hello").is_file()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".unpack-")]


def _write_blob(layout: Path, value: dict) -> tuple[str, int]:
    data = json.dumps(value).encode()
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return "sha256:" + digest, len(data)


def _retag(layout: Path, entries: list[dict]) -> None:
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": entries}))


async def test_a_multi_platform_index_gives_this_machines_image(images, tmp_path):
    layout = images / "tiny.oci"
    manifest = json.loads((layout / "index.json").read_text())["manifests"][0]
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    other = {**manifest, "platform": {"os": "linux", "architecture": "s390x" if arch != "s390x" else "arm64"}}
    ours = {**manifest, "platform": {"os": "linux", "architecture": arch}}
    digest, size = _write_blob(
        layout, {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [other, ours]}
    )
    _retag(
        layout,
        [
            {
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "digest": digest,
                "size": size,
                "annotations": {"org.opencontainers.image.ref.name": "multi"},
            }
        ],
    )
    images_store = store(images, tmp_path / "cache")
    unpacked = await images_store.prepare(images_store.find("tiny.oci:multi"))
    assert unpacked.digest == manifest["digest"].removeprefix("sha256:")
    assert unpacked.root is not None and (unpacked.root / "etc" / "added").is_file()


async def test_zstd_layers_are_refused_saying_what_to_do(images, tmp_path):
    layout = images / "tiny.oci"
    entry = json.loads((layout / "index.json").read_text())["manifests"][0]
    manifest = json.loads((layout / "blobs" / "sha256" / entry["digest"].removeprefix("sha256:")).read_bytes())
    for layer in manifest["layers"]:
        layer["mediaType"] = "application/vnd.oci.image.layer.v1.tar+zstd"
    digest, size = _write_blob(layout, manifest)
    _retag(layout, [{**entry, "digest": digest, "size": size}])
    images_store = store(images, tmp_path / "cache")
    with pytest.raises(ImageError, match="zstd") as caught:
        await images_store.prepare(images_store.find("tiny.oci"))
    assert caught.value.status == 400


async def test_paths_with_colons_and_untagged_images(images, tmp_path):
    cache = tmp_path / "state:with:colons"
    images_store = store(images, cache)
    unpacked = await images_store.prepare(images_store.find("tiny.oci"))  # umoci splits --image at ':'
    assert unpacked.root is not None and unpacked.root.is_dir()
    layout = images / "tiny.oci"
    entry = json.loads((layout / "index.json").read_text())["manifests"][0]
    _retag(layout, [{k: v for k, v in entry.items() if k != "annotations"}])  # `docker save <id>`: no tag
    assert images_store.find("tiny.oci").tag is None
    assert (await images_store.prepare(images_store.find("tiny.oci"))).digest == unpacked.digest


def test_a_damaged_sif_is_refused(images, tmp_path):
    data = bytearray((images / "tiny.sif").read_bytes())
    struct.pack_into("<q", data, 32 + 10 + 3 + 3 + 16 + 8 * 4, 1 << 40)  # the descriptors' offset, past the end
    (tmp_path / "bad.sif").write_bytes(bytes(data))
    with pytest.raises(ImageError, match="damaged SIF"):
        sif_root_partition(tmp_path / "bad.sif")


def test_the_listing_gives_only_names_a_spec_can_give(images, tmp_path):
    shutil.copy(images / "tiny.sif", images / "python:3.11.sif")  # ':' would name a tag
    listed = {i.name for i in store(images, tmp_path / "cache").image_list().images}
    assert "python:3.11.sif" not in listed and "tiny.sif" in listed


async def test_a_client_that_gives_up_during_a_first_use_gets_no_sandbox(images, tmp_path):
    """The unpack goes on for the next client; the sandbox the first one asked for is never made."""
    from aiohttp.test_utils import TestServer

    from sandbox_runtime.client import SandboxClient, SandboxUnreachable
    from sandbox_runtime.config import ServerConfig
    from sandbox_runtime.server import MANAGER, create_app

    base = Path(tempfile.mkdtemp(prefix="prorl-test-images-"))  # reachable by a root server's sandbox uids
    base.chmod(0o711)
    (base / "images").mkdir()
    shutil.copy(images / "tiny.sif", base / "images" / "tiny.sif")
    backend = "bwrap" if shutil.which("bwrap") else "local"
    config = ServerConfig(
        state_dir=base / "state", backend=backend, allow_local=backend == "local", image_dirs=[base / "images"]
    )
    release = asyncio.Event()
    try:
        async with TestServer(create_app(config)) as server:
            store_ = server.app[MANAGER].images
            unpack = store_._unpack

            async def slow(image, entry):
                await release.wait()
                await unpack(image, entry)

            store_._unpack = slow  # type: ignore[method-assign]
            url = str(server.make_url("")).rstrip("/")
            async with SandboxClient(url, timeout=0.5) as impatient:
                with pytest.raises(SandboxUnreachable):
                    await impatient.create_sandbox(image="tiny.sif")
            release.set()
            async with SandboxClient(url) as patient:
                box = await patient.create_sandbox(image="tiny.sif")
                assert [b.id for b in await patient.list_sandboxes()] == [box.id]
                await patient.delete_sandbox(box.id)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_a_gzipped_docker_archive_is_the_same_image(images, tmp_path):
    with open(images / "tiny.docker.tar", "rb") as plain, gzip.open(images / "tiny.docker.tar.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    assert detect_format(images / "tiny.docker.tar.gz") == "docker-archive"
    images_store = store(images, tmp_path / "cache")
    unpacked = await images_store.prepare(images_store.find("tiny.docker.tar.gz"))
    assert unpacked.root is not None and tree(unpacked.root) == tree(images / "tiny.rootfs")


# An image store on a small tmpfs of its own, in a private mount namespace (nothing is mounted on the host's).
ON_SMALL_CACHE = """
import asyncio, json, sys
from pathlib import Path
from sandbox_runtime.images import ImageError, ImageStore

async def main():
    store = ImageStore([Path(sys.argv[1])], Path(sys.argv[2]))
    store.start()
    try:
        await store.prepare(store.find(sys.argv[3]))
        answer = {"status": 200}
    except ImageError as exc:
        answer = {"status": exc.status, "error": str(exc)}
    answer["left"] = sorted(p.name for p in Path(sys.argv[2]).iterdir() if p.name != "digests.json")
    print(json.dumps(answer))

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("room", ["less than the file", "the file, not its unpacked root"])
def test_a_cache_without_room_for_the_image_is_a_507_that_leaves_nothing(images, tmp_path, room):
    sif = images / "tiny.sif"
    unpacked = tree_bytes(images / "tiny.rootfs")
    assert unpacked > 2 * sif.stat().st_size + (256 << 10), "the test needs an image that compresses"
    size = sif.stat().st_size // 2 if room == "less than the file" else sif.stat().st_size + (128 << 10)
    cache = tmp_path / "cache"
    cache.mkdir()
    mount = f'mount -t tmpfs -o size={size} tmpfs {cache} && exec "$0" -c "$1" {images} {cache} tiny.sif'
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, sys.executable, ON_SMALL_CACHE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["status"] == 507 and "no space" in answer["error"], answer
    assert answer["left"] == []  # no half-unpacked root stays behind


# -- an image that expands far beyond its file: the cache's bound holds during the unpack --------------------------
BOMB_BYTES = 512 << 20  # what the layer expands to: 512 MiB of zeros, about half a MiB gzip'd
BOMB_BOUND = 64 << 20  # the cache's bound in these tests


class _ZeroTar(io.RawIOBase):
    """A tar of one file of `size` zero bytes, read as a stream: nothing of it is ever held or written whole."""

    def __init__(self, size: int) -> None:
        info = tarfile.TarInfo("zeros")
        info.size = size
        self._header = info.tobuf(format=tarfile.GNU_FORMAT)
        self._left = len(self._header) + size + (-size % 512) + 1024  # data padded to a block, then the end
        self._sent = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._left)
        for i in range(count):
            position = self._sent + i
            if position >= len(self._header):
                buffer[i:count] = bytes(count - i)
                break
            buffer[i] = self._header[position]
        self._sent += count
        self._left -= count
        return count

    @property
    def size(self) -> int:
        return self._left + self._sent


def _gzip_of(stream: io.RawIOBase) -> tuple[bytes, str]:
    """The gzip of what `stream` reads, and the sha256 of what it read (a layer's diff id)."""
    packer, digest = zlib.compressobj(9, zlib.DEFLATED, 31), hashlib.sha256()  # 31: a gzip header, as layers have
    parts = []
    for chunk in iter(lambda: stream.read(1 << 20), b""):
        digest.update(chunk)
        parts.append(packer.compress(chunk))
    return b"".join(parts) + packer.flush(), "sha256:" + digest.hexdigest()


def _bomb_config(diff_id: str) -> dict:
    """A config umoci takes: before the bound, nothing else about the image is wrong."""
    return {"architecture": "amd64", "os": "linux", "config": {}, "rootfs": {"type": "layers", "diff_ids": [diff_id]}}


def _bomb_layout(layout: Path) -> Path:
    """An OCI layout whose one gzip'd layer of ~0.5 MiB holds a file of BOMB_BYTES."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    layer, diff_id = _gzip_of(_ZeroTar(BOMB_BYTES))
    assert len(layer) < 1 << 20
    layer_digest = hashlib.sha256(layer).hexdigest()
    (layout / "blobs" / "sha256" / layer_digest).write_bytes(layer)
    config, config_size = _write_blob(layout, _bomb_config(diff_id))
    manifest, manifest_size = _write_blob(
        layout,
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": config_size},
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": "sha256:" + layer_digest,
                    "size": len(layer),
                }
            ],
        },
    )
    _retag(
        layout, [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest, "size": manifest_size}]
    )
    return layout


def _bomb_archive(archive: Path) -> Path:
    """A gzip'd classic `docker save` archive of ~0.5 MiB whose layer.tar is BOMB_BYTES of tar."""
    _, diff_id = _gzip_of(_ZeroTar(BOMB_BYTES))
    config = json.dumps(_bomb_config(diff_id)).encode()
    manifest = json.dumps([{"Config": "config.json", "RepoTags": ["bomb:latest"], "Layers": ["l/layer.tar"]}])
    with tarfile.open(archive, mode="w:gz", compresslevel=9) as tar:
        layer = _ZeroTar(BOMB_BYTES)
        for name, size, content in [
            ("config.json", len(config), io.BytesIO(config)),
            ("manifest.json", len(manifest), io.BytesIO(manifest.encode())),
            ("l/layer.tar", layer.size, layer),
        ]:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, content)
    assert archive.stat().st_size < 1 << 20
    return archive


def _bomb_sif(images: Path, tmp_path: Path) -> Path:
    """A SIF of a few KB whose root holds a sparse file of BOMB_BYTES (squashfs keeps its holes as holes)."""
    root = tmp_path / "bomb-root"
    shutil.copytree(images / "tiny.rootfs", root, symlinks=True)
    with open(root / "zeros", "wb") as handle:
        handle.truncate(BOMB_BYTES)
    sif = _sif_of(root, images / "bomb.sif")
    assert sif.stat().st_size < 4 << 20
    return sif


@pytest.mark.parametrize("kind", ["oci", "docker-archive", "sif"])
async def test_an_image_expanding_beyond_the_cache_bound_is_refused_before_it_is_written(images, tmp_path, kind):
    name = {"oci": "bomb.oci", "docker-archive": "bomb.tar.gz", "sif": "bomb.sif"}[kind]
    if kind == "oci":
        _bomb_layout(images / name)
    elif kind == "docker-archive":
        _bomb_archive(images / name)
    else:
        _bomb_sif(images, tmp_path)
    cache = tmp_path / "cache"
    images_store = ImageStore([images], cache, max_bytes=BOMB_BOUND)
    images_store.start()
    with pytest.raises(ImageError, match="no space in the image cache") as caught:
        await images_store.prepare(images_store.find(name))
    assert caught.value.status == 507
    assert str(BOMB_BOUND) in str(caught.value) or "free" in str(caught.value)
    assert [p.name for p in cache.iterdir() if p.name != "digests.json"] == []  # no partial directory stays
    # The bound is on what an image unpacks to, not its file: an image within it still unpacks.
    assert (await images_store.prepare(images_store.find("tiny.oci"))).root is not None


async def test_a_sif_listing_line_over_64_kib_is_refused_as_the_images_fault(tmp_path, monkeypatch):
    """unsquashfs lists each entry on a line; a line over the stream's 64 KiB limit raised ValueError (a 500)."""
    from sandbox_runtime import images as images_module
    from sandbox_runtime.image_formats import UnpackBudget
    from sandbox_runtime.images import Image

    real_exec = asyncio.create_subprocess_exec

    async def long_listing(*argv, **kwargs):  # stands in for unsquashfs -lln on a crafted image
        return await real_exec(
            sys.executable, "-c", "print('-rw-r--r-- 0/0 1 2024-01-01 00:00 /' + 'a' * 70000)", **kwargs
        )

    monkeypatch.setattr(images_module, "sif_root_partition", lambda path: (0, 0))
    monkeypatch.setattr(asyncio, "create_subprocess_exec", long_listing)
    store = ImageStore([tmp_path], tmp_path / "cache", 1 << 30)
    image = Image("crafted.sif", tmp_path / "crafted.sif", "sif")
    with pytest.raises(ImageError, match="over 64 KiB") as refused:
        await store._spend_sif(image, UnpackBudget(None, 1 << 30, "room"))
    assert refused.value.status == 400
