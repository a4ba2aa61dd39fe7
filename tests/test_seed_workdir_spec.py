"""`seed_workdir`: the spec's rule (it needs an image) and the copy itself (host_tree.seed_workspace), on plain
directories; integration_tests/test_seed_workdir.py runs it through real servers and sandboxes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandbox_runtime.host_tree import SeedError, empty_directory, seed_workspace
from sandbox_runtime.models import SandboxSpec
from tests.image_fixtures import SEED_MTIME, listing, seed_tree


def test_seed_workdir_is_off_by_default_and_needs_an_image():
    assert SandboxSpec().seed_workdir is False
    assert SandboxSpec(image="swe/x.sif", workdir="/testbed", seed_workdir=True).seed_workdir is True
    with pytest.raises(ValidationError, match=r"seed_workdir .* needs an `image`"):
        SandboxSpec(workdir="/testbed", seed_workdir=True)
    with pytest.raises(ValidationError):  # strict, as every field: no "true" string
        SandboxSpec.model_validate({"image": "x.sif", "seed_workdir": "true"})


def test_seed_workdir_is_in_the_openapi_schema():
    schema = SandboxSpec.model_json_schema()["properties"]["seed_workdir"]
    assert schema["type"] == "boolean" and schema["default"] is False and "wipe" in schema["description"]


@pytest.fixture
def image(tmp_path) -> Path:
    """A root whose /srv/testbed is image_fixtures.seed_tree, with a FIFO and a link to a host directory too."""
    root = tmp_path / "image"
    testbed = seed_tree(root / "srv" / "testbed")
    (testbed / "sub" / "deep").mkdir()
    (testbed / "sub" / "deep" / "data").write_bytes(bytes(range(256)) * 64)
    (testbed / "dir-link").symlink_to("/etc")
    os.mkfifo(testbed / "fifo")
    return root


def test_the_copy_keeps_links_modes_and_times_and_drops_setuid_and_fifos(image, tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    copied = seed_workspace(image, "/srv/testbed", workspace, None)
    source = listing(image / "srv" / "testbed")
    del source["fifo"]
    source["setuid"] = ("file", 0o755, b"s\n")
    assert listing(workspace) == source
    assert copied == sum(len(v[2]) for v in source.values() if v[0] == "file") + sum(
        len(v[1]) for v in source.values() if v[0] == "link"
    )
    assert (workspace / "a.txt").stat().st_mtime == SEED_MTIME
    assert (workspace / "dir-link").is_symlink() and os.readlink(workspace / "dir-link") == "/etc"
    empty_directory(workspace)  # a read-only directory of the seed is no obstacle to a wipe
    assert list(workspace.iterdir()) == []
    seed_workspace(image, "/srv/testbed", workspace, None)  # and the seed comes back as it was
    assert listing(workspace) == source


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_under_root_every_copy_is_the_sandboxs(image, tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    seed_workspace(image, "srv/testbed", workspace, 12345)
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in workspace.rglob("*")}
    assert owners == {(12345, 12345)}


@pytest.mark.parametrize("workdir", ["/nothere", "/srv/testbed/run.sh", "/srv/testbed/dir-link", "/srv/testbed/link"])
def test_no_directory_at_the_workdir_is_a_400(image, tmp_path, workdir):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with pytest.raises(SeedError, match=f"no directory at {workdir}") as caught:
        seed_workspace(image, workdir, workspace, None)
    assert caught.value.status == 400 and list(workspace.iterdir()) == []


def test_a_link_on_the_way_to_the_workdir_is_not_followed(image, tmp_path):
    (image / "via").symlink_to(image / "srv")  # would lead to a directory: still refused
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with pytest.raises(SeedError) as caught:
        seed_workspace(image, "/via/testbed", workspace, None)
    assert caught.value.status == 400


def test_over_the_budget_is_a_413(image, tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with pytest.raises(SeedError, match=r"limits\.disk_mb") as caught:
        seed_workspace(image, "/srv/testbed", workspace, None, max_bytes=1000)
    assert caught.value.status == 413


def test_a_stopped_copy_stops(image, tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    stop = threading.Event()
    stop.set()
    with pytest.raises(SeedError, match="cancelled"):
        seed_workspace(image, "/srv/testbed", workspace, None, stop=stop)
