"""Sandboxes from images: what a first use costs (the unpack into the cache) and what every later creation costs,
each against a baseline measured in the same run on the same image.

- First use: POST /v1/sandboxes naming an image the cache does not hold yet (digest, unpack, making the root safe,
  the first shell), against the bare unpack tool on the same file (`unsquashfs` for the SIF, `umoci raw unpack`
  for the OCI layout, the same for the docker archive's content, which the runtime first converts to a layout).
  Each format is unpacked cold `--first-uses` times: the cache is emptied between rounds by deleting its entry.
- Warm creation: POST /v1/sandboxes for the image once it is cached, against bwrap + bash spawned directly with
  the server's own bwrap command line on the same root (the root directory for the directory image, the cache's
  unpacked root for the others), interleaved round by round so that noise hits both alike; and a sandbox of the
  host's root, for comparison with the runtime benchmark.

The images are the Debian test images (`make test-images`, .test-images). Results go to docs/benchmarks.md's
bench_images section (`--out`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from bench_runtime import SHELL, Latency, timed_spawn
from common import BENCH, command_line, machine, replace_section, stop, utc_now

from prorl_adapter.dev import localstack
from sandbox_runtime.backends.base import SandboxDirs
from sandbox_runtime.backends.bwrap import BwrapBackend
from sandbox_runtime.image_formats import sif_root_partition
from sandbox_runtime.images import tree_bytes
from sandbox_runtime.models import SandboxSpec

TEST_IMAGES = BENCH.parent / ".test-images"
NAME = "debian-python"
FORMATS = {"sif": f"{NAME}.sif", "oci": f"{NAME}.oci", "docker-archive": f"{NAME}.docker.tar"}
START, END = "<!-- bench_images:start -->", "<!-- bench_images:end -->"


@dataclass
class FirstUse:
    image: str
    runtime: Latency  # POST /v1/sandboxes on a cold cache
    tool: Latency  # the bare unpack tool on the same content


@dataclass
class Warm:
    image: str
    runtime: Latency  # POST /v1/sandboxes, the image cached
    direct: Latency  # bwrap + bash on the same root, spawned directly


def bare_unpack(fmt: str, work: Path) -> float:
    """Seconds the unpack tool alone takes on the image's content, into a fresh directory."""
    target = Path(tempfile.mkdtemp(dir=work))
    try:
        if fmt == "sif":
            sif = TEST_IMAGES / FORMATS["sif"]
            offset, _ = sif_root_partition(sif)
            argv = ["unsquashfs", "-no-progress", "-no-xattrs", "-offset", str(offset), "-dest", str(target / "r")]
            argv.append(str(sif))
            cwd = None
        else:  # the docker archive holds the same layers as the layout
            argv = ["umoci", "raw", "unpack", "--image", f"{FORMATS['oci']}:latest", str(target / "r")]
            cwd = TEST_IMAGES
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, cwd=cwd)
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(target, ignore_errors=True)


class Runtime:
    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base = http, base

    async def create(self, image: str | None) -> tuple[dict, float]:
        t0 = time.perf_counter()
        async with self.http.post(f"{self.base}/v1/sandboxes", json={"image": image} if image else {}) as resp:
            body = await resp.read()
        elapsed = time.perf_counter() - t0
        if resp.status != 201:
            raise RuntimeError(f"POST /v1/sandboxes {image}: {resp.status} {body[:300]!r}")
        return json.loads(body), elapsed

    async def delete(self, sandbox_id: str) -> None:
        async with self.http.delete(f"{self.base}/v1/sandboxes/{sandbox_id}") as resp:
            await resp.read()


def direct_argv(work: Path, root: Path | None) -> list[str]:
    """The server's own bwrap command line for a sandbox of `root` (None: the host's)."""
    dirs = SandboxDirs("baseline", work / "baseline", image_root=root)
    dirs.workspace.mkdir(parents=True, exist_ok=True)
    dirs.tmp.mkdir(exist_ok=True)
    backend, spec = BwrapBackend(work), SandboxSpec(image="x" if root else None)
    backend.prepare(dirs, spec)  # without an image: the /etc and passwd that its argv binds
    return backend.argv(dirs, spec, SHELL)


async def first_uses(rt: Runtime, state: Path, work: Path, rounds: int) -> list[FirstUse]:
    results = []
    for fmt, name in FORMATS.items():
        runtime, tool = [], []
        for _ in range(rounds):
            tool.append(bare_unpack(fmt, work))
            box, took = await rt.create(name)
            runtime.append(took)
            await rt.delete(box["id"])
            shutil.rmtree(state / "images" / box["image_digest"])  # cold again for the next round
        results.append(FirstUse(name, Latency.of(runtime), Latency.of(tool)))
        print(f"  first use {name}: runtime p50 {results[-1].runtime.p50:.2f} s, tool {results[-1].tool.p50:.2f} s")
    return results


async def warm_creations(rt: Runtime, state: Path, work: Path, samples: int) -> list[Warm]:
    results = []
    for name in [None, f"{NAME}.rootfs", *FORMATS.values()]:
        box, _ = await rt.create(name)  # caches the image
        await rt.delete(box["id"])
        digest = box.get("image_digest")
        root = None if name is None else (state / "images" / digest / "root" if digest else TEST_IMAGES / name)
        argv = direct_argv(work, root)
        runtime, direct = [], []
        for _ in range(samples):
            direct.append(timed_spawn(argv))
            box, took = await rt.create(name)
            runtime.append(took)
            await rt.delete(box["id"])
        results.append(Warm(name or "(host root)", Latency.of(runtime), Latency.of(direct)))
        print(f"  warm {results[-1].image}: runtime p50 {results[-1].runtime.p50 * 1e3:.1f} ms")
    return results


def report(first: list[FirstUse], warm: list[Warm], argv: list[str]) -> str:
    paths = [TEST_IMAGES / name for name in FORMATS.values()]
    sizes = {path.name: tree_bytes(path) if path.is_dir() else path.stat().st_size for path in paths}
    lines = [
        START,
        f"## Sandboxes from images — {utc_now()}",
        "",
        f"- **Machine:** {machine(bubblewrap=True)}",
        f"- **Command:** `{command_line(__file__, argv)}`",
        "- **Images:** the Debian test images (`make test-images`): bookworm with python3, git and pytest, as a "
        + ", ".join(f"{name} ({size / 2**20:.0f} MiB)" for name, size in sizes.items())
        + ", and the root directory.",
        "",
        "First use (the image not cached yet: unpack, made safe, first shell), against the bare unpack tool on the "
        "same content in the same rounds. A file's digest is computed at its first use only and remembered (by "
        "inode, size and times), so only the first round also hashes the file:",
        "",
        "| image | POST /v1/sandboxes p50 | bare tool p50 | ratio | rounds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in first:
        ratio = row.runtime.p50 / row.tool.p50
        runtime, tool = f"{row.runtime.p50:.2f} s", f"{row.tool.p50:.2f} s"
        lines.append(f"| {row.image} | {runtime} | {tool} | {ratio:.2f}x | {row.runtime.n} |")
    lines += [
        "",
        "Beyond the tool, a first use walks the unpacked root twice (made safe: owners, modes, no device nodes; its "
        "size, for the cache's bound) and starts the sandbox's first shell; a docker archive is first copied into "
        "an OCI layout.",
        "",
        "Later creations (the image cached), interleaved round by round with bwrap + bash spawned directly with the "
        "server's own command line on the same root:",
        "",
        "| image | POST /v1/sandboxes p50 | p99 | bwrap+bash direct p50 | ratio (p50) | rounds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in warm:
        ratio = row.runtime.p50 / row.direct.p50
        lines.append(
            f"| {row.image} | {row.runtime.p50 * 1e3:.1f} ms | {row.runtime.p99 * 1e3:.1f} ms | "
            f"{row.direct.p50 * 1e3:.1f} ms | {ratio:.2f}x | {row.runtime.n} |"
        )
    lines += ["", END, ""]
    return "\n".join(lines)


async def run(args: argparse.Namespace, argv: list[str]) -> str:
    work = Path(tempfile.mkdtemp(prefix="prorl-bench-images-"))
    work.chmod(0o711)
    server = localstack.start_sandbox_runtime(
        work / "state", "bwrap", "--image-dir", str(TEST_IMAGES.resolve()), log=work / "runtime.log"
    )
    try:
        async with aiohttp.ClientSession() as http:
            rt = Runtime(http, server.url)
            print(f"first uses ({args.first_uses} per format)")
            first = await first_uses(rt, work / "state", work, args.first_uses)
            print(f"warm creations ({args.samples} per image)")
            warm = await warm_creations(rt, work / "state", work, args.samples)
    finally:
        stop(server)
        shutil.rmtree(work, ignore_errors=True)
    return report(first, warm, argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first-uses", type=int, default=3, help="cold unpacks per format")
    parser.add_argument("--samples", type=int, default=40, help="warm creations per image")
    parser.add_argument("--out", type=Path, help="write the section into this file (e.g. docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if not (TEST_IMAGES / FORMATS["sif"]).is_file():
        print(f"{TEST_IMAGES} has no test images: run `make test-images` first", file=sys.stderr)
        return 2
    block = asyncio.run(run(args, argv))
    print(block)
    if args.out:
        replace_section(args.out, START, END, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
