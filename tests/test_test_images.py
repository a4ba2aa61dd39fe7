"""scripts/build_test_images.py without building: the cache key, where the cache lives, the cached fast path and
the link, and the layer writer's whiteouts. The real build runs in `make test-images`."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_test_images.py"


@pytest.fixture(scope="module")
def images():
    spec = importlib.util.spec_from_file_location("build_test_images", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def fake_repo(root: Path) -> Path:
    for name, text in {
        "scripts/test-images.sh": "#!/bin/sh\n",
        "scripts/build_test_images.py": "# builder\n",
        "scripts/test_images/README.md": "docs\n",
        "scripts/test_images/packages.txt": "bash\n",
        "scripts/test_images/testbed/calc/ops.py": "def add(a, b):\n    return a - b\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_key_covers_the_recipe_not_its_docs_or_test_leftovers(images, tmp_path):
    repo = fake_repo(tmp_path)
    key = images.recipe_key(repo, sources=[])
    assert key == images.recipe_key(repo, sources=[]) and len(key) == 16
    (repo / "scripts/test_images/README.md").write_text("more docs\n")
    (repo / "scripts/test_images/testbed/calc/__pycache__").mkdir()
    (repo / "scripts/test_images/testbed/calc/__pycache__/ops.cpython-311.pyc").write_bytes(b"\0")
    (repo / "scripts/test_images/testbed/.pytest_cache").mkdir()
    assert images.recipe_key(repo, sources=[]) == key
    (repo / "scripts/test_images/testbed/calc/ops.py").write_text("def add(a, b):\n    return a + b\n")
    fixed = images.recipe_key(repo, sources=[])
    assert fixed != key
    (repo / "scripts/test-images.sh").chmod(0o755)
    assert images.recipe_key(repo, sources=[]) != fixed
    sources = tmp_path / "debian.sources"
    sources.write_text("Suites: bookworm\n")
    assert images.recipe_key(repo, sources=[sources]) not in (key, fixed)


def test_the_cache_root(images, tmp_path, monkeypatch):
    assert images.cache_root({"PRORL_TEST_IMAGES_CACHE": str(tmp_path / "c")}) == tmp_path / "c"
    monkeypatch.setattr(images, "SYSTEM_CACHE", tmp_path / "var" / "cache" / "images")
    assert images.cache_root({}) == tmp_path / "var" / "cache" / "images"  # creatable: its ancestor is writable
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(images, "SYSTEM_CACHE", tmp_path / "file" / "images")  # below a file: never creatable
    home = tmp_path / "home"
    assert images.cache_root({"HOME": str(home)}) == home / ".cache" / "prorl-adapter" / "test-images"


def test_directories_it_creates_are_traversable_by_everyone(images, tmp_path):
    old = os.umask(0o077)
    try:
        images.make_readable_dirs(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o755


def test_a_cached_entry_is_linked_without_building(images, tmp_path, monkeypatch):
    repo, cache = fake_repo(tmp_path / "repo"), tmp_path / "cache"
    monkeypatch.setenv("PRORL_TEST_IMAGES_CACHE", str(cache))
    monkeypatch.setattr(images, "apt_source_files", list)
    key = images.recipe_key(repo)
    (cache / key).mkdir(parents=True)

    def no_build(*_args):
        raise AssertionError("a cached recipe was built again")

    monkeypatch.setattr(images, "build", no_build)
    link = images.ensure(repo)
    assert link == repo / ".test-images" and link.resolve() == (cache / key).resolve()
    inode = os.lstat(link).st_ino
    images.ensure(repo)
    assert os.lstat(link).st_ino == inode  # already right: not even replaced


def test_a_missing_entry_is_built_checked_and_renamed_into_place(images, tmp_path, monkeypatch):
    repo, cache = fake_repo(tmp_path / "repo"), tmp_path / "cache"
    monkeypatch.setenv("PRORL_TEST_IMAGES_CACHE", str(cache))
    monkeypatch.setattr(images, "apt_source_files", list)
    (cache / ".build-dead-1").mkdir(parents=True)  # a build that died
    (repo / ".test-images").symlink_to(tmp_path / "elsewhere")
    calls = []

    def build(_repo, out, scratch, _log):
        scratch.mkdir(parents=True)
        out.mkdir()
        (out / "testbed.json").write_text("{}")
        calls.append("build")

    def check(out, _scratch, _log):
        assert (out / "testbed.json").exists() and not (cache / images.recipe_key(repo)).exists()
        calls.append("check")

    monkeypatch.setattr(images, "build", build)
    monkeypatch.setattr(images, "check", check)
    link = images.ensure(repo, log=lambda _message: None)
    assert calls == ["build", "check"]
    assert (link / "testbed.json").read_text() == "{}"
    assert sorted(p.name for p in cache.iterdir()) == [".lock", images.recipe_key(repo)]


def test_the_link_never_replaces_a_real_directory(images, tmp_path):
    (tmp_path / ".test-images").mkdir()
    with pytest.raises(SystemExit, match="not a symlink"):
        images.point_link(tmp_path, tmp_path / "x")


def _mmdebstrap_tar(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, kind, mode, data in [
            ("./", tarfile.DIRTYPE, 0o755, None),
            ("./etc/", tarfile.DIRTYPE, 0o755, None),
            ("./etc/shadow", tarfile.REGTYPE, 0o640, b"root:*:1::::::\n"),
            ("./dev/", tarfile.DIRTYPE, 0o755, None),
            ("./dev/null", tarfile.CHRTYPE, 0o666, None),
            ("./bin/", tarfile.DIRTYPE, 0o700, None),
            ("./bin/tool", tarfile.REGTYPE, 0o750, b"#!/bin/sh\n"),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, mode
            info.size = len(data) if data else 0
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


def test_the_layers_and_their_whiteout(images, tmp_path):
    layers = [
        images.base_layer(_mmdebstrap_tar(tmp_path / "mm.tar"), tmp_path / "1.tar"),
        images.top_layer(tmp_path / "2.tar"),
    ]
    with tarfile.open(layers[0]) as tar:
        names = tar.getnames()
    assert "dev/null" not in names and all(not n.startswith("./") for n in names)
    with tarfile.open(layers[1]) as tar:
        assert f"{images.LAYER_DIR}/.wh.base-only" in tar.getnames()
    root = tmp_path / "root"
    root.mkdir()
    for layer in layers:
        images.apply_layer(layer, root)
    layer_dir = root / images.LAYER_DIR
    assert sorted(p.name for p in layer_dir.iterdir()) == ["order", "top-only"]
    assert (layer_dir / "order").read_text() == "base\ntop\n"
    assert (root / "etc" / "shadow").stat().st_mode & 0o777 == 0o644  # readable by the sandboxes' uids
    assert (root / "bin").stat().st_mode & 0o777 == 0o705
    assert (root / "bin" / "tool").stat().st_mode & 0o777 == 0o755


def test_the_sif_environment_and_runscript_read_as_apptainer_writes_them(images, tmp_path):
    env = images.docker2singularity_env(["PATH=/usr/bin:/bin", 'A=x "y" $z', "EMPTY"])
    assert env.splitlines() == [
        "#!/bin/sh",
        'export PATH="/usr/bin:/bin"',
        'export A="${A:-"x \\"y\\" \\$z"}"',
        'export EMPTY="${EMPTY:-}"',
    ]
    sourced = subprocess.run(["sh", "-c", env + 'printf %s "$A"'], capture_output=True, text=True, env={})
    assert sourced.stdout == 'x "y" $z'
    runscript = tmp_path / "runscript"
    runscript.write_text(images.oci_runscript(["echo", "it's"], ["default"]))
    assert subprocess.run(["sh", str(runscript)], capture_output=True, text=True).stdout == "it's default\n"
    assert subprocess.run(["sh", str(runscript), "given"], capture_output=True, text=True).stdout == "it's given\n"
