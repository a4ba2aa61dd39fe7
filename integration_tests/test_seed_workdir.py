"""`seed_workdir` through the runtime as deployed, under a root server and an unprivileged one: the workspace
starts as a copy of the image's /testbed (a directory image and a SIF file of the same root), writable and the
sandbox's own, edits persist between commands, a wipe restores the seed exactly, the image and its cache are
never written, and a spec the image cannot seed is a 400 (413 over limits.disk_mb) that leaves nothing."""

from __future__ import annotations

import stat
from pathlib import Path

import aiohttp
import pytest

from sandbox_runtime.client import SandboxAPIError
from tests import image_fixtures
from tests.image_fixtures import listing

from .conftest import BACKEND_SKIPS, NOBODY, image_server, reachable

pytestmark = [
    pytest.mark.skipif(bool(image_fixtures.MISSING_TOOLS), reason=image_fixtures.SKIP_REASON),
    pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"])),
]

IMAGES = ("seed.rootfs", "seed.sif")
MTIME, SEEDED = image_fixtures.SEED_MTIME, image_fixtures.SEED_FILES


def seeded_root(target: Path) -> Path:
    """The tiny image's root with a /testbed (image_fixtures.seed_tree)."""
    image_fixtures.tiny_root(target)
    image_fixtures.seed_tree(target / "testbed")
    return target


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    directory = reachable(tmp_path_factory.mktemp("seed-images"))
    directory.chmod(0o755)
    seeded_root(directory / "seed.rootfs")
    image_fixtures.build_sif(directory / "seed.rootfs", directory / "seed.sif")
    (directory / "seed.sif").chmod(0o644)
    image_fixtures.tiny_root(directory / "plain.rootfs")  # no /testbed
    linked = image_fixtures.tiny_root(directory / "linked.rootfs")
    (linked / "testbed").symlink_to("/etc")  # a link in the image is never followed (on the host: the host's /etc)
    big = seeded_root(directory / "big.rootfs")
    (big / "testbed" / "big").write_bytes(bytes(3 << 20))
    return directory


@pytest.fixture(scope="module", params=["root", "unprivileged", "apptainer"])
def server(request, tmp_path_factory, image_dir):
    """bwrap under a root server and an unprivileged one; the apptainer backend (tests/standins/apptainer, run
    unprivileged), which is given the unpacked root of a SIF image, not the file, when it seeds."""
    yield from image_server(request.param, tmp_path_factory.mktemp(f"state-seed-{request.param}"), image_dir)


def image_testbed(server, image_dir: Path, name: str, digest: str | None) -> Path:
    """Where the image's /testbed lies on the host: in place for a directory, else in the server's cache."""
    if digest is None:
        return image_dir / name / "testbed"
    return server.state_dir / "images" / digest / "root" / "testbed"


def expected_seed(image_dir: Path) -> dict[str, tuple]:
    found = listing(image_dir / "seed.rootfs" / "testbed")
    mode = found["setuid"][1] & ~(stat.S_ISUID | stat.S_ISGID)
    return {**found, "setuid": ("file", mode, found["setuid"][2])}


@pytest.mark.parametrize("name", IMAGES)
async def test_the_workspace_starts_as_the_images_workdir(client, server, image_dir, name):
    box = await client.create_sandbox(image=name, workdir="/testbed", seed_workdir=True)
    try:
        workspace = server.state_dir / "sandboxes" / box.id / "workspace"
        cached = image_testbed(server, image_dir, name, box.image_digest)
        original = listing(cached)  # unsquashfs may have dropped the setuid bit already
        assert listing(workspace) == expected_seed(image_dir)
        # Times kept (git's index stays valid), links copied as links, never followed.
        assert (workspace / "a.txt").stat().st_mtime == MTIME
        owner = workspace.stat().st_uid  # the sandbox's own uid under root; the server's (nobody) unprivileged
        assert owner != 0 and (owner == NOBODY) == server.unprivileged
        assert {p.lstat().st_uid for p in [workspace, *workspace.rglob("*")]} == {owner}
        # The sandbox sees it at /testbed, writable, and the executable runs.
        result = await client.exec(
            box.id,
            "pwd; cat a.txt sub/b.txt link hello-link; ./run.sh; echo edited > a.txt; echo new > added; "
            "echo more > sub/more; echo $?",
        )
        assert result.output.splitlines() == [
            "/testbed",
            "original a",
            "original b",
            "original a",
            "hello from the image",
            "ran",
            "0",
        ]
        again = await client.exec(box.id, "cat a.txt added", session="other")  # edits persist between commands
        assert again.output == "edited\nnew\n"
        # Nothing was written into the image or its cache.
        assert listing(cached) == original
        # A wipe brings back the seed exactly: the edit undone, the added file gone, the modes as they were.
        await client.wipe(box.id)
        assert listing(workspace) == expected_seed(image_dir)
        after = await client.exec(box.id, "cat a.txt; ls added 2>/dev/null; echo $?")
        assert after.output == "original a\n2\n"
        assert listing(cached) == original
    finally:
        await client.delete_sandbox(box.id)


async def _post_raw(server, spec: dict) -> tuple[int, str]:
    """A spec the client's own model would refuse before sending: the server's answer to it."""
    async with aiohttp.ClientSession() as session, session.post(f"{server.url}/v1/sandboxes", json=spec) as reply:
        return reply.status, await reply.text()


def _nothing_left(server) -> None:
    assert [p.name for p in (server.state_dir / "sandboxes").iterdir()] == []


async def test_a_seed_needs_an_image(client, server):
    status, text = await _post_raw(server, {"seed_workdir": True, "workdir": "/testbed"})
    assert status == 400 and "seed_workdir" in text and "image" in text
    assert await client.list_sandboxes() == []
    _nothing_left(server)


@pytest.mark.parametrize(
    ("name", "workdir"), [("plain.rootfs", "/testbed"), ("linked.rootfs", "/testbed"), ("seed.sif", "/nothere")]
)
async def test_an_image_without_that_directory_is_a_400_and_leaves_nothing(client, server, name, workdir):
    with pytest.raises(SandboxAPIError) as caught:
        await client.create_sandbox(image=name, workdir=workdir, seed_workdir=True)
    assert caught.value.status == 400 and f"no directory at {workdir}" in str(caught.value)
    assert await client.list_sandboxes() == []
    _nothing_left(server)
    assert not (Path("/etc") / "a.txt").exists()


async def test_a_seed_over_the_disk_budget_is_a_413(client, server):
    with pytest.raises(SandboxAPIError) as caught:
        await client.create_sandbox(image="big.rootfs", workdir="/testbed", seed_workdir=True, limits={"disk_mb": 2})
    assert caught.value.status == 413 and "limits.disk_mb" in str(caught.value)
    assert await client.list_sandboxes() == []
    _nothing_left(server)
    box = await client.create_sandbox(image="big.rootfs", workdir="/testbed", seed_workdir=True, limits={"disk_mb": 8})
    try:
        assert (await client.exec(box.id, "ls big")).output == "big\n"
    finally:
        await client.delete_sandbox(box.id)


async def test_without_seed_the_workspace_hides_the_images_workdir(client, image_dir):
    box = await client.create_sandbox(image="seed.rootfs", workdir="/testbed")
    try:
        assert (await client.exec(box.id, "ls -A")).output == ""
    finally:
        await client.delete_sandbox(box.id)
