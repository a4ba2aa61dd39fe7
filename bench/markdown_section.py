"""Each benchmark owns one section of docs/benchmarks.md, between its own start and end markers."""

from __future__ import annotations

from pathlib import Path


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
