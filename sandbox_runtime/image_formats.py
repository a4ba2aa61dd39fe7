"""Reading image files: what kind an image is, where a SIF file keeps its root, what an OCI layout or a
`docker save` archive holds. Pure functions over files; the cache that uses them is images.py.

- `sif`: a Singularity/Apptainer SIF file. Its header is read here rather than through siftool, which prints only
  a table meant for people; the header is a fixed binary layout (github.com/sylabs/sif, `pkg/sif`) unchanged
  since SIF 1.
- `oci`: an OCI image layout directory. An entry of its index may itself be an image index (a multi-platform
  image): the manifest for this machine's platform is taken from it.
- `docker-archive`: a `docker save` tarball (gzip'd or not), either kind: newer Docker writes an OCI layout into
  it, older Docker (and `podman save --format docker-archive`) a `manifest.json` with one tar per layer. Either
  becomes an OCI layout by copying members by name, never by extracting: nothing in the archive decides where a
  file is written.
- `directory`: an unpacked root filesystem.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import struct
import tarfile
import tempfile
import zlib
from pathlib import Path

from server_kit.errors import ApiError

from .models import ImageFormat, check_env

_ROOT_MARKERS = ("usr", "bin", "etc")
_REF_NAME = "org.opencontainers.image.ref.name"
_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
MAX_JSON_BYTES = 4 << 20  # an index, manifest or config larger than this is no image's
UNTAGGED = "untagged"  # the tag an image saved without one is known by
_MACHINES = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}

# SIF's global header and data object descriptors (little-endian, packed; sylabs/sif pkg/sif/sif.go).
_SIF_HEADER = struct.Struct("<32s10s3s3s16s8q")  # launch script, magic, version, arch, uuid, 8 int64 fields
_SIF_DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq128s384s")  # type, used, id, group, link, offset, size, ...
_SIF_PARTITION = struct.Struct("<ii")  # a partition descriptor's extra: filesystem type, partition type
_SIF_MAGIC = b"SIF_MAGIC"
_SIF_DATA_PARTITION = 0x4004
_SIF_FS_SQUASH = 1
_SIF_PART_PRIMARY_SYSTEM = 2


class ImageError(ApiError):
    """An image that cannot be found or used; `status` is the HTTP status to answer with: 400 for what the spec
    named (an unknown image, a tag it lacks, a file that is no image), 500 for the server's side (a tool, the disk),
    507 for an image that does not fit the cache."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# What one entry of an image costs on disk beyond its bytes: an inode and a directory entry. With it, a layer of a
# million empty files is counted for the space it takes, not as nothing.
ENTRY_BYTES = 512
BLOCK = 4096


def entry_bytes(size: int) -> int:
    """The disk one entry of `size` bytes takes at most once unpacked: whole blocks, and its inode."""
    return -(-max(size, 0) // BLOCK) * BLOCK + ENTRY_BYTES


class UnpackBudget:
    """The bytes an unpack may write into the cache: spent as they are written (a docker archive's blobs) or
    before (a layer's entries, counted from its own headers), so that an image expanding far beyond its compressed
    size is refused before it fills the disk, not after. What the image's root will hold may not pass the cache's
    bound (`kept`: None for none); everything written, working copies included, may not pass the state disk's
    free space above its floor (`room`, explained by `why`)."""

    def __init__(self, kept: int | None, room: int, why: str) -> None:
        self.kept, self.room, self.why = kept, room, why
        self.kept_spent = self.spent = 0

    def spend(self, size: int, name: str, kept: bool = True) -> None:
        """Count `size` bytes written (`kept`: into the root that stays cached, else a working copy)."""
        self.spent += size
        self.kept_spent += size if kept else 0
        if self.kept is not None and self.kept_spent > self.kept:
            raise ImageError(
                f"no space in the image cache to unpack {name}: it expands to more than the cache's bound of "
                f"{self.kept} bytes (--image-cache-gb)",
                507,
            )
        if self.spent > self.room:
            raise ImageError(f"no space in the image cache to unpack {name}: {self.why}", 507)


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
            if head[:2] == b"\x1f\x8b":
                with gzip.open(path) as unzipped:
                    head = unzipped.read(512)
            if len(head) >= 262 and head[257:262] == b"ustar":
                return "docker-archive"
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def choose_tag(tags: list[str], tag: str | None, name: str) -> str:
    """The tag `tag` names among an image's `tags` (None: the only one, else `latest`), or a 400 saying which
    there are."""
    named = ", ".join(f"{name}:{t}" for t in dict.fromkeys(tags)) or "none"
    if tag is None:
        if len(tags) == 1:
            return tags[0]
        tag = "latest"
        if tag not in tags:
            raise ImageError(f"image {name!r} holds {len(tags)} images; name one: {named}")
    if tags.count(tag) > 1:
        raise ImageError(f"image {name!r} holds several images tagged {tag!r} (from different repositories)")
    if tag not in tags:
        raise ImageError(f"image {name!r} has no tag {tag!r}; it has: {named}")
    return tag


# -- SIF ---------------------------------------------------------------------------------------------------
def sif_root_partition(path: Path) -> tuple[int, int]:
    """(offset, size) of the primary system partition of SIF file `path`: a squashfs, as Apptainer runs it."""
    with open(path, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        header = handle.read(_SIF_HEADER.size)
        if len(header) < _SIF_HEADER.size or not header[32:].startswith(_SIF_MAGIC):
            raise ImageError(f"{path.name} is not a SIF file")
        fields = _SIF_HEADER.unpack(header)
        total, offset = fields[8], fields[9]
        if not 0 < total <= 4096 or not _SIF_HEADER.size <= offset < file_size:
            raise ImageError(f"{path.name}: a damaged SIF header ({total} descriptors at {offset})")
        handle.seek(offset)
        table = handle.read(total * _SIF_DESCRIPTOR.size)
    for index in range(len(table) // _SIF_DESCRIPTOR.size):
        kind, used, _id, _group, _link, start, size, *_rest, extra = _SIF_DESCRIPTOR.unpack_from(
            table, index * _SIF_DESCRIPTOR.size
        )
        if not used or kind != _SIF_DATA_PARTITION:
            continue
        fstype, parttype = _SIF_PARTITION.unpack_from(extra)
        if parttype != _SIF_PART_PRIMARY_SYSTEM:
            continue
        if fstype != _SIF_FS_SQUASH:
            raise ImageError(f"{path.name}: its root partition is not squashfs (encrypted SIF is not supported)")
        if not (start > 0 and size > 0 and start + size <= file_size):
            raise ImageError(f"{path.name}: its root partition lies outside the file (a damaged SIF)")
        return start, size
    raise ImageError(f"{path.name}: this SIF file has no primary system partition")


# -- OCI layouts -------------------------------------------------------------------------------------------
def _parse_json(data: bytes, what: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ImageError(f"{what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ImageError(f"{what} is not a JSON object")
    return value


def _read_small(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise ImageError(f"{what} is missing") from None
    except OSError as exc:
        raise ImageError(f"cannot read {what} ({exc})", 500) from None
    if len(data) > MAX_JSON_BYTES:
        raise ImageError(f"{what} is over {MAX_JSON_BYTES} bytes")
    return data


def blob_path(layout: Path, digest: object) -> Path:
    algorithm, _, hexdigest = str(digest).partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ImageError(f"{layout.name}: unsupported digest {digest!r}")
    return layout / "blobs" / "sha256" / hexdigest


def read_blob_json(layout: Path, digest: object, name: str) -> dict:
    """A small JSON blob (index, manifest, config), checked against its digest: what is read is what is named."""
    path = blob_path(layout, digest)
    data = _read_small(path, f"{name}: blob {digest}")
    if hashlib.sha256(data).hexdigest() != path.name:
        raise ImageError(f"{name}: blob {digest} does not match its digest")
    return _parse_json(data, f"{name}: blob {digest}")


def oci_index(layout: Path, name: str) -> list[dict]:
    index = _parse_json(_read_small(layout / "index.json", f"{name}: index.json"), f"{name}: index.json")
    return [entry for entry in index.get("manifests") or [] if isinstance(entry, dict)]


def oci_tags(layout: Path, name: str) -> list[str]:
    """The tags of an OCI layout's images, in index order; an image without a ref name is UNTAGGED."""
    return _tags(oci_index(layout, name))


def _tags(entries: list[dict]) -> list[str]:
    return [(entry.get("annotations") or {}).get(_REF_NAME) or UNTAGGED for entry in entries]


def oci_manifest(layout: Path, tag: str | None, name: str) -> tuple[str, str]:
    """(tag, manifest digest) of the image `tag` names (None: the only one, or `latest`); for a multi-platform
    image, the manifest of this machine's platform."""
    entries = oci_index(layout, name)
    tags = _tags(entries)
    chosen = choose_tag(tags, tag, name)
    entry = entries[tags.index(chosen)]
    for _ in range(4):  # an index of indexes, at most this deep
        if entry.get("mediaType") not in (_OCI_INDEX, _DOCKER_LIST):
            return chosen, str(entry.get("digest"))
        entry = _platform_manifest(read_blob_json(layout, entry.get("digest"), name), name)
    raise ImageError(f"image {name!r}: its image index nests too deep")


def _platform_manifest(index: dict, name: str) -> dict:
    arch = _MACHINES.get(platform.machine(), platform.machine())
    for entry in index.get("manifests") or []:
        wanted = (entry.get("platform") or {}) if isinstance(entry, dict) else {}
        if wanted.get("os") == "linux" and wanted.get("architecture") == arch:
            return entry
    raise ImageError(f"image {name!r} has no linux/{arch} image in its index")


def oci_config(layout: Path, manifest_digest: str, name: str) -> tuple[dict[str, str], list[str]]:
    """The image's environment (its config's `Env`, later entries winning; names the sandbox's shell could not
    take are left out) and its layers' media types."""
    manifest = read_blob_json(layout, manifest_digest, name)
    config = read_blob_json(layout, (manifest.get("config") or {}).get("digest", ""), name)
    env: dict[str, str] = {}
    for entry in (config.get("config") or {}).get("Env") or []:
        if isinstance(entry, str) and "=" in entry:
            key, _, value = entry.partition("=")
            try:
                env.update(check_env({key: value}))
            except ValueError:
                continue  # e.g. PROMPT_COMMAND: the runtime's shell owns it
    media = [str(layer.get("mediaType", "")) for layer in manifest.get("layers") or [] if isinstance(layer, dict)]
    return env, media


def spend_layers(layout: Path, manifest_digest: str, name: str, budget: UnpackBudget) -> None:
    """Spend on `budget` what the image's layers unpack to, read from their tar headers in one streaming pass
    (every layer counted in full: a later layer's whiteout frees nothing until the end). Stops at the first header
    over the budget, so a small layer declaring gigabytes is refused without reading its data."""
    manifest = read_blob_json(layout, manifest_digest, name)
    for layer in manifest.get("layers") or []:
        if not isinstance(layer, dict):
            continue
        path = blob_path(layout, layer.get("digest"))
        try:
            with open(path, "rb") as handle, tarfile.open(fileobj=handle, mode="r|*") as tar:
                for member in tar:
                    budget.spend(entry_bytes(member.size if member.isreg() else 0), name)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ImageError(f"{name}: layer {layer.get('digest')} is not a readable tar ({exc})") from None
        except FileNotFoundError:
            raise ImageError(f"{name}: layer {layer.get('digest')} is missing") from None


def check_layers(media_types: list[str], name: str) -> None:
    """umoci 0.4 (Debian 12) applies plain and gzip layers only."""
    for media in media_types:
        if media.endswith("+zstd") or "zstd" in media:
            raise ImageError(
                f"image {name!r} has zstd-compressed layers, which this server's umoci cannot apply; recompress "
                "them, e.g. skopeo copy --dest-compress-format gzip oci:SRC oci:DEST"
            )


def single_tag_layout(source: Path, manifest_digest: str, tag: str, target: Path) -> Path:
    """A layout at `target` whose index names only `manifest_digest`, as `tag`, sharing `source`'s blobs (a
    link): what umoci unpacks, whatever the source's index holds (an image index, a path with ':')."""
    target.mkdir(parents=True)
    (target / "blobs").symlink_to(source.resolve() / "blobs")
    (target / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    manifest = blob_path(source, manifest_digest)
    entry = {
        "mediaType": _OCI_MANIFEST,
        "digest": manifest_digest,
        "size": manifest.stat().st_size,
        "annotations": {_REF_NAME: tag},
    }
    (target / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    return target


# -- docker save archives ----------------------------------------------------------------------------------
def archive_tags(archive: Path, name: str) -> list[str]:
    """The tags of a `docker save` archive's images, read from its index without extracting it (a repository's
    name is left out: `repo:tag` is known by `tag`)."""
    try:
        with tarfile.open(archive) as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.name.endswith(".json")}
            if "manifest.json" in members:
                entries = json.load(tar.extractfile(members["manifest.json"]))  # type: ignore[arg-type]
                return [
                    t.rpartition(":")[2] if isinstance(t, str) else UNTAGGED
                    for entry in entries if isinstance(entry, dict)
                    for t in entry.get("RepoTags") or [UNTAGGED]
                ]  # fmt: skip
            if "index.json" in members:
                index = json.load(tar.extractfile(members["index.json"]))  # type: ignore[arg-type]
                return [
                    (m.get("annotations") or {}).get(_REF_NAME) or UNTAGGED
                    for m in index.get("manifests") or [] if isinstance(m, dict)
                ]  # fmt: skip
    except (tarfile.TarError, EOFError, ValueError, AttributeError, TypeError) as exc:
        raise ImageError(f"{name}: cannot read the archive's index ({exc})") from None
    except OSError as exc:
        raise ImageError(f"{name}: cannot read the archive ({exc})", 500) from None
    raise ImageError(f"{name}: not a docker save archive (no manifest.json or index.json)")


def docker_archive_to_layout(archive: Path, layout: Path, name: str, budget: UnpackBudget | None = None) -> Path:
    """An OCI layout at `layout` for the `docker save` archive `archive`: the one inside it (newer Docker), or
    one made from the classic `manifest.json` format's files, their digests computed and nothing else changed.
    Members are copied by name, never extracted; a layer that the classic format stores as a link to another
    is read through it. Images without a tag are tagged UNTAGGED, as archive_tags names them. Each byte copied
    is spent on `budget` as it is written: a gzip'd archive of a few MB may hold layers of gigabytes."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers()}

            def member(member_name: str):
                handle = tar.extractfile(members[member_name]) if member_name in members else None
                if handle is None:
                    raise ImageError(f"{name}: no file {member_name!r} in the archive")
                return handle

            def copy_blob(member_name: str) -> tuple[str, int, bytes]:
                """Copy a member into blobs/ under its digest; returns (digest, size, its first bytes)."""
                handle, digest, size, head = member(member_name), hashlib.sha256(), 0, b""
                with tempfile.NamedTemporaryFile(dir=blobs, delete=False) as out:
                    while chunk := handle.read(1 << 20):
                        if budget is not None:
                            budget.spend(len(chunk), name, kept=False)
                        head = head or chunk[:4]
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                os.replace(out.name, blobs / digest.hexdigest())
                return "sha256:" + digest.hexdigest(), size, head

            if "oci-layout" in members and "index.json" in members:
                for member_name, info in members.items():
                    parts = member_name.split("/")
                    if len(parts) == 3 and parts[:2] == ["blobs", "sha256"] and info.isfile():
                        blob_path(layout, "sha256:" + parts[2])  # a name that is a sha256 digest, nothing else
                        copy_blob(member_name)
                index = _parse_json(member("index.json").read(MAX_JSON_BYTES), f"{name}: index.json")
                manifests = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
                for entry in manifests:
                    entry.setdefault("annotations", {}).setdefault(_REF_NAME, UNTAGGED)
            else:
                manifests = _classic_manifests(member, copy_blob, blobs, name)
    except ImageError:
        raise
    except (tarfile.TarError, EOFError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ImageError(f"{name}: not a readable docker save archive ({exc})") from None
    except OSError as exc:
        raise ImageError(f"{name}: cannot convert the archive ({exc})", 500) from None
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return layout


def _classic_manifests(member, copy_blob, blobs: Path, name: str) -> list[dict]:
    """Index entries for the classic format's images: a manifest written for each, over copied blobs."""
    entries = json.loads(member("manifest.json").read(MAX_JSON_BYTES))
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{name}: manifest.json lists no image")
    manifests = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str):
            raise ImageError(f"{name}: a manifest.json entry has no Config")
        config_digest, config_size, _ = copy_blob(entry["Config"])
        layers = []
        for layer in entry.get("Layers") or []:
            digest, size, head = copy_blob(layer)
            media = _OCI_LAYER + ("+gzip" if head[:2] == b"\x1f\x8b" else "")
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
        for tag in entry.get("RepoTags") or [UNTAGGED]:
            ref = {_REF_NAME: tag.rpartition(":")[2] if isinstance(tag, str) else UNTAGGED}
            manifests.append(
                {"mediaType": _OCI_MANIFEST, "digest": f"sha256:{digest}", "size": len(data), "annotations": ref}
            )
    return manifests
