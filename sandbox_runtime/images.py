"""Images by name: what a spec's `image` names under the server's image directories, unpacked once.

An image is one of four things below an `--image-dir`:
- `directory`: an unpacked root filesystem (it has `usr`, `bin` or `etc`), used where it is;
- `sif`: a Singularity/Apptainer SIF file; its primary system partition (squashfs) is unpacked by `unsquashfs`;
- `oci`: an OCI image layout directory (`oci-layout`, `index.json`, `blobs/`), unpacked by `umoci`, layers in
  order with their whiteouts; a name may end in `:TAG` (its `org.opencontainers.image.ref.name`);
- `docker-archive`: a `docker save` tarball, either kind: newer Docker writes an OCI layout into it, older Docker
  (and `podman save --format docker-archive`) a `manifest.json` with one tar per layer, which is rewritten here into
  an OCI layout (digests computed, nothing else changed) so that umoci applies it the same way.

Files are unpacked once into a content-addressed cache, `<state dir>/images/<sha256>/root`, keyed by the digest
of the SIF or tarball (or the OCI manifest's own digest): the same image under two names, or renamed, is unpacked
once; a changed file is a new image. Concurrent first uses wait for the one unpack. An entry is complete only once
its directory has been renamed into place, so a server killed mid-unpack leaves only a temporary directory, which
the next start removes. The backends mount the root read-only (bwrap) or hand it to Apptainer as a sandbox
directory; a backend that runs SIF itself (Apptainer) gets the SIF file and nothing is unpacked for it.

Why umoci and unsquashfs rather than Python's tarfile: a layer may hold a link at a path that a later layer writes
through (`etc -> /`, then `etc/passwd`), device nodes and whiteouts; umoci resolves every path inside the root
(securejoin) and applies whiteouts as the image spec says, and both tools are Debian's. The SIF header, on the
other hand, is read here: siftool prints only a table meant for people, and the header is a fixed binary layout
(github.com/sylabs/sif, `pkg/sif`) that has not changed since SIF 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .models import ImageInfo, ImageList

log = logging.getLogger(__name__)

ImageFormat = Literal["directory", "sif", "oci", "docker-archive"]
CacheState = Literal["in place", "unpacked", "unpacking", "not unpacked"]

UNPACK_TIMEOUT_S = 1800.0  # a multi-GB SWE-bench image on a slow shared file system
MAX_LISTED = 10_000  # GET /v1/images stops walking after this many images
MAX_DEPTH = 4  # how deep below an image directory the listing looks for images
_ROOT_MARKERS = ("usr", "bin", "etc")
DIGESTS = "digests.json"
UNTAGGED = "untagged"  # the tag an untagged image of a docker archive gets in the layout made from it
_REF_NAME = "org.opencontainers.image.ref.name"
_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"

# SIF's global header and data object descriptors (little-endian, packed; sylabs/sif pkg/sif/sif.go).
_SIF_HEADER = struct.Struct("<32s10s3s3s16s8q")  # launch script, magic, version, arch, uuid, 8 int64 fields
_SIF_DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq128s384s")  # type, used, id, group, link, offset, size, ...
_SIF_PARTITION = struct.Struct("<ii")  # a partition descriptor's extra: filesystem type, partition type
_SIF_MAGIC = b"SIF_MAGIC"
_SIF_DATA_PARTITION = 0x4004
_SIF_FS_SQUASH = 1
_SIF_PART_PRIMARY_SYSTEM = 2


class ImageError(Exception):
    """An image that cannot be found or used; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Image:
    """An image as found: the name a spec gave, where it is, what it is, and the tag asked for (OCI only)."""

    name: str
    path: Path
    format: ImageFormat
    tag: str | None = None


@dataclass(frozen=True)
class Unpacked:
    """What a sandbox runs: the root directory (or, for a backend that runs SIF itself, the SIF file), the
    image's own environment (an OCI config's `Env`), and the cache entry it came from (None: used in place)."""

    root: Path | None
    file: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    digest: str | None = None


def detect_format(path: Path) -> ImageFormat | None:
    """What `path` holds, from its own bytes and entries, never its name."""
    try:
        if path.is_dir():
            if (path / "oci-layout").is_file() and (path / "index.json").is_file():
                return "oci"
            return "directory" if any(os.path.lexists(path / m) for m in _ROOT_MARKERS) else None
        if path.is_file():
            with open(path, "rb") as handle:
                head = handle.read(512)
            if head[32 : 32 + len(_SIF_MAGIC)] == _SIF_MAGIC:
                return "sif"
            if len(head) >= 262 and head[257:262] == b"ustar":
                return "docker-archive"
    except OSError:
        return None
    return None


def sif_root_partition(path: Path) -> tuple[int, int]:
    """(offset, size) of the primary system partition of SIF file `path`: a squashfs, as Apptainer runs it."""
    with open(path, "rb") as handle:
        header = handle.read(_SIF_HEADER.size)
        if len(header) < _SIF_HEADER.size or not header[32:].startswith(_SIF_MAGIC):
            raise ImageError(f"{path.name} is not a SIF file")
        fields = _SIF_HEADER.unpack(header)
        total, offset = fields[8], fields[9]
        if not 0 < total <= 4096:
            raise ImageError(f"{path.name}: implausible SIF header ({total} descriptors)")
        handle.seek(offset)
        table = handle.read(total * _SIF_DESCRIPTOR.size)
    found = []
    for index in range(len(table) // _SIF_DESCRIPTOR.size):
        kind, used, _id, _group, _link, start, size, *_rest, extra = _SIF_DESCRIPTOR.unpack_from(
            table, index * _SIF_DESCRIPTOR.size
        )
        if used and kind == _SIF_DATA_PARTITION:
            fstype, parttype = _SIF_PARTITION.unpack_from(extra)
            found.append((parttype, fstype, start, size))
    for parttype, fstype, start, size in found:
        if parttype == _SIF_PART_PRIMARY_SYSTEM:
            if fstype != _SIF_FS_SQUASH:
                raise ImageError(f"{path.name}: its root partition is not squashfs (encrypted SIF is not supported)")
            return start, size
    raise ImageError(f"{path.name}: this SIF file has no primary system partition")


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{path} {stat.st_ino} {stat.st_size} {stat.st_mtime_ns}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# -- OCI layouts -------------------------------------------------------------------------------------------
def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ImageError(f"{what}: cannot read {path.name} ({exc})") from None
    if not isinstance(value, dict):
        raise ImageError(f"{what}: {path.name} is not a JSON object")
    return value


def oci_tags(layout: Path) -> dict[str, str]:
    """tag -> manifest digest of an OCI layout; a manifest without a ref name is listed under ''."""
    index = _read_json(layout / "index.json", layout.name)
    tags = {}
    for entry in index.get("manifests") or []:
        if isinstance(entry, dict) and isinstance(entry.get("digest"), str):
            tags[(entry.get("annotations") or {}).get(_REF_NAME, "")] = entry["digest"]
    return tags


def oci_manifest(layout: Path, tag: str | None, name: str) -> tuple[str, str]:
    """(tag, manifest digest) that `tag` (None: the only one, or `latest`) names in the layout."""
    tags = oci_tags(layout)
    if tag is None:
        if len(tags) == 1:
            return next(iter(tags.items()))
        if "latest" in tags:
            return "latest", tags["latest"]
        named = ", ".join(f"{name}:{t}" for t in tags if t)
        raise ImageError(f"image {name!r} holds {len(tags)} images; name one: {named}")
    if tag not in tags:
        raise ImageError(f"image {name!r} has no tag {tag!r}; it has: {', '.join(t for t in tags if t) or 'none'}")
    return tag, tags[tag]


def _blob(layout: Path, digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ImageError(f"{layout.name}: unsupported digest {digest!r}")
    return layout / "blobs" / "sha256" / hexdigest


def oci_env(layout: Path, manifest_digest: str) -> dict[str, str]:
    """The image config's `Env`, as a dict (later entries win, as a container runtime applies them)."""
    manifest = _read_json(_blob(layout, manifest_digest), layout.name)
    config = _read_json(_blob(layout, (manifest.get("config") or {}).get("digest", "")), layout.name)
    env = {}
    for entry in (config.get("config") or {}).get("Env") or []:
        if isinstance(entry, str) and "=" in entry:
            key, _, value = entry.partition("=")
            env[key] = value
    return env


def docker_archive_to_layout(archive: Path, layout: Path) -> Path:
    """An OCI layout at `layout` for the `docker save` archive `archive`: the one inside it (newer Docker), or
    one made from the classic `manifest.json` format's files, their digests computed and nothing else changed.

    Members are copied by name, never extracted: nothing in the archive decides where a file is written (no
    path, no link), and a layer that the classic format stores as a link to another is read through it.
    """
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers()}

            def read(name: str) -> bytes:
                handle = tar.extractfile(members[name]) if name in members else None
                if handle is None:
                    raise ImageError(f"{archive.name}: no file {name!r} in the archive")
                return handle.read()

            def copy_blob(name: str) -> tuple[str, int]:
                handle = tar.extractfile(members[name]) if name in members else None
                if handle is None:
                    raise ImageError(f"{archive.name}: no file {name!r} in the archive")
                digest, size = hashlib.sha256(), 0
                with tempfile.NamedTemporaryFile(dir=blobs, delete=False) as out:
                    while chunk := handle.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                os.replace(out.name, blobs / digest.hexdigest())
                return "sha256:" + digest.hexdigest(), size

            if "oci-layout" in members and "index.json" in members:
                for name in members:
                    parts = name.split("/")
                    if len(parts) == 3 and parts[:2] == ["blobs", "sha256"] and members[name].isfile():
                        _blob(layout, "sha256:" + parts[2])  # a name that is a sha256 digest, nothing else
                        copy_blob(name)
                (layout / "index.json").write_bytes(read("index.json"))
                (layout / "oci-layout").write_bytes(read("oci-layout"))
                return layout
            entries = json.loads(read("manifest.json"))
            if not isinstance(entries, list) or not entries:
                raise ImageError(f"{archive.name}: manifest.json lists no image")
            manifests = []
            for entry in entries:
                if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str):
                    raise ImageError(f"{archive.name}: a manifest.json entry has no Config")
                config_digest, config_size = copy_blob(entry["Config"])
                layers = []
                for layer in entry.get("Layers") or []:
                    head = tar.extractfile(members[layer]).read(2) if layer in members else b""  # type: ignore[union-attr]
                    digest, size = copy_blob(layer)
                    media = _OCI_LAYER + ("+gzip" if head == b"\x1f\x8b" else "")
                    layers.append({"mediaType": media, "digest": digest, "size": size})
                manifest = {
                    "schemaVersion": 2,
                    "mediaType": _OCI_MANIFEST,
                    "config": {"mediaType": _OCI_CONFIG, "digest": config_digest, "size": config_size},
                    "layers": layers,
                }
                data = json.dumps(manifest, separators=(",", ":")).encode()
                digest = hashlib.sha256(data).hexdigest()
                (blobs / digest).write_bytes(data)
                # umoci unpacks by tag: an image saved without one is named UNTAGGED, as archive_tag expects
                tags = [t.rpartition(":")[2] for t in entry.get("RepoTags") or [] if isinstance(t, str)] or [""]
                for tag in tags:
                    ref = {_REF_NAME: tag or UNTAGGED}
                    manifests.append(
                        {
                            "mediaType": _OCI_MANIFEST,
                            "digest": "sha256:" + digest,
                            "size": len(data),
                            "annotations": ref,
                        }
                    )
    except (tarfile.TarError, OSError, ValueError, KeyError, AttributeError) as exc:
        raise ImageError(f"{archive.name}: not a readable docker save archive ({exc})") from None
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return layout


def archive_tag(archive: Path, tag: str | None, name: str) -> str:
    """Which of a `docker save` archive's images `tag` names (None: the only one, or `latest`), read from its
    index without extracting it; '' for an archive whose only image has no tag."""
    try:
        with tarfile.open(archive) as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.name.endswith(".json")}
            if "manifest.json" in members:
                entries = json.load(tar.extractfile(members["manifest.json"]))  # type: ignore[arg-type]
                tags = [
                    t.rpartition(":")[2]
                    for entry in entries if isinstance(entry, dict)
                    for t in entry.get("RepoTags") or [""] if isinstance(t, str)
                ]  # fmt: skip
            elif "index.json" in members:
                index = json.load(tar.extractfile(members["index.json"]))  # type: ignore[arg-type]
                tags = [(m.get("annotations") or {}).get(_REF_NAME, "") for m in index.get("manifests") or []]
            else:
                raise ImageError(f"{name}: not a docker save archive (no manifest.json or index.json)")
    except (tarfile.TarError, OSError, ValueError, AttributeError) as exc:
        raise ImageError(f"{name}: cannot read the archive's index ({exc})") from None
    if tag is not None:
        if tag not in tags:
            raise ImageError(f"image {name!r} has no tag {tag!r}; it has: {', '.join(t for t in tags if t) or 'none'}")
        return tag
    if len(set(tags)) == 1:
        return tags[0]
    if "latest" in tags:
        return "latest"
    raise ImageError(f"image {name!r} holds {len(tags)} images; name one: {', '.join(f'{name}:{t}' for t in tags)}")


# -- the store ---------------------------------------------------------------------------------------------
async def _run(argv: list[str], timeout: float = UNPACK_TIMEOUT_S) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, output.decode("utf-8", errors="replace")[-2000:]


def tree_bytes(root: Path) -> int:
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


class ImageStore:
    """Finds images under the image directories and unpacks them into a content-addressed cache."""

    def __init__(
        self,
        image_dirs: list[Path],
        cache_dir: Path,
        max_bytes: int | None = None,
        in_use: Callable[[], set[str]] = set,
    ) -> None:
        self.image_dirs = [d.resolve() for d in image_dirs]
        self.cache_dir = cache_dir
        self.max_bytes = max_bytes
        self._in_use = in_use  # digests that live sandboxes run: never evicted
        self._locks: dict[str, asyncio.Lock] = {}
        self._unpacking: set[str] = set()
        # "path inode size mtime" -> sha256: a file is hashed once while it stays the same file, also across
        # restarts (a directory of SWE-bench images is tens of GB).
        self._digests: dict[str, str] = {}

    def start(self) -> None:
        """Create the cache and remove what an unpack cut short by a crash left (temporary directories only)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir.chmod(0o711)  # sandbox uids traverse to their image's root; nobody lists the cache
        for entry in self.cache_dir.iterdir():
            if entry.name.startswith((".unpack-", ".evict-")):
                shutil.rmtree(entry, ignore_errors=True)
        with contextlib.suppress(OSError, ValueError):
            memo = json.loads((self.cache_dir / DIGESTS).read_text())
            self._digests = {k: v for k, v in memo.items() if isinstance(k, str) and isinstance(v, str)}

    # -- names ----------------------------------------------------------------------------------------------
    def find(self, name: str) -> Image:
        """The image `name` (validated by the spec: relative, no '..', an optional ':TAG') names."""
        base, _, tag = name.partition(":")
        for directory in self.image_dirs:
            candidate = (directory / base).resolve()
            if not candidate.is_relative_to(directory) or candidate == directory or not candidate.exists():
                continue  # a link out of the image directory is as good as absent
            kind = detect_format(candidate)
            if kind is None:
                raise ImageError(
                    f"image {base!r} is neither a SIF file, an OCI layout, a docker save archive nor a root "
                    "directory (one with usr, bin or etc)"
                )
            if tag and kind not in ("oci", "docker-archive"):
                raise ImageError(f"image {base!r} is a {kind}: only OCI layouts and docker archives have tags")
            return Image(name, candidate, kind, tag or None)
        where = "it has no image directories (--image-dir)" if not self.image_dirs else "its image directories"
        raise ImageError(f"no image named {base!r} on this server: images are looked up in {where}")

    # -- digests --------------------------------------------------------------------------------------------
    async def digest(self, image: Image) -> str | None:
        """sha256 of what the cache is keyed by: the SIF file or tarball, or the OCI manifest; None for a
        directory (it is used in place)."""
        if image.format == "directory":
            return None
        if image.format == "oci":
            _tag, manifest = await asyncio.to_thread(oci_manifest, image.path, image.tag, image.name)
            return manifest.removeprefix("sha256:")
        key = _file_key(image.path)
        if key not in self._digests:
            self._digests[key] = await asyncio.to_thread(file_sha256, image.path)
            memo = self.cache_dir / DIGESTS
            with contextlib.suppress(OSError):
                (self.cache_dir / (DIGESTS + ".tmp")).write_text(json.dumps(self._digests))
                (self.cache_dir / (DIGESTS + ".tmp")).replace(memo)
        digest = self._digests[key]
        if image.format == "docker-archive":  # one archive may hold several images: the key names which
            tag = await asyncio.to_thread(archive_tag, image.path, image.tag, image.name)
            digest = hashlib.sha256(f"{digest}:{tag}".encode()).hexdigest()
        return digest

    def known_digest(self, image: Image) -> str | None:
        """The digest if it is known without reading the file (for listings)."""
        if image.format == "oci":
            with contextlib.suppress(ImageError):
                return oci_manifest(image.path, image.tag, image.name)[1].removeprefix("sha256:")
            return None
        if image.format == "directory":
            return None
        with contextlib.suppress(OSError, ImageError):
            digest = self._digests.get(_file_key(image.path))
            if digest and image.format == "docker-archive":
                tag = archive_tag(image.path, image.tag, image.name)
                digest = hashlib.sha256(f"{digest}:{tag}".encode()).hexdigest()
            return digest
        return None

    def state(self, digest: str | None) -> CacheState:
        if digest is None:
            return "in place"
        if digest in self._unpacking:
            return "unpacking"
        return "unpacked" if (self.cache_dir / digest / "image.json").is_file() else "not unpacked"

    # -- unpacking ------------------------------------------------------------------------------------------
    async def prepare(self, image: Image, runs_sif: bool = False) -> Unpacked:
        """What a sandbox of `image` runs; unpacks it first if it is not in the cache yet (once, however many
        ask at the same time)."""
        if image.format == "directory":
            return Unpacked(root=image.path)
        if image.format == "sif" and runs_sif:
            sif_root_partition(image.path)  # a SIF file Apptainer could not run either is refused here
            return Unpacked(root=None, file=image.path)
        digest = await self.digest(image)
        assert digest is not None
        entry = self.cache_dir / digest
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:
            if not (entry / "image.json").is_file():
                self._unpacking.add(digest)
                try:
                    await self._unpack(image, entry)
                finally:
                    self._unpacking.discard(digest)
                await self._evict(keep=digest)
        meta = _read_json(entry / "image.json", image.name)
        with contextlib.suppress(OSError):
            os.utime(entry / "image.json")  # its last use: eviction goes by it
        return Unpacked(root=entry / "root", env=dict(meta.get("env") or {}), digest=digest)

    async def _evict(self, keep: str) -> None:
        """Remove the least recently used entries that no sandbox runs until the cache fits its maximum.

        Victims are chosen and renamed away in one step, with no await in between: a sandbox being created
        from an entry is already counted in `in_use` by then (the manager registers it without awaiting after
        `prepare` returns), and a later `prepare` of a renamed entry unpacks it again.
        """
        if self.max_bytes is None:
            return
        entries = []
        for path in self.cache_dir.iterdir():
            with contextlib.suppress(OSError, ImageError, ValueError):
                if not path.name.startswith(".") and (path / "image.json").is_file():
                    size = int(_read_json(path / "image.json", path.name).get("bytes") or 0)
                    entries.append(((path / "image.json").stat().st_mtime, path, size))
        total = sum(size for _, _, size in entries)
        protected = self._in_use() | {keep}
        doomed = []
        for _, path, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if path.name not in protected:
                away = self.cache_dir / f".evict-{path.name}-{time.monotonic_ns()}"
                os.rename(path, away)
                doomed.append(away)
                total -= size
        for away in doomed:
            await asyncio.to_thread(shutil.rmtree, away, True)
        if doomed:
            log.info("image cache: removed %d unused images to stay within %d bytes", len(doomed), self.max_bytes)

    async def _unpack(self, image: Image, entry: Path) -> None:
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.cache_dir))
        try:
            root = work / "root"
            env: dict[str, str] = {}
            if image.format == "sif":
                await self._unpack_sif(image, root)
            else:
                layout, tag = image.path, image.tag
                if image.format == "docker-archive":
                    tag = await asyncio.to_thread(archive_tag, image.path, tag, image.name) or None
                    layout = await asyncio.to_thread(docker_archive_to_layout, image.path, work / "layout")
                tag, manifest = await asyncio.to_thread(oci_manifest, layout, tag, image.name)
                env = await asyncio.to_thread(oci_env, layout, manifest)
                await self._unpack_oci(layout, tag, manifest, root)
                shutil.rmtree(work / "layout", ignore_errors=True)
            root.chmod(0o755)
            size = await asyncio.to_thread(tree_bytes, root)
            meta = {"source": image.name, "format": image.format, "env": env, "bytes": size}
            (work / "image.json").write_text(json.dumps(meta))
            work.chmod(0o711)
            os.rename(work, entry)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, work, True)
            raise
        log.info("unpacked image %s (%s) in %.1f s", image.name, image.format, time.monotonic() - started)

    async def _unpack_sif(self, image: Image, root: Path) -> None:
        if shutil.which("unsquashfs") is None:
            raise ImageError("SIF images need unsquashfs on the server (apt-get install squashfs-tools)", 500)
        offset, _size = await asyncio.to_thread(sif_root_partition, image.path)
        argv = ["unsquashfs", "-no-progress", "-no-xattrs", "-offset", str(offset), "-dest", str(root), str(image.path)]
        code, output = await _run(argv)
        # 2: non-fatal errors (device nodes an unprivileged server cannot create); the root is there.
        if code not in (0, 2) or not root.is_dir():
            raise ImageError(f"cannot unpack {image.name}: unsquashfs exited {code}: {output.strip()}", 500)

    async def _unpack_oci(self, layout: Path, tag: str, manifest: str, root: Path) -> None:
        if shutil.which("umoci") is None:
            raise ImageError("OCI images and docker archives need umoci on the server (apt-get install umoci)", 500)
        if not tag:  # an untagged manifest: give umoci a layout that names it
            raise ImageError(f"{layout.name}: its only image has no tag (org.opencontainers.image.ref.name)")
        argv = ["umoci", "raw", "unpack", "--image", f"{layout}:{tag}", str(root)]
        if os.geteuid() != 0:
            argv.insert(3, "--rootless")
        code, output = await _run(argv)
        if code != 0:
            raise ImageError(f"cannot unpack {layout.name}:{tag}: umoci exited {code}: {output.strip()}", 500)

    # -- listing ------------------------------------------------------------------------------------------
    def image_list(self) -> ImageList:
        """Every image below the image directories (an OCI layout once per tag), with its format, digest where
        known without reading the file, and cache state."""
        found: list[Image] = []
        for directory in self.image_dirs:
            self._walk(directory, directory, 0, found)
        return ImageList(images=[self._info(image) for image in found], truncated=len(found) >= MAX_LISTED)

    def _info(self, image: Image) -> ImageInfo:
        digest = self.known_digest(image)
        state = self.state(digest) if digest or image.format == "directory" else "not unpacked"
        size: int | None = None
        if state == "unpacked":
            with contextlib.suppress(ImageError):
                size = _read_json(self.cache_dir / str(digest) / "image.json", image.name).get("bytes")
        elif image.format in ("sif", "docker-archive"):
            with contextlib.suppress(OSError):
                size = image.path.stat().st_size
        return ImageInfo(name=image.name, format=image.format, digest=digest, cache=state, bytes=size)

    def _walk(self, base: Path, directory: Path, depth: int, found: list[Image]) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith(".") or len(found) >= MAX_LISTED:
                continue
            path = Path(entry.path)
            resolved = path.resolve()
            if not resolved.is_relative_to(base):
                continue  # a link out of the image directory: find() would not take it either
            name = str(path.relative_to(base))
            kind = detect_format(resolved)
            if kind == "oci":
                with contextlib.suppress(ImageError):
                    found += [
                        Image(f"{name}:{t}" if t else name, resolved, kind, t or None) for t in oci_tags(resolved)
                    ]
            elif kind is not None:
                found.append(Image(name, resolved, kind))
            elif entry.is_dir() and depth < MAX_DEPTH:
                self._walk(base, path, depth + 1, found)
