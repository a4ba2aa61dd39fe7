#!/usr/bin/env python3
"""The test suite's real images, built offline from Debian's packages and cached between runs (stdlib only).

One Debian bookworm root (mmdebstrap, minbase, with bash, coreutils, python3, pytest and git, and /testbed: a
small git repository, a synthetic SWE-bench instance), laid out in every format the runtime reads, all with the
same content:

    debian-python.rootfs/      the unpacked root directory
    debian-python.oci/         an OCI image layout, tag `latest`: two gzip layers, the second deleting a file
                               through a whiteout (see LAYER_FILES)
    debian-python.docker.tar   a classic `docker save` archive of the same two layers and config
    debian-python.sif          a SIF file: the root as squashfs plus /.singularity.d as `apptainer build` adds it
    testbed.json               {"base_commit": ..., "repo_path": "/testbed"}
    digests.json               what is where: digests, layers, installed packages

Built into CACHE/<key>/, where <key> hashes the recipe (this file, scripts/test-images.sh, scripts/test_images/
but its README, the host's apt sources) and CACHE is $PRORL_TEST_IMAGES_CACHE, else
/var/cache/prorl-adapter/test-images when that is writable, else ~/.cache/prorl-adapter/test-images. A build
happens in a temporary directory next to it, is checked (every format against the root directory, and the root
run in bwrap), and is renamed into place; `.test-images` in the repository root then points at it. With nothing
changed a run only hashes the recipe and checks that link. See scripts/test_images/README.md.

Why a writer of our own for the OCI layout and the docker archive rather than `umoci repack`: the two formats
must hold the very same layers (the docker archive's layer.tar files are the OCI layers before gzip, so the
config and its diff_ids are shared byte for byte), and the layers come straight from mmdebstrap's tarball with
their owners, so building needs no root and no rootless unpack; umoci still unpacks the result to check it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = Path("scripts") / "test_images"
RECIPE_FILES = (Path("scripts") / "test-images.sh", Path("scripts") / "build_test_images.py")
NOT_RECIPE = {"README.md"}  # documentation only: editing it rebuilds nothing
JUNK = {"__pycache__", ".pytest_cache", ".ruff_cache"}  # what running the testbed's tests leaves behind
SYSTEM_CACHE = Path("/var/cache/prorl-adapter/test-images")
USER_CACHE = Path("~/.cache/prorl-adapter/test-images")
LINK = ".test-images"
APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))

NAME = "debian-python"
TAG = "latest"
SUITE = "bookworm"
# Every timestamp in the images (mmdebstrap clamps to it too): 2023-11-14T22:13:20Z.
SOURCE_DATE_EPOCH = 1700000000
CREATED = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(SOURCE_DATE_EPOCH))
ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    f"PRORL_IMAGE={NAME}",
    "LANG=C.UTF-8",
]
WORKDIR = "/testbed"
LABELS = {
    "org.opencontainers.image.title": NAME,
    "org.opencontainers.image.description": "Debian bookworm minbase with python3, pytest and git; /testbed",
    "org.opencontainers.image.source": "scripts/test-images.sh (prorl-adapter)",
}
# The whiteout test: the base layer has both files, the second layer deletes base-only (`.wh.base-only`),
# rewrites order and adds top-only. The final root, in every format: order = "base\ntop\n", top-only, no base-only.
LAYER_DIR = "etc/prorl-layers"
LAYER_FILES = {
    1: {"order": b"base\n", "base-only": b"in the base layer; the second layer's whiteout deletes it\n"},
    2: {"order": b"base\ntop\n", "top-only": b"added by the second layer\n"},
}
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_NAME = "org.opencontainers.image.ref.name"


# -- cache key and location ----------------------------------------------------------------------------------
def recipe_files(repo: Path = REPO) -> list[Path]:
    """The files whose content the images depend on, relative to `repo`, sorted."""
    found = [path for path in RECIPE_FILES if (repo / path).is_file()]
    for directory, dirs, files in os.walk(repo / RECIPE_DIR):
        dirs[:] = sorted(d for d in dirs if d not in JUNK)
        for name in files:
            path = Path(directory, name).relative_to(repo)
            if name not in NOT_RECIPE and not name.endswith(".pyc"):
                found.append(path)
    return sorted(found)


def apt_source_files() -> list[Path]:
    """The host's apt source files for SUITE: the mirror the image's packages come from (a proxy, a snapshot)."""
    files = [APT_SOURCES[0]] if APT_SOURCES[0].is_file() else []
    if APT_SOURCES[1].is_dir():
        files += sorted(p for p in APT_SOURCES[1].iterdir() if p.suffix in (".list", ".sources") and p.is_file())
    return [p for p in files if SUITE in p.read_text(errors="replace")]


def recipe_key(repo: Path = REPO, sources: list[Path] | None = None) -> str:
    """A short hash of the recipe's files (names and bytes, executable bit included) and of the apt sources."""
    digest = hashlib.sha256(b"prorl-adapter test images\n")
    for path in recipe_files(repo):
        executable = os.stat(repo / path).st_mode & 0o111 != 0
        digest.update(f"{path.as_posix()} {int(executable)}\n".encode())
        digest.update(hashlib.sha256((repo / path).read_bytes()).digest())
    for path in apt_source_files() if sources is None else sources:
        digest.update(f"apt {path}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _writable_dir(path: Path) -> bool:
    """Whether `path` exists writable, or could be created: its nearest existing ancestor is writable."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False


def cache_root(environ: dict[str, str] | None = None) -> Path:
    """$PRORL_TEST_IMAGES_CACHE, else the system cache when writable, else the user's."""
    environ = os.environ if environ is None else environ
    if environ.get("PRORL_TEST_IMAGES_CACHE"):
        return Path(environ["PRORL_TEST_IMAGES_CACHE"]).expanduser()
    if _writable_dir(SYSTEM_CACHE):
        return SYSTEM_CACHE
    return Path(environ.get("HOME") or Path.home()) / USER_CACHE.relative_to("~")


def make_readable_dirs(path: Path) -> None:
    """Create `path` and any missing ancestors, each 0755 whatever the umask: every uid traverses them."""
    missing = []
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
            directory.chmod(0o755)


def point_link(repo: Path, target: Path) -> Path:
    """`repo/.test-images` -> target, replaced atomically when it points elsewhere."""
    link = repo / LINK
    if link.is_symlink() and os.readlink(link) == str(target):
        return link
    if link.exists() and not link.is_symlink():
        raise SystemExit(f"{link} exists and is not a symlink; move it away")
    temporary = repo / f"{LINK}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(target)
    os.replace(temporary, link)
    return link


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """One build at a time per cache root (two `make test` in two clones share it)."""
    with open(root / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def say(message: str) -> None:
    print(message, flush=True)  # in order with mmdebstrap's own lines


def ensure(repo: Path = REPO, rebuild: bool = False, log=say) -> Path:
    """The image dir for the current recipe: from the cache, else built; `.test-images` points at it."""
    key = recipe_key(repo)
    root = cache_root()
    final = root / key
    if final.is_dir() and not rebuild:
        return point_link(repo, final)
    make_readable_dirs(root)
    with locked(root):
        if rebuild and final.is_dir():
            retired = root / f".old-{key}-{os.getpid()}"
            os.rename(final, retired)
            shutil.rmtree(retired)
        if not final.is_dir():  # another process may have built it while we waited for the lock
            for stale in [*root.glob(".build-*"), *root.glob(".old-*")]:  # a build that died: none runs now
                shutil.rmtree(stale, ignore_errors=True)
            work = root / f".build-{key}-{os.getpid()}"
            work.mkdir()
            work.chmod(0o755)  # the check runs the root as nobody, from in here
            try:
                images = work / "images"
                started = time.monotonic()
                build(repo, images, work / "scratch", log)
                make_world_readable(images)
                check(images, work / "scratch" / "check", log)
                os.rename(images, final)
                log(f"test images: built {final} in {time.monotonic() - started:.0f}s")
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return point_link(repo, final)


# -- building ------------------------------------------------------------------------------------------------
def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, **kwargs)


def read_list(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def apt_options() -> list[str]:
    """apt options for mmdebstrap's apt: snapshot mirrors' old Release files, and the host's proxy if any."""
    options = ['Acquire::Check-Valid-Until "false"']
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        dump = _run(["apt-config", "dump"], capture_output=True, text=True).stdout
        for line in dump.splitlines():
            if line.startswith(("Acquire::http::Proxy ", "Acquire::https::Proxy ")):
                options.append(line.rstrip(";"))
    return options


def clean_copy(source: Path, target: Path) -> Path:
    """Copy of the testbed's sources without what running its tests leaves (__pycache__, .pytest_cache)."""
    shutil.copytree(source, target, ignore=lambda _dir, names: [n for n in names if n in JUNK or n.endswith(".pyc")])
    return target


def bootstrap(repo: Path, out: Path, scratch: Path, log) -> Path:
    """mmdebstrap's tarball of the root (with /testbed committed): owners recorded in the tar in every mode."""
    recipe = repo / RECIPE_DIR
    testbed = clean_copy(recipe / "testbed", scratch / "copy-in" / "testbed")
    sources = apt_source_files()
    argv = [
        "mmdebstrap",
        f"--mode={os.environ.get('PRORL_TEST_IMAGES_MODE', 'auto')}",
        "--variant=minbase",
        "--format=tar",
        "--include=" + ",".join(read_list(recipe / "packages.txt")),
        f"--dpkgopt={recipe / 'dpkg.cfg'}",
        *(f"--aptopt={option}" for option in apt_options()),
        f"--customize-hook=copy-in {testbed} /",
        f'--customize-hook={recipe / "customize.sh"} "$1"',
        SUITE,
        str(out),
        *(str(path) for path in sources),  # none: mmdebstrap's default, deb.debian.org
    ]
    log(f"test images: mmdebstrap {SUITE} from {', '.join(map(str, sources)) or 'deb.debian.org'}")
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    _run(argv, env=env, stdout=subprocess.DEVNULL)
    return out


def layer_names() -> list[str]:
    return sorted(set(LAYER_FILES[1]) | set(LAYER_FILES[2]))


def _tarinfo(name: str, data: bytes | None = None, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = SOURCE_DATE_EPOCH
    info.uname = info.gname = "root"
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    else:
        info.size, info.mode = len(data), mode
    return info


def _add(tar: tarfile.TarFile, info: tarfile.TarInfo, data: bytes | None = None) -> None:
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def base_layer(bootstrap_tar: Path, out: Path) -> Path:
    """The first layer: mmdebstrap's tarball, normalised. Names lose their "./"; device nodes go (an image's
    /dev is the runtime's to fill: bwrap --dev, and an unprivileged unpacker cannot make them); every entry
    becomes readable by others (o+r, and o+x where the owner has x: the sandboxes run as unprivileged uids, so
    /etc/shadow is world-readable here, a test image's trade); then LAYER_DIR's first-layer files."""
    with tarfile.open(bootstrap_tar) as source, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as layer:
        for member in source:
            name = member.name.removeprefix("./").rstrip("/")
            if name in ("", ".") or member.ischr() or member.isblk() or member.isfifo():
                continue
            member.name = name
            if member.islnk():
                member.linkname = member.linkname.removeprefix("./")
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if k.startswith("SCHILY.xattr.")}
            member.mode |= 0o004 | (0o001 if member.isdir() or member.mode & 0o100 else 0)
            layer.addfile(member, source.extractfile(member) if member.isreg() else None)
        _add(layer, _tarinfo(LAYER_DIR))
        for name, data in LAYER_FILES[1].items():
            _add(layer, _tarinfo(f"{LAYER_DIR}/{name}", data), data)
    return out


def top_layer(out: Path) -> Path:
    """The second layer: a whiteout deleting the first layer's base-only, a changed file and a new one."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as layer:
        _add(layer, _tarinfo(LAYER_DIR))
        deleted = set(LAYER_FILES[1]) - set(LAYER_FILES[2])
        for name in sorted(deleted):
            _add(layer, _tarinfo(f"{LAYER_DIR}/{WHITEOUT}{name}", b""), b"")
        for name, data in LAYER_FILES[2].items():
            _add(layer, _tarinfo(f"{LAYER_DIR}/{name}", data), data)
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def apply_layer(layer: Path, root: Path) -> None:
    """Unpack one layer tarball onto `root` as an OCI runtime does: whiteouts delete, other entries replace
    what is there (unlinked first, never written through: it may be a hard link of another file)."""
    extract = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(layer) as tar:
        for member in tar:
            path = root / member.name
            parent, _, base = member.name.rpartition("/")
            if base == OPAQUE:
                for child in (root / parent).iterdir():
                    _remove(child)
            elif base.startswith(WHITEOUT):
                _remove(root / parent / base[len(WHITEOUT) :])
            else:
                if os.path.lexists(path) and not (member.isdir() and path.is_dir() and not path.is_symlink()):
                    _remove(path)
                tar.extract(member, root, numeric_owner=True, **extract)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _gzip(source: Path, target: Path) -> None:
    with (
        open(source, "rb") as raw,
        open(target, "wb") as out,
        gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=6, mtime=0) as packed,
    ):
        shutil.copyfileobj(raw, packed, 1 << 20)


def _json_bytes(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def image_config(diff_ids: list[str]) -> dict:
    """The OCI image config (also the docker archive's): Env, WorkingDir, Cmd, Labels, the layers' diff_ids."""
    return {
        "created": CREATED,
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ENV, "WorkingDir": WORKDIR, "Cmd": ["/bin/bash"], "Labels": LABELS},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [
            {"created": CREATED, "created_by": "mmdebstrap --variant=minbase (scripts/build_test_images.py)"},
            {"created": CREATED, "created_by": f"whiteout test layer: {LAYER_DIR} (scripts/build_test_images.py)"},
        ],
    }


def write_oci(layers: list[Path], config: bytes, layout: Path) -> dict:
    """An OCI image layout: the layers gzipped, the config, one manifest in index.json tagged TAG."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    descriptors = []
    for layer in layers:
        packed = blobs / "incoming"
        _gzip(layer, packed)
        digest, size = _sha256_file(packed), packed.stat().st_size
        packed.rename(blobs / digest)
        descriptors.append({"mediaType": OCI_LAYER_GZIP, "digest": f"sha256:{digest}", "size": size})
    config_digest = hashlib.sha256(config).hexdigest()
    (blobs / config_digest).write_bytes(config)
    manifest = _json_bytes(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": f"sha256:{config_digest}", "size": len(config)},
            "layers": descriptors,
            "annotations": {"org.opencontainers.image.created": CREATED},
        }
    )
    manifest_digest = hashlib.sha256(manifest).hexdigest()
    (blobs / manifest_digest).write_bytes(manifest)
    entry = {
        "mediaType": OCI_MANIFEST,
        "digest": f"sha256:{manifest_digest}",
        "size": len(manifest),
        "annotations": {REF_NAME: TAG},
        "platform": {"architecture": "amd64", "os": "linux"},
    }
    (layout / "index.json").write_bytes(_json_bytes({"schemaVersion": 2, "manifests": [entry]}))
    (layout / "oci-layout").write_bytes(_json_bytes({"imageLayoutVersion": "1.0.0"}))
    return {"manifest": f"sha256:{manifest_digest}", "config": f"sha256:{config_digest}", "layers": descriptors}


def write_docker_archive(layers: list[Path], diff_ids: list[str], config: bytes, archive: Path) -> dict:
    """A classic `docker save` archive: manifest.json, repositories, <config>.json, <id>/{layer.tar,VERSION,json}.
    Layer ids are v1-style chain ids (each from its parent's and its own diff_id), as old Docker made them."""
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    ids, parent = [], ""
    for diff_id in diff_ids:
        parent = hashlib.sha256(f"{parent} {diff_id}".encode()).hexdigest()
        ids.append(parent)
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for index, (layer, layer_id) in enumerate(zip(layers, ids, strict=True)):
            _add(tar, _tarinfo(layer_id))
            _add(tar, _tarinfo(f"{layer_id}/VERSION", b"1.0"), b"1.0")
            legacy = {"id": layer_id, "created": CREATED, "os": "linux", "architecture": "amd64"}
            if index:
                legacy["parent"] = ids[index - 1]
            if index == len(ids) - 1:
                legacy["config"] = image_config(diff_ids)["config"]
            data = _json_bytes(legacy)
            _add(tar, _tarinfo(f"{layer_id}/json", data), data)
            info = _tarinfo(f"{layer_id}/layer.tar", b"")
            info.size = layer.stat().st_size
            with open(layer, "rb") as handle:
                tar.addfile(info, handle)
        _add(tar, _tarinfo(config_name, config), config)
        tags = [f"{NAME}:{TAG}"]
        manifest = _json_bytes([{"Config": config_name, "RepoTags": tags, "Layers": [f"{i}/layer.tar" for i in ids]}])
        _add(tar, _tarinfo("manifest.json", manifest), manifest)
        repositories = _json_bytes({NAME: {TAG: ids[-1]}})
        _add(tar, _tarinfo("repositories", repositories), repositories)
    return {"config": config_name, "layer_ids": ids, "repo_tags": tags}


# The parts of /.singularity.d that `apptainer build` writes from an OCI source (its base environment, then the
# image's Env as 10-docker2singularity.sh, the runscript from Entrypoint/Cmd, labels.json), in short form.
_SOURCE_ENV = 'for script in /.singularity.d/env/*.sh; do\n    if [ -f "$script" ]; then\n        . "$script"\n'
_SOURCE_ENV += "    fi\ndone\n"
SINGULARITY_FILES = {
    "actions/exec": f'#!/bin/sh\n\n{_SOURCE_ENV}\nexec "$@"\n',
    "actions/run": f"#!/bin/sh\n\n{_SOURCE_ENV}\n"
    'if test -x /.singularity.d/runscript; then\n    exec /.singularity.d/runscript "$@"\nfi\n'
    'echo "No runscript found, executing /bin/sh"\nexec /bin/sh "$@"\n',
    "actions/shell": f"#!/bin/sh\n\n{_SOURCE_ENV}\n"
    'if test -n "${APPTAINER_SHELL:-}" -a -x "${APPTAINER_SHELL:-}"; then\n    exec $APPTAINER_SHELL "$@"\n'
    'elif test -x /bin/bash; then\n    SHELL=/bin/bash\n    export SHELL\n    exec /bin/bash --norc "$@"\nfi\n'
    'SHELL=/bin/sh\nexport SHELL\nexec /bin/sh "$@"\n',
    "actions/start": f"#!/bin/sh\n\n# tell PID 1 to continue\nkill -CONT 1\n\n{_SOURCE_ENV}\n"
    "if test -x /.singularity.d/startscript; then\n    exec /.singularity.d/startscript\nfi\n",
    "actions/test": f"#!/bin/sh\n\n{_SOURCE_ENV}\n"
    'if test -x /.singularity.d/test; then\n    exec /.singularity.d/test "$@"\nfi\n'
    'echo "No test found in container, executing /bin/sh -c true"\nexec /bin/sh -c true\n',
    "env/01-base.sh": "#!/bin/sh\n# Apptainer's base environment: nothing to set.\n",
    "env/90-environment.sh": "#!/bin/sh\n# The definition file's %environment section goes here (none).\n",
    "env/95-apps.sh": "#!/bin/sh\n# SCIF apps (none).\n",
    "env/99-base.sh": '#!/bin/sh\nif [ -z "${LD_LIBRARY_PATH:-}" ]; then\n    LD_LIBRARY_PATH=/.singularity.d/libs\n'
    'else\n    LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/.singularity.d/libs"\nfi\n'
    'if test -z "${PS1:-}"; then\n    PS1="Apptainer> "\nfi\nexport LD_LIBRARY_PATH PS1\n',
    "env/99-runtimevars.sh": "#!/bin/sh\n# Apptainer's --env PATH overrides are applied here (none at build time).\n",
    "startscript": "#!/bin/sh\n",
}
# Apptainer's own links at the root of the image.
SINGULARITY_LINKS = {
    "apptainer": ".singularity.d/runscript",
    "singularity": ".singularity.d/runscript",
    ".exec": ".singularity.d/actions/exec",
    ".run": ".singularity.d/actions/run",
    ".shell": ".singularity.d/actions/shell",
    ".test": ".singularity.d/actions/test",
    "environment": ".singularity.d/env/90-environment.sh",
}


def _shell_quote(value: str) -> str:
    return '"' + "".join("\\" + c if c in '\\"`$' else c for c in value) + '"'


def docker2singularity_env(env: list[str]) -> str:
    """env/10-docker2singularity.sh as apptainer writes it: PATH set, every other variable a default only."""
    lines = ["#!/bin/sh"]
    for entry in env:
        key, sep, value = entry.partition("=")
        if not sep:
            lines.append(f'export {key}="${{{key}:-}}"')
        elif key == "PATH":
            lines.append(f"export {key}={_shell_quote(value)}")
        else:
            lines.append(f'export {key}="${{{key}:-{_shell_quote(value)}}}"')
    return "\n".join(lines) + "\n"


def oci_runscript(entrypoint: list[str], cmd: list[str]) -> str:
    """The runscript apptainer makes of an OCI image: ENTRYPOINT, then CMD unless arguments are given."""

    def words(args: list[str]) -> str:
        quoted = ("'" + a.replace("'", "'\\''") + "'" for a in reversed(args))
        return "".join(f'set -- {q} "$@"\n' for q in quoted)

    return (
        "#!/bin/sh\n# ENTRYPOINT, then CMD unless arguments were given, as `docker run` does\n"
        f'if [ $# -eq 0 ]; then\n{words(cmd)}fi\n{words(entrypoint)}exec "$@"\n'
    )


def singularity_tree(root: Path, config: dict) -> None:
    """Add /.singularity.d and apptainer's root links to `root` (a copy: the files are all new ones)."""
    base = root / ".singularity.d"
    for directory in ("actions", "env", "libs"):
        (base / directory).mkdir(parents=True, exist_ok=True)
    files = dict(SINGULARITY_FILES)
    files["env/10-docker2singularity.sh"] = docker2singularity_env(config["Env"])
    files["runscript"] = oci_runscript(config.get("Entrypoint") or [], config.get("Cmd") or [])
    for name, text in files.items():
        (base / name).write_text(text)
        (base / name).chmod(0o755)
    (base / "labels.json").write_text(json.dumps(config.get("Labels") or {}, indent="\t", sort_keys=True))
    (base / "labels.json").chmod(0o644)
    for name, target in SINGULARITY_LINKS.items():
        (root / name).symlink_to(target)
    for path in [base, *base.rglob("*"), *(root / name for name in SINGULARITY_LINKS)]:
        os.utime(path, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH), follow_symlinks=False)


def write_sif(rootfs: Path, config: dict, sif: Path, scratch: Path) -> None:
    """A SIF file as `apptainer build` makes one of an OCI image: the root plus /.singularity.d as a squashfs
    primary system partition (group 1, amd64) and the image config as the oci-config.json JSON object."""
    stage = scratch / "sif-root"
    _run(["cp", "-a", "--link", str(rootfs), str(stage)])  # hard links: only new files are added to the copy
    singularity_tree(stage, config)
    squashfs = scratch / "root.squashfs"
    owners = [] if os.geteuid() == 0 else ["-all-root"]  # unprivileged, the copy's owner is the builder
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    _run(["mksquashfs", str(stage), str(squashfs), "-noappend", "-no-progress", "-quiet", *owners], env=env)
    oci_config = scratch / "oci-config.json"
    oci_config.write_bytes(_json_bytes(config))
    _run(["siftool", "new", str(sif)], stdout=subprocess.DEVNULL)
    json_object = ["--datatype", "6", "--groupid", "1", "--filename", "oci-config.json"]
    _run(["siftool", "add", *json_object, str(sif), str(oci_config)], stdout=subprocess.DEVNULL)
    partition = ["--datatype", "4", "--partfs", "1", "--parttype", "2", "--partarch", "2", "--groupid", "1"]
    _run(["siftool", "add", *partition, str(sif), str(squashfs)], stdout=subprocess.DEVNULL)
    shutil.rmtree(stage)
    squashfs.unlink()


def base_commit(rootfs: Path) -> str:
    """HEAD of /testbed, read from the repository's files (the host need not have git)."""
    git = rootfs / WORKDIR.lstrip("/") / ".git"
    head = (git / "HEAD").read_text().strip()
    if head.startswith("ref: "):
        return (git / head[5:]).read_text().strip()
    return head


def installed_packages(rootfs: Path) -> dict[str, str]:
    packages, name = {}, None
    for line in (rootfs / "var/lib/dpkg/status").read_text().splitlines():
        if line.startswith("Package: "):
            name = line[9:]
        elif line.startswith("Version: ") and name:
            packages[name] = line[9:]
    return dict(sorted(packages.items()))


def build(repo: Path, images: Path, scratch: Path, log) -> None:
    """Everything in `images`, from mmdebstrap to digests.json; `scratch` for what is not kept."""
    scratch.mkdir(parents=True)
    images.mkdir(mode=0o755)
    started = time.monotonic()
    tarball = bootstrap(repo, scratch / "mmdebstrap.tar", scratch, log)
    log(f"test images: mmdebstrap took {time.monotonic() - started:.0f}s")
    layers = [base_layer(tarball, scratch / "layer1.tar"), top_layer(scratch / "layer2.tar")]
    tarball.unlink()
    rootfs = images / f"{NAME}.rootfs"
    rootfs.mkdir(mode=0o755)
    for layer in layers:
        apply_layer(layer, rootfs)
    diff_ids = [f"sha256:{_sha256_file(layer)}" for layer in layers]
    full_config = image_config(diff_ids)
    config = _json_bytes(full_config)
    log("test images: writing the OCI layout, the docker archive and the SIF file")
    oci = write_oci(layers, config, images / f"{NAME}.oci")
    docker = write_docker_archive(layers, diff_ids, config, images / f"{NAME}.docker.tar")
    write_sif(rootfs, full_config["config"], images / f"{NAME}.sif", scratch)
    commit = base_commit(rootfs)
    (images / "testbed.json").write_text(json.dumps({"base_commit": commit, "repo_path": WORKDIR}, indent=2) + "\n")
    docker["sha256"] = _sha256_file(images / f"{NAME}.docker.tar")
    summary = {
        "name": NAME,
        "recipe_key": recipe_key(repo),
        "formats": {
            f"{NAME}.rootfs": {"format": "directory"},
            f"{NAME}.oci": {"format": "oci", "tag": TAG, **oci},
            f"{NAME}.docker.tar": {"format": "docker-archive", **docker},
            f"{NAME}.sif": {"format": "sif", "sha256": _sha256_file(images / f"{NAME}.sif")},
        },
        "diff_ids": diff_ids,
        "env": ENV,
        "workdir": WORKDIR,
        "whiteout": {f"/{LAYER_DIR}/{n}": "deleted" if n not in LAYER_FILES[2] else "written" for n in layer_names()},
        "testbed": {"base_commit": commit, "repo_path": WORKDIR},
        "packages": installed_packages(rootfs),
    }
    (images / "digests.json").write_text(json.dumps(summary, indent=2) + "\n")


def make_world_readable(top: Path) -> None:
    """o+r on every file and o+rx on every directory (and o+x where the owner has x); links are left alone."""
    for directory, dirs, files in os.walk(top):
        for name in [*dirs, *files, None]:
            path = Path(directory, name) if name else Path(directory)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                continue
            wanted = mode | 0o004 | (0o001 if stat.S_ISDIR(mode) or mode & 0o100 else 0)
            if wanted != mode:
                os.chmod(path, stat.S_IMODE(wanted))


# -- checking ------------------------------------------------------------------------------------------------
def tree_listing(root: Path, owners: bool) -> dict[str, tuple]:
    """path (relative, "/"-separated) -> what every format must agree on about it."""
    listing = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            st = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            owner = (st.st_uid, st.st_gid) if owners else ()
            listing[path.relative_to(root).as_posix()] = (stat.filemode(st.st_mode), size, link, *owner)
    return listing


def squashfs_listing(sif: Path, scratch: Path, owners: bool) -> dict[str, tuple]:
    """The listing of the SIF file's squashfs partition, from `unsquashfs -lln` of the dumped partition."""
    listed = _run(["siftool", "list", str(sif)], capture_output=True, text=True).stdout
    ids = [line.split("|")[0].strip() for line in listed.splitlines() if "Squashfs" in line or "FS (" in line]
    if len(ids) != 1:
        raise SystemExit(f"{sif}: expected one squashfs partition, siftool list says:\n{listed}")
    squashfs = scratch / "partition.squashfs"
    with open(squashfs, "wb") as out:
        _run(["siftool", "dump", ids[0], str(sif)], stdout=out)
    lines = _run(["unsquashfs", "-lln", "-d", "", str(squashfs)], capture_output=True, text=True).stdout
    squashfs.unlink()
    listing = {}
    for line in lines.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or len(fields[0]) != 10:
            continue
        mode, owner, size, path = fields[0], fields[1], fields[2], fields[5]
        link = ""
        if mode[0] == "l":
            path, _, link = path.partition(" -> ")
        path = path.lstrip("/")
        if not path:
            continue
        uid, gid = (int(x) for x in owner.split("/"))
        listing[path] = (mode, int(size) if mode[0] == "-" else 0, link, *((uid, gid) if owners else ()))
    return listing


def _compare(name: str, expected: dict, got: dict) -> list[str]:
    problems = []
    for path in sorted(expected.keys() - got.keys())[:5]:
        problems.append(f"{name}: missing {path}")
    for path in sorted(got.keys() - expected.keys())[:5]:
        problems.append(f"{name}: extra {path}")
    for path in sorted(p for p in expected.keys() & got.keys() if expected[p] != got[p])[:5]:
        problems.append(f"{name}: {path} is {got[path]}, the root directory has {expected[path]}")
    return problems


def check(images: Path, scratch: Path, log) -> None:
    """Every format holds the root directory's content; the root runs python3, git and the testbed's tests."""
    scratch.mkdir(parents=True, exist_ok=True)
    owners = os.geteuid() == 0
    rootfs = images / f"{NAME}.rootfs"
    expected = tree_listing(rootfs, owners)
    problems = []
    # LAYER_DIR shows the whiteout applied.
    layer_dir = rootfs / LAYER_DIR
    files = {p.name: p.read_bytes() for p in layer_dir.iterdir()}
    if files != {**{n: d for n, d in LAYER_FILES[1].items() if n in LAYER_FILES[2]}, **LAYER_FILES[2]}:
        problems.append(f"{NAME}.rootfs: {LAYER_DIR} does not show the second layer's whiteout applied")
    # OCI: unpacked by umoci, an implementation not ours.
    bundle = scratch / "bundle"
    rootless = [] if owners else ["--rootless"]
    image = f"{images / NAME}.oci:{TAG}"
    _run(["umoci", "unpack", *rootless, "--image", image, str(bundle)], stdout=subprocess.DEVNULL)
    unpacked = tree_listing(bundle / "rootfs", owners)
    problems += _compare(f"{NAME}.oci (umoci unpack)", expected, unpacked)
    shutil.rmtree(bundle)
    # docker archive: the same layer bytes as the OCI layout's (its diff_ids), the same config blob.
    summary = json.loads((images / "digests.json").read_text())
    with tarfile.open(images / f"{NAME}.docker.tar") as tar:
        (entry,) = json.load(tar.extractfile("manifest.json"))
        config = tar.extractfile(entry["Config"]).read()
        digests = []
        for layer in entry["Layers"]:
            digest, handle = hashlib.sha256(), tar.extractfile(layer)
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
            digests.append(f"sha256:{digest.hexdigest()}")
    if f"sha256:{hashlib.sha256(config).hexdigest()}" != summary["formats"][f"{NAME}.oci"]["config"]:
        problems.append(f"{NAME}.docker.tar: its config is not the OCI layout's")
    if digests != json.loads(config)["rootfs"]["diff_ids"] or entry["RepoTags"] != [f"{NAME}:{TAG}"]:
        problems.append(f"{NAME}.docker.tar: its layers are not the config's diff_ids (or its tag is wrong)")
    # SIF: the squashfs holds the root plus /.singularity.d and apptainer's links.
    sif_listing = squashfs_listing(images / f"{NAME}.sif", scratch, owners)
    extras = {p for p in sif_listing if p.partition("/")[0] == ".singularity.d" or p in SINGULARITY_LINKS}
    problems += _compare(f"{NAME}.sif", expected, {p: v for p, v in sif_listing.items() if p not in extras})
    if "env/10-docker2singularity.sh" not in {p.removeprefix(".singularity.d/") for p in extras}:
        problems.append(f"{NAME}.sif: no /.singularity.d/env/10-docker2singularity.sh")
    problems += run_checks(rootfs, json.loads((images / "testbed.json").read_text())["base_commit"])
    if problems:
        raise SystemExit("test images: the check failed:\n  " + "\n  ".join(problems))
    log(f"test images: checked ({len(expected)} entries in each format; the root runs python3, git and pytest)")


def run_checks(rootfs: Path, commit: str) -> list[str]:
    """Run the root in bwrap, read-only, as the unprivileged `nobody` when we are root (as the sandboxes are)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ["bwrap is not installed (make system-packages): cannot run the root"]
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    script = (
        "set -e; python3 -c 'print(1)'; git -C /testbed log --format=%H; git -C /testbed status --porcelain; "
        "cd /testbed && python3 -m pytest -q -p no:cacheprovider"
    )
    binds = ["--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    env = ["--clearenv", "--setenv", "PATH", ENV[0].partition("=")[2], "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    argv = [*as_nobody, bwrap, *binds, "--unshare-all", "--die-with-parent", *env, "/bin/sh", "-c", script]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    if result.returncode != 0 or lines[:2] != ["1", commit] or "passed" not in lines[-1]:
        return [f"running the root in bwrap failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="build anew even when the cache has this recipe")
    parser.add_argument("--check", action="store_true", help="check the images .test-images points at, again")
    parser.add_argument("--print-key", action="store_true", help="print the recipe's cache key and exit")
    args = parser.parse_args(argv)
    os.umask(0o022)  # what it writes is read by the sandboxes' uids (make_world_readable makes sure of it)
    if args.print_key:
        print(recipe_key())
        return 0
    images = ensure(rebuild=args.rebuild)
    if args.check:
        with tempfile.TemporaryDirectory() as scratch:
            check(images.resolve(), Path(scratch), say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
