"""What a bwrap sandbox without an image sees of the host: `/usr` and the merged-/usr entries beside it (/bin,
/lib ... as the host has them), a minimal `/etc` made for sandboxes, and the host paths the operator names
(`--host-path`, read-only). Nothing else of the host's root: not /srv, /var, /opt, /home, /root, /run, /sys, nor
the server's state dir (other sandboxes' workspaces).

Why a generated /etc rather than the host's: the host's holds secrets (shadow, ssh keys, machine-id, a
credential helper in gitconfig, package index credentials in pip.conf or npmrc, ld.so.preload) and facts about the
host (its hostname, its hosts file). The sandbox's has what a shell, Python, git and TLS need: a few generated
files (passwd and group with root, nobody and the sandbox's own uid; hostname, hosts, nsswitch.conf) and the
world-readable host entries of ETC_FROM_HOST, links kept as links (they point into /usr).

Why built once per server (in the state dir, at its first image-less sandbox) and not per sandbox: then it is
one read-only bind for bwrap, and copying the certificate and alternatives links (hundreds) per sandbox would cost
more than the rest of a creation. Only passwd and group differ between sandboxes (under a root server each has a
uid of its own): two small files per sandbox, bound over the shared ones. resolv.conf is an empty file in the
shared /etc; a sandbox with the network on gets the host's, bound over it when its shell starts.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Top-level names that merged-/usr hosts make links into /usr (Debian: bin, sbin, lib, lib64). A link is
# recreated as the same link; where the host has a real directory there instead, it is bound read-only.
MERGED_USR = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Entries of the host's /etc that a sandbox gets (those present; only what every user may read; links as links).
ETC_FROM_HOST = (
    "alternatives",  # /usr/bin/editor, java, ... are links through here
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "os-release",
    "debian_version",
    "mtab",  # -> /proc/self/mounts: df, mount
    "protocols",
    "services",
    "host.conf",
    "gai.conf",
    "shells",
    "locale.alias",
    "mime.types",
    "python3",  # and every python3.X (ETC_PYTHON_GLOB): Debian's python3 imports sitecustomize from there
    "ssl/certs",
    "ssl/openssl.cnf",
)
ETC_PYTHON_GLOB = "python3.*"
HOSTS = "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
NSSWITCH = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\nprotocols: files\n"
NSSWITCH += "services: files\n"
NOBODY = 65534
# What a sandbox has of its own (or sees already): a host path there would hide it or add nothing.
SANDBOX_OWN = frozenset({"usr", "etc", "proc", "dev", "sys", "tmp", *MERGED_USR})


@dataclass(frozen=True)
class ReadOnly:
    """One thing a sandbox sees read-only: the host's `source` bound at `target`, or (`link`) a link at `target`
    whose text is `source`. bwrap's arguments and the workdir check (bwrap.unmountable_in) are both made from
    these, so that they cannot disagree."""

    target: str
    source: str
    link: bool = False

    def args(self) -> list[str]:
        return ["--symlink" if self.link else "--ro-bind", self.source, self.target]


def top_level(root: Path, names: Iterable[str]) -> Iterator[ReadOnly]:
    """Each of `names` in the directory `root` as the sandbox sees it at its own root: a link recreated as the
    same link (merged-/usr: /bin -> usr/bin), a directory bound read-only, anything else (or nothing) left out."""
    for name in names:
        path = root / name
        if path.is_symlink():
            yield ReadOnly("/" + name, os.readlink(path), link=True)
        elif path.is_dir():
            yield ReadOnly("/" + name, str(path))


def usr_view(root: Path = Path("/")) -> list[ReadOnly]:
    """`root`'s /usr and its merged-/usr entries, as `root` has them."""
    return list(top_level(root, ("usr", *MERGED_USR)))


def build_etc(target: Path, host_etc: Path = Path("/etc")) -> None:
    """Make the sandboxes' shared /etc at `target` afresh (what a previous server left there is replaced): the
    generated files and the entries of ETC_FROM_HOST that `host_etc` has. Readable by every sandbox uid: files
    0644, directories 0755, whatever the server's umask."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    names = {*ETC_FROM_HOST, *(p.name for p in host_etc.glob(ETC_PYTHON_GLOB))}
    for name in sorted(names):
        source = host_etc / name
        if not os.path.lexists(source) or not _world_readable(source):
            continue
        (target / name).parent.mkdir(mode=0o755, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target / name)
        elif source.is_dir():
            shutil.copytree(source, target / name, symlinks=True, ignore=_unreadable)
        elif source.is_file():
            shutil.copyfile(source, target / name)
    generated = {
        "passwd": passwd(None, None, "/"),
        "group": group(None, None),
        "hostname": "sandbox\n",
        "hosts": HOSTS,
        "nsswitch.conf": NSSWITCH,
        "resolv.conf": "",  # where the host's is bound for a sandbox with the network on
    }
    for name, text in generated.items():
        (target / name).write_text(text)
    for directory, _dirs, files in os.walk(target):
        os.chmod(directory, 0o755)
        for name in files:
            if not os.path.islink(os.path.join(directory, name)):
                os.chmod(os.path.join(directory, name), 0o644)


def passwd(uid: int | None, gid: int | None, home: str) -> str:
    """/etc/passwd of a sandbox running as `uid` (None: only root and nobody): tools that look their user up
    (whoami, git's default identity, Python's getpass) find it."""
    lines = ["root:x:0:0:root:/root:/bin/bash", f"nobody:x:{NOBODY}:{NOBODY}:nobody:/nonexistent:/usr/sbin/nologin"]
    if uid is not None and uid not in (0, NOBODY):
        lines.append(f"sandbox:x:{uid}:{gid}:sandbox:{home}:/bin/bash")
    return "\n".join(lines) + "\n"


def group(uid: int | None, gid: int | None) -> str:
    lines = ["root:x:0:", f"nogroup:x:{NOBODY}:"]
    if gid is not None and gid not in (0, NOBODY):
        lines.append(f"sandbox:x:{gid}:")
    return "\n".join(lines) + "\n"


def write_identity(folder: Path, uid: int, gid: int, home: str) -> tuple[Path, Path]:
    """The sandbox's own passwd and group files in `folder` (its folder in the state dir, out of its reach)."""
    files = folder / "passwd", folder / "group"
    for path, text in zip(files, (passwd(uid, gid, home), group(uid, gid)), strict=True):
        path.write_text(text)
        path.chmod(0o644)
    return files


def check_host_path(path: Path, state_dir: Path) -> Path:
    """Refuse, with a message naming `--host-path`, what cannot be shown to sandboxes: a relative or missing
    path, one that would hide a part of the sandbox of its own (or that every sandbox sees already), and one that
    would show the state dir (every sandbox's workspace) or lies in it. The rules hold for the path as named and
    as resolved (a link /opt/x -> /etc would show the host's /etc). Returns the resolved path: what is bound
    (at the named path), so that a link changed after start-up cannot redirect it."""
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"--host-path {str(path)!r} is not an absolute path without '..'")
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"--host-path {path} does not exist (or is a link to nothing)") from None
    except OSError as exc:  # a directory on the way this user may not enter, say
        raise ValueError(f"--host-path {path} cannot be reached by this server: {exc.strerror}") from None
    real, state = Path(os.path.realpath(path)), Path(os.path.realpath(state_dir))
    for shown in (path, real):
        if shown == Path("/") or shown.parts[1] in SANDBOX_OWN:
            resolved = "" if shown == path else f" (a link to {real})"
            raise ValueError(
                f"--host-path {path}{resolved} lies in a directory that sandboxes see already or have their own of "
                f"({', '.join('/' + n for n in sorted(SANDBOX_OWN))})"
            )
    if real == state or state in real.parents or real in state.parents:
        raise ValueError(f"--host-path {path} holds or lies in the state dir {state_dir}: the sandboxes' workspaces")
    return real


def _world_readable(path: Path) -> bool:
    mode = os.lstat(path).st_mode
    return stat.S_ISLNK(mode) or bool(mode & stat.S_IROTH)


def _unreadable(directory: str, names: list[str]) -> set[str]:
    """shutil.copytree's `ignore`: what other users may not read (a private key directory, say) is not copied."""
    return {name for name in names if not _world_readable(Path(directory, name))}
