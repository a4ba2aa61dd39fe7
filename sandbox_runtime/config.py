"""Server configuration: one dataclass, filled by the CLI or by code that embeds the server."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from .models import Limits


def default_state_dir() -> Path:
    """/var/lib/prorl-sandbox for root (the sandbox uids must be able to reach their workspaces, which a
    directory under /root does not allow), else the user's XDG state directory."""
    if os.geteuid() == 0:
        return Path("/var/lib/prorl-sandbox")
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "prorl-sandbox"


# A block of host uids that nothing else on the machine uses: one per live sandbox under a root server.
DEFAULT_SANDBOX_UIDS = range(2_000_000_000, 2_000_065_536)


def parse_uid_range(text: str) -> range:
    """`FIRST-LAST` (inclusive) -> range; refuses uid 0 and ranges that are empty or past 2**32 - 2."""
    first, sep, last = text.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        raise ValueError(f"uid range {text!r} is not FIRST-LAST, e.g. 2000000000-2000065535") from None
    if not sep or not 0 < low <= high < 2**32 - 1:
        raise ValueError(f"uid range {text!r} must be FIRST-LAST with 0 < FIRST <= LAST < 4294967295")
    return range(low, high + 1)


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
            memory_mb=8192, pids=1024, cpu_seconds=3600, file_size_mb=1024, open_files=4096, disk_mb=4096
        )
    )
    # What a spec may ask for at most; above it is a 400 naming the limit. Clamped at start-up to the
    # server's own hard rlimits, which an unprivileged sandbox cannot raise.
    max_limits: Limits = field(
        default_factory=lambda: Limits(
            memory_mb=65536, pids=4096, cpu_seconds=86400, file_size_mb=16384, open_files=65536, disk_mb=65536
        )
    )
    image_dirs: list[Path] = field(default_factory=list)  # where `image` names are looked up; nothing else
    allow_local: bool = False  # the `local` backend isolates nothing: only when the operator says so
    sandbox_uids: range = DEFAULT_SANDBOX_UIDS  # used when the server runs as root
    default_timeout_s: float = 60.0
    max_timeout_s: float = 3600.0
    default_output_bytes: int = 64 * 1024
    max_output_bytes: int = 16 * 1024 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    apptainer_binary: str | None = None
    apptainer_fakeroot: bool = False
    reap_interval_s: float = 1.0

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback without a token: anyone who reaches the port runs commands."""
        check_exposure(self.host, self.token, "PRORL_SANDBOX_TOKEN")


def check_exposure(host: str, token: str | None, token_variable: str) -> None:
    """A server of this project listens beyond loopback only with a token (both servers use this rule)."""
    if token or is_loopback(host):
        return
    raise ValueError(
        f"refusing to listen on {host!r} without a token: set --token or {token_variable}, or bind to 127.0.0.1"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
