"""What the benchmarks share: the machine they ran on, and their own section of docs/benchmarks.md, between
their start and end markers."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """CPUs, CPU model, memory, kernel and Python, as the first words of each benchmark's machine line."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown CPU")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    return (
        f"{len(os.sched_getaffinity(0))} CPUs (nproc), {model}, {mem_kib / 1024**2:.1f} GiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def replace_section(path: Path, start: str, end: str, block: str) -> None:
    """Put `block` (which begins with `start` and ends with `end`) in place of the section in `path`, re-read
    just now, keeping whatever else the file holds; append it where the file has no such section yet."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
