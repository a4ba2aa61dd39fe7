"""A small root filesystem for container tests: a few of this host's programs and the libraries they load."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PROGRAMS = (
    *("bash", "env", "cat", "sleep", "setsid", "ls", "mkdir", "rm", "touch", "id", "head", "true", "false"),
    *("wc", "yes", "tr", "printf", "grep", "dd", "stat", "ln"),
)


def make_rootfs(root: Path, programs: tuple[str, ...] = PROGRAMS) -> Path:
    """`root` holding /bin and /usr/bin copies of `programs` (bash also as /bin/sh), the libraries they load
    at the paths the loader asks for, the host's passwd and group, and empty system directories."""
    for sub in ("bin", "usr/bin", "etc", "proc", "sys", "dev", "tmp", "root", "home", "var", "mnt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for name in ("passwd", "group"):
        shutil.copy2(f"/etc/{name}", root / "etc" / name)
    for name in ("hosts", "resolv.conf"):
        (root / "etc" / name).touch()
    files: set[str] = set()
    for program in programs:
        path = shutil.which(program, path="/usr/bin:/bin")
        if path is None:
            raise RuntimeError(f"{program} is needed to build the test root filesystem")
        for target in (f"bin/{program}", f"usr/bin/{program}"):
            shutil.copy2(path, root / target)
        ldd = subprocess.run(["ldd", path], capture_output=True, text=True, check=False).stdout
        files.update(word for line in ldd.splitlines() for word in line.split() if word.startswith("/"))
    shutil.copy2(root / "bin" / "bash", root / "bin" / "sh")
    if os.path.exists("/etc/ld.so.cache"):
        files.add("/etc/ld.so.cache")
    for path in files:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)  # follows symlinks: the library itself lands at the path the loader asks for
    return root
