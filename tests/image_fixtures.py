"""Small real images for the image store's tests, built in a second from the host's own programs: a root directory,
and the same root as a SIF file (mksquashfs + siftool), an OCI layout (umoci, two layers, the second deleting a
file through a whiteout) and a classic `docker save` archive. The Debian test images (.test-images, built by
`make test-images`) are the full-size ones; these keep the store's unit tests fast and self-contained."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

from tests.standins.rootfs import make_rootfs

TOOLS = ("mksquashfs", "siftool", "umoci", "unsquashfs")
MISSING_TOOLS = [tool for tool in TOOLS if shutil.which(tool) is None]
SKIP_REASON = f"image tools missing: {', '.join(MISSING_TOOLS)} (make system-packages installs them)"
PROGRAMS = ("bash", "cat", "ls", "env")


def tiny_root(target: Path) -> Path:
    """A root of a few host programs (tests/standins/rootfs.py), /etc/hello, and the environment scripts that
    `apptainer build` leaves in every SIF."""
    make_rootfs(target, PROGRAMS)
    (target / "etc" / "hello").write_text("hello from the image\n")
    scripts = target / ".singularity.d" / "env"
    scripts.mkdir(parents=True)
    (scripts / "90-environment.sh").write_text('export PRORL_FROM_SCRIPT=yes\nPATH="/opt/tool/bin:$PATH"\n')
    (scripts / "99-base.sh").write_text('PS1="Apptainer> "\nexport PS1\n')
    return target


SEED_MTIME = 1_600_000_000
SEED_FILES = {"a.txt": b"original a\n", "sub/b.txt": b"original b\n", "run.sh": b"#!/bin/bash\necho ran\n"}


def seed_tree(testbed: Path) -> Path:
    """A workdir to seed workspaces from (`seed_workdir`), with what a copy must get right: files in a subdirectory,
    an executable, a setuid and setgid file, links (one inside, one leading out of the tree, one dangling), a
    read-only directory, and a.txt with an old mtime (git's index stays valid only if times are kept)."""
    (testbed / "sub").mkdir(parents=True)
    for name, content in SEED_FILES.items():
        (testbed / name).write_bytes(content)
    (testbed / "run.sh").chmod(0o755)
    (testbed / "setuid").write_text("s\n")
    (testbed / "setuid").chmod(0o6755)
    (testbed / "link").symlink_to("a.txt")
    (testbed / "hello-link").symlink_to("/etc/hello")
    (testbed / "dangling").symlink_to("/nowhere/at/all")
    (testbed / "locked").mkdir()
    (testbed / "locked" / "inside").write_text("in\n")
    (testbed / "locked").chmod(0o555)
    os.utime(testbed / "a.txt", (SEED_MTIME, SEED_MTIME))
    return testbed


def listing(directory: Path) -> dict[str, tuple]:
    """Each path below `directory`: a link's target, a file's mode and content, a directory's type and mode."""
    found = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        name = str(path.relative_to(directory))
        if stat.S_ISLNK(info.st_mode):
            found[name] = ("link", os.readlink(path))
        elif stat.S_ISREG(info.st_mode):
            found[name] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
        else:
            found[name] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode))
    return found


def build_sif(root: Path, sif: Path) -> Path:
    squashfs = sif.with_suffix(".squashfs")
    subprocess.run(
        ["mksquashfs", str(root), str(squashfs), "-quiet", "-no-progress", "-noappend", "-all-root"], check=True
    )
    subprocess.run(["siftool", "new", str(sif)], check=True, capture_output=True)
    (sif.parent / "labels.json").write_text("{}")
    subprocess.run(
        ["siftool", "add", str(sif), str(sif.parent / "labels.json"), "--datatype", "6", "--groupid", "1"],
        check=True,
        capture_output=True,
    )
    partition = ["--datatype", "4", "--parttype", "2", "--partfs", "1", "--partarch", "2", "--groupid", "1"]
    subprocess.run(["siftool", "add", str(sif), str(squashfs), *partition], check=True, capture_output=True)
    squashfs.unlink()
    return sif


def _umoci(*args: str, cwd: Path) -> None:
    rootless = ["--rootless"] if args[0] in ("unpack",) and os.geteuid() != 0 else []
    subprocess.run(["umoci", args[0], *rootless, *args[1:]], check=True, capture_output=True, cwd=cwd)


def build_oci(root: Path, layout: Path, tag: str = "latest") -> Path:
    """Two layers: the root plus /etc/gone, then one that deletes /etc/gone (a whiteout) and adds /etc/added."""
    work = layout.parent
    _umoci("init", "--layout", layout.name, cwd=work)
    _umoci("new", "--image", f"{layout.name}:{tag}", cwd=work)
    bundle = work / "bundle"
    _umoci("unpack", "--image", f"{layout.name}:{tag}", bundle.name, cwd=work)
    rootfs = bundle / "rootfs"
    shutil.rmtree(rootfs)
    shutil.copytree(root, rootfs, symlinks=True)
    (rootfs / "etc" / "gone").write_text("deleted by the second layer\n")
    _umoci("repack", "--image", f"{layout.name}:{tag}", bundle.name, cwd=work)
    shutil.rmtree(bundle)
    _umoci("unpack", "--image", f"{layout.name}:{tag}", bundle.name, cwd=work)
    (rootfs / "etc" / "gone").unlink()
    (rootfs / "etc" / "added").write_text("added by the second layer\n")
    _umoci("repack", "--image", f"{layout.name}:{tag}", bundle.name, cwd=work)
    shutil.rmtree(bundle)
    _umoci(
        "config", "--image", f"{layout.name}:{tag}", "--config.env", "PRORL_IMAGE=tiny", "--config.env",
        "PATH=/usr/bin:/bin", cwd=work,
    )  # fmt: skip
    subprocess.run(["chmod", "-R", "a+rX", str(layout)], check=True)  # umoci writes index.json 0600
    return layout


def _tar_bytes(root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return buffer.getvalue()


def build_docker_archive(root: Path, archive: Path, repo_tag: str = "tiny:latest") -> Path:
    """A `docker save` archive in the classic format: manifest.json, a config, one tar per layer."""
    layer = _tar_bytes(root)
    layer_id = hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin", "PRORL_IMAGE=docker"]},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + layer_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [repo_tag], "Layers": [f"{layer_id}/layer.tar"]}])
    with tarfile.open(archive, "w") as tar:
        for name, data in [
            (config_name, config),
            (f"{layer_id}/layer.tar", layer),
            ("manifest.json", manifest.encode()),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def build_all(directory: Path) -> Path:
    """`directory` as an image directory holding tiny.rootfs, tiny.sif, tiny.oci and tiny.docker.tar."""
    directory.mkdir(parents=True, exist_ok=True)
    root = tiny_root(directory / "tiny.rootfs")
    build_sif(root, directory / "tiny.sif")
    build_oci(root, directory / "tiny.oci")
    build_docker_archive(root, directory / "tiny.docker.tar")
    return directory
