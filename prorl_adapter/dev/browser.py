"""Headless Chromium for the viewer's browser test and its screenshots (Debian's `chromium` package; no Playwright,
no WebDriver): the page's DOM after its script ran (`--dump-dom`) or a PNG of it (`--screenshot`).

`--virtual-time-budget` lets the page run until it is idle (its fetches answered, its timers within the budget)
before the DOM is taken, so no sleep is guessed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    """The headless-capable Chromium on PATH, or None."""
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def run_chromium(url: str, *args: str, budget_ms: int = 10_000, timeout_s: float = 120.0) -> str:
    """Chromium's stdout for `url`, loaded headless with `args` (`--dump-dom`, `--screenshot=PATH`, ...), with a
    profile of its own that is removed after."""
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="prorl-chromium-") as profile:
        command = [
            binary,
            "--headless=new",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            *args,
            url,
        ]
        if os.geteuid() == 0:
            # Chromium refuses to run as root with its sandbox on (its sandbox needs an unprivileged user); the
            # page it loads is our own, from loopback.
            command.insert(1, "--no-sandbox")
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(url: str, budget_ms: int = 10_000) -> str:
    """The page's DOM, serialised, once its script has run."""
    return run_chromium(url, "--dump-dom", budget_ms=budget_ms)


def screenshot(url: str, path: Path, width: int = 1400, height: int = 900, budget_ms: int = 10_000) -> None:
    run_chromium(url, f"--screenshot={path}", f"--window-size={width},{height}", budget_ms=budget_ms)
    if not path.is_file():
        raise RuntimeError(f"chromium wrote no screenshot at {path}")


@contextlib.contextmanager
def records_viewer(directory: str | Path, *args: str, cwd: Path | None = None) -> Iterator[str]:
    """`prorl-rollout view DIR ARGS` on a free port, as a process of its own, while the block runs: its page's URL
    (the line it prints once it listens)."""
    command = [sys.executable, "-m", "prorl_adapter", "view", str(directory), "--port", "0", *args]
    with tempfile.TemporaryFile(mode="w+") as log:  # its log, read where it fails (a pipe unread could fill)
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=cwd)
        watchdog = threading.Timer(120, server.kill)  # a viewer that never says where it listens is killed
        watchdog.start()
        try:
            line = server.stdout.readline()  # type: ignore[union-attr]
            watchdog.cancel()
            if " at http://" not in line:
                server.kill()
                server.wait(timeout=30)
                log.seek(0)
                raise RuntimeError(f"prorl-rollout view did not start: {line}{log.read()[-2000:]}")
            yield line.split(" at ", 1)[1].split("#", 1)[0].strip()
        finally:
            watchdog.cancel()
            server.terminate()
            server.wait(timeout=30)
