"""Images through the runtime as deployed: a root server (as CI runs it) and an unprivileged one, each given an
image directory holding the same small root as a directory, a SIF file, an OCI layout (two layers, a whiteout)
and a `docker save` archive (tests/image_fixtures.py). Each format runs a real bwrap sandbox whose root is the
image, read-only, with the workspace and /tmp writable; `GET /v1/images` lists them; bad names are 400s."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from sandbox_runtime.backends.base import DEFAULT_PATH
from sandbox_runtime.client import SandboxAPIError
from tests import image_fixtures

from .conftest import BACKEND_SKIPS, image_server, reachable

FORMATS = {"tiny.rootfs": "directory", "tiny.sif": "sif", "tiny.oci": "oci", "tiny.docker.tar": "docker-archive"}

pytestmark = [
    pytest.mark.skipif(bool(image_fixtures.MISSING_TOOLS), reason=image_fixtures.SKIP_REASON),
    pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"])),
]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    # Under the system temp dir, readable (umask 022) by the unprivileged server and the sandboxes' uids.
    directory = image_fixtures.build_all(reachable(tmp_path_factory.mktemp("images")))
    directory.chmod(0o755)  # listable: GET /v1/images walks it
    return directory


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def server(request, tmp_path_factory, image_dir):
    yield from image_server(request.param, tmp_path_factory.mktemp(f"state-images-{request.param}"), image_dir)


@pytest.mark.parametrize("name", FORMATS)
async def test_each_format_is_the_sandbox_root(client, name):
    box = await client.create_sandbox(image=name)
    try:
        hello = await client.exec(box.id, "cat /etc/hello; (cd /etc && echo *)")
        assert hello.exit_code == 0
        assert hello.output.startswith("hello from the image\n")
        listed = hello.output.splitlines()[1].split()
        assert "hello" in listed and "gone" not in listed  # the OCI image's second layer whited /etc/gone out
        assert ("added" in listed) == (name == "tiny.oci")  # and added /etc/added
        # Nothing of the host's root: the image has no python3, no /usr/bin/apt, no /home of the host.
        missing = await client.exec(box.id, "test -e /usr/bin/python3 || test -e /usr/bin/apt-get; echo $?")
        assert missing.output.strip() == "1"
        # The image is read-only; the workspace and /tmp are the sandbox's own.
        write = await client.exec(
            box.id, "echo x > /etc/planted; echo $?; echo y > /tmp/t && echo z > w && cat /tmp/t w"
        )
        assert write.output.splitlines()[-3:] == ["1", "y", "z"]
        assert (await client.read_file(box.id, f"{box.workdir}/w")) == b"z\n"
        info = await client.get_sandbox(box.id)
        assert info.image == name
        assert (info.image_digest is None) == (name == "tiny.rootfs")
    finally:
        await client.delete_sandbox(box.id)


async def test_an_oci_images_environment_reaches_the_shell(client):
    for name, expected in [("tiny.oci", "tiny"), ("tiny.docker.tar", "docker")]:
        box = await client.create_sandbox(image=name, env={"EXTRA": "spec"})
        try:
            result = await client.exec(box.id, 'echo "$PRORL_IMAGE $PATH $EXTRA"')
            assert result.output.strip() == f"{expected} /usr/bin:/bin spec"
            ran = await client.run(box.id, script='echo "$PRORL_IMAGE"')  # one-shot runs see it too
            assert ran.output.strip() == expected
        finally:
            await client.delete_sandbox(box.id)


async def test_a_sif_images_environment_scripts_run_first(client):
    box = await client.create_sandbox(image="tiny.sif", env={"PRORL_FROM_SCRIPT": "the spec wins"})
    try:
        result = await client.exec(box.id, 'echo "$PRORL_FROM_SCRIPT|$PATH"')
        assert result.output == f"the spec wins|/opt/tool/bin:{DEFAULT_PATH}\n"  # and no "Apptainer> " prompt
    finally:
        await client.delete_sandbox(box.id)


async def test_the_listing_shows_format_digest_and_cache(client, server):
    listing = {image.name: image for image in (await client.list_images()).images}
    assert {name.partition(":")[0] for name in listing} >= set(FORMATS)
    assert listing["tiny.oci"].format == "oci" and listing["tiny.oci"].digest
    assert listing["tiny.rootfs"].cache == "in place" and listing["tiny.rootfs"].digest is None
    box = await client.create_sandbox(image="tiny.sif")
    await client.delete_sandbox(box.id)
    after = {image.name: image for image in (await client.list_images()).images}
    assert after["tiny.sif"].cache == "unpacked"
    assert after["tiny.sif"].digest == box.image_digest


async def test_concurrent_first_uses_share_one_unpack(client, server, image_dir):
    copy = image_dir / "copy-of-tiny.sif"
    if not copy.exists():
        shutil.copy(image_dir / "tiny.sif", copy)
        copy.chmod(0o644)
    boxes = await asyncio.gather(*(client.create_sandbox(image=n) for n in ["copy-of-tiny.sif", "tiny.sif"] * 3))
    try:
        assert len({box.image_digest for box in boxes}) == 1  # the same content, however named: one cache entry
        entries = [p for p in (server.state_dir / "images").iterdir() if not p.name.startswith((".", "digests"))]
        assert sum(1 for p in entries if p.name == boxes[0].image_digest) == 1
        assert not [p for p in (server.state_dir / "images").iterdir() if p.name.startswith(".unpack-")]
    finally:
        await asyncio.gather(*(client.delete_sandbox(box.id) for box in boxes))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope.sif", "no image named"),
        ("tiny.sif:v1", "only OCI layouts and docker archives have tags"),
        ("tiny.oci:v9", "no tag 'v9'"),
        ("tiny.docker.tar:v9", "no tag 'v9'"),
        ("not-an-image.txt", "neither a SIF file"),
        ("escape", "no image named"),
    ],
)
async def test_bad_image_names_are_400s(client, image_dir, name, message):
    (image_dir / "not-an-image.txt").write_text("text")
    if not (image_dir / "escape").exists():
        (image_dir / "escape").symlink_to("/")  # a link out of the image directory is no image
    with pytest.raises(SandboxAPIError) as caught:
        await client.create_sandbox(image=name)
    assert caught.value.status == 400 and message in str(caught.value)
    assert await client.list_sandboxes() == []


async def test_a_corrupt_sif_is_refused_and_leaves_nothing(client, server, image_dir):
    broken = image_dir / "broken.sif"
    data = bytearray((image_dir / "tiny.sif").read_bytes())
    data[40000:60000] = bytes(20000)  # the squashfs's own header and tables
    broken.write_bytes(bytes(data))
    broken.chmod(0o644)
    with pytest.raises(SandboxAPIError) as caught:
        await client.create_sandbox(image="broken.sif")
    assert caught.value.status in (400, 500) and "broken.sif" in str(caught.value)
    assert await client.list_sandboxes() == []
    assert not [p for p in (server.state_dir / "images").iterdir() if p.name.startswith(".unpack-")]
