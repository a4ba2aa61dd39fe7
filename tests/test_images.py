"""The image store on its own: formats told apart by their bytes, one unpack per content, the cache across
restarts and crashes, tags, and what it refuses. Real files (tests/image_fixtures.py), no sandbox."""

from __future__ import annotations

import asyncio
import json
import shutil
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
    assert list((tmp_path / "cache").iterdir()) == []
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
    assert set(listed) == {"tiny.rootfs", "tiny.sif", "tiny.oci:latest", "tiny.docker.tar", "nested/deeper/n.sif"}
    assert listed["tiny.sif"].digest is None and listed["tiny.sif"].cache == "not unpacked"
    assert listed["tiny.oci:latest"].digest is not None
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
