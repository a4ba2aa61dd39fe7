"""Server configuration: one dataclass, filled by the CLI or by code that embeds the server."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from .models import Limits


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "prorl-sandbox"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    backend: str | None = None  # None: bwrap where installed, else apptainer; never `local` unless named
    token: str | None = None
    max_sandboxes: int = 1024
    state_dir: Path = field(default_factory=default_state_dir)
    default_limits: Limits = field(
        default_factory=lambda: Limits(memory_mb=8192, pids=1024, file_size_mb=1024, open_files=4096)
    )
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
