"""Server configuration: one dataclass, filled by the CLI or by code that embeds the server."""

from __future__ import annotations

import argparse
import os
import pwd
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from server_kit.address import check_exposure, check_token
from server_kit.connections import ConnectionLimits

from .host_view import check_host_path
from .models import RUNTIME_NAME_PATTERN, RUNTIME_URL_PATTERN, Limits


def default_state_dir() -> Path:
    """/var/lib/prorl-sandbox for root (the sandbox uids must be able to reach their workspaces, which a
    directory under /root does not allow), else the user's XDG state directory."""
    if os.geteuid() == 0:
        return Path("/var/lib/prorl-sandbox")
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "prorl-sandbox"


RUNTIME_NAME = re.compile(RUNTIME_NAME_PATTERN)
RUNTIME_URL = re.compile(RUNTIME_URL_PATTERN)
# A service's base URL: scheme and host, and a path prefix where it sits behind a proxy.
SERVICE_URL = re.compile(RUNTIME_URL_PATTERN + r"(/[^\s?#]*)?")

# A block of host uids that nothing else on the machine uses: one per live sandbox under a root server.
DEFAULT_SANDBOX_UIDS = range(2_000_000_000, 2_000_065_536)


def parse_uid_range(text: str) -> range:
    """`FIRST-LAST` (inclusive) -> range; refuses uid 0 and ranges that are empty or past 2**32 - 2 with an
    argparse.ArgumentTypeError (a ValueError's message argparse would replace with "invalid value")."""
    first, sep, last = text.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(f"uid range {text!r} is not FIRST-LAST, e.g. 2000000000-2000065535") from None
    if not sep or not 0 < low <= high < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"uid range {text!r} must be FIRST-LAST with 0 < FIRST <= LAST < 4294967295")
    return range(low, high + 1)


def check_sandbox_uids(uids: range) -> None:
    """Refuse a --sandbox-uids range that holds the uid of an account of this machine (the passwd database): a
    root server kills whatever runs as a sandbox uid it takes, and that account's files would be the sandbox's."""
    taken = sorted((entry.pw_uid, entry.pw_name) for entry in pwd.getpwall() if entry.pw_uid in uids)
    if taken:
        (uid, name), more = taken[0], f" and {len(taken) - 1} more" if len(taken) > 1 else ""
        raise ValueError(
            f"--sandbox-uids {uids.start}-{uids.stop - 1} holds uid {uid} of the account {name!r}{more}, whose "
            "processes a sandbox taking that uid would kill: give a range no account uses, such as the default "
            f"{DEFAULT_SANDBOX_UIDS.start}-{DEFAULT_SANDBOX_UIDS.stop - 1}"
        )


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    backend: str | None = None  # None: bwrap where installed, else apptainer; never `local` unless named
    token: str | None = None
    max_sandboxes: int = 1024
    state_dir: Path = field(default_factory=default_state_dir)
    default_limits: Limits = field(
        default_factory=lambda: Limits(
            memory_mb=8192,
            pids=1024,
            cpu_seconds=3600,
            file_size_mb=1024,
            open_files=4096,
            disk_mb=4096,
            inodes=1 << 18,
        )
    )
    # What a spec may ask for at most; above it is a 400 naming the limit. Clamped at start-up to the
    # server's own hard rlimits, which an unprivileged sandbox cannot raise.
    max_limits: Limits = field(
        default_factory=lambda: Limits(
            memory_mb=65536,
            pids=4096,
            cpu_seconds=86400,
            file_size_mb=16384,
            open_files=65536,
            disk_mb=65536,
            inodes=1 << 22,
        )
    )
    image_dirs: list[Path] = field(default_factory=list)  # where `image` names are looked up; nothing else
    # Host paths every bwrap sandbox without an image sees read-only, beside /usr and its own /etc (host_view.py):
    # an agent programs' environment such as /opt/prorl-agent.
    host_paths: list[Path] = field(default_factory=list)
    # Unpacked images kept in <state dir>/images at most; beyond it the least recently used that no sandbox
    # runs are removed (a directory of SWE-bench images unpacks to terabytes).
    image_cache_gb: float = 100.0
    # Whether a root server reserves each sandbox's whole disk limit on the state disk (workspace_fs.admit): a full
    # state disk then never fails a sandbox's writes, at the price of holding only as many sandboxes as the limits
    # add up to. Off, the sparse images are overcommitted, as container runtimes do, and a creation needs only room
    # for its own limit now.
    reserve_disk: bool = False
    allow_local: bool = False  # the `local` backend isolates nothing: only when the operator says so
    sandbox_uids: range = DEFAULT_SANDBOX_UIDS  # used when the server runs as root
    default_timeout_s: float = 60.0
    max_timeout_s: float = 3600.0
    default_output_bytes: int = 64 * 1024
    max_output_bytes: int = 16 * 1024 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    apptainer_binary: str | None = None
    apptainer_fakeroot: bool = False
    apptainer_cgroups: bool | None = None  # --memory/--pids-limit on instances; None: where the machine allows
    reap_interval_s: float = 1.0
    # Rollout services this runtime registers with (heartbeats), and how they know and reach it.
    register: list[str] = field(default_factory=list)
    register_token: str | None = None
    advertise_url: str | None = None  # None: http://HOST:PORT (the machine's name for a wildcard HOST)
    name: str | None = None  # None: HOSTNAME-PORT
    heartbeat_s: float = 2.0
    # A socket listening already, given by whoever started the server (--listen-fd); host and port are its own.
    listen_socket: socket.socket | None = None
    # The front door: header and body deadlines, connection caps (server_kit.connections).
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def check(self) -> None:
        """What start-up refuses, with a message naming the setting: exposure without a token, a token no client
        can send, a host path that sandboxes cannot be shown, sandbox uids of accounts, and a registration that
        could not work."""
        check_exposure(self.host, self.token, "PRORL_SANDBOX_TOKEN")
        check_token(self.token, "--token (or PRORL_SANDBOX_TOKEN)")
        check_token(self.register_token, "--register-token (or PRORL_REGISTRATION_TOKEN)")
        if os.geteuid() == 0:  # only a root server runs sandboxes as uids of their own
            check_sandbox_uids(self.sandbox_uids)
        if self.listen_socket is None and not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a port: give one from 1 to 65535 (0 picks a free one)")
        if self.max_sandboxes < 1:
            raise ValueError(f"--max-sandboxes {self.max_sandboxes} must be at least 1")
        for path in self.host_paths:
            check_host_path(path, self.state_dir)
        if not self.image_cache_gb > 0:
            raise ValueError(f"--image-cache-gb {self.image_cache_gb:g} must be above 0")
        if not 0 < self.heartbeat_s <= 3600:
            raise ValueError(f"--heartbeat-s {self.heartbeat_s:g} must be in (0, 3600]")
        for url in self.register:
            if not SERVICE_URL.fullmatch(url):
                raise ValueError(f"--register {url!r} is not a service URL such as http://rollout-host:8766")
        if self.advertise_url is not None and not RUNTIME_URL.fullmatch(self.advertise_url):
            raise ValueError(f"--advertise-url {self.advertise_url!r} is not a URL such as http://node-7:8765")
        if self.name is not None and not RUNTIME_NAME.fullmatch(self.name):
            raise ValueError(f"--name {self.name!r}: 1-128 of letters, digits and . _ : -")
