"""What the benchmarks share: the machine line, their own section of docs/benchmarks.md, the servers they start
(through `prorl_adapter.dev.localstack`, as the demo and the integration tests start them) and the /proc
figures they read (process trees and start times from `sandbox_runtime.procs`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH.parent) not in sys.path:  # a checkout without the package installed
    sys.path.insert(0, str(BENCH.parent))

from prorl_adapter.dev.localstack import Service  # noqa: E402
from sandbox_runtime import procs  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
HAVE_SCHEDSTAT = Path("/proc/self/schedstat").exists()
# The CPUs this benchmark was given, read before it pins itself to some of them (`pin_tree`).
CPUS_GIVEN = len(os.sched_getaffinity(0))


class BenchError(Exception):
    """Something the benchmark needs did not work; the message says what."""


# -- the report ---------------------------------------------------------------------------------------------
def machine(*parts: str, bubblewrap: bool = False) -> str:
    """The machine line: CPUs, CPU model, memory, kernel and Python, then `parts` (what else the benchmark ran
    on), then the bubblewrap version where `bubblewrap` is set."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown CPU")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    words = [
        f"{CPUS_GIVEN} CPUs (nproc)",
        model,
        f"{mem_kib / 1024**2:.1f} GiB RAM",
        f"Linux {platform.release()}",
        f"Python {platform.python_version()}",
        *parts,
    ]
    if bubblewrap:
        words.append(f"bubblewrap {bwrap_version()}")
    return ", ".join(words)


def bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "?"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def command_line(script: str, argv: list[str]) -> str:
    """How the benchmark was run, as the report shows it: `python bench/NAME ARGS`."""
    return shlex.join(["python", f"bench/{Path(script).name}", *argv])


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


# -- the targets ----------------------------------------------------------------------------------------------
TARGETS_START, TARGETS_END = "<!-- targets:start -->", "<!-- targets:end -->"
# The project's performance targets (issue 16), in the table's order: what each one asks for. Each benchmark
# fills in the rows it measures, keeping the others as the last run of their benchmark left them.
TARGETS = {
    "pipeline, heterogeneous": "pipeline ≥ 1.5x lock-step episodes/s, heterogeneous workload, separate cores",
    "pipeline, fixed": "pipeline ≥ 1.0x lock-step episodes/s, fixed workload (3 turns), separate cores",
    "orchestration": "rollout service ≤ 1 ms of CPU per turn",
    "sandbox creation": "sandbox creation p50 ≤ 1.2x bare bwrap+bash",
    "pace K=2": "pace K=2 ≥ 60% trainer busy in the balanced simulation, nothing trained staler than K",
    "time to reward, slow tools": "decoupled wall time to reward 0.8 ≤ 0.7x coupled, slow-tool workload",
    "time to reward, relay": "decoupled within 10% of the overlap bound on relay as it is",
    "real model learns": "SmolLM2-135M-Instruct's mean reward rises ≥ 0.25 (median of 3 seeds), each run < 40 min",
}
_NOT_YET = "not measured yet"


@dataclass(frozen=True)
class TargetResult:
    measured: str  # the ratio or figure, as measured side by side in one run
    met: bool
    note: str  # by how much and why, where missed; which run


def update_targets(path: Path, results: dict[str, TargetResult]) -> None:
    """Fill in these targets' rows of the targets table in `path`, keeping the other rows as they were."""
    unknown = set(results) - set(TARGETS)
    if unknown:
        raise KeyError(f"not a target: {', '.join(sorted(unknown))}")
    text = path.read_text() if path.exists() else ""
    rows: dict[str, str] = {}
    if TARGETS_START in text:
        for line in text.split(TARGETS_START, 1)[1].split(TARGETS_END, 1)[0].splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells and cells[0] in TARGETS:
                rows[cells[0]] = line
    for name, result in results.items():
        met = "**yes**" if result.met else "**no**"
        rows[name] = f"| {name} | {TARGETS[name]} | {result.measured} | {met} | {result.note} ({utc_now()}) |"
    lines = [rows.get(name, f"| {name} | {goal} | — | {_NOT_YET} | — |") for name, goal in TARGETS.items()]
    block = (
        f"{TARGETS_START}\n## Targets\n\nEach figure is a ratio of two things measured side by side in one run of its "
        "benchmark (below), not a test assertion; `make bench` reruns them all, and each benchmark updates its own "
        "rows.\n\n| Target | Asks for | Measured | Met | By how much, why, and when |\n|---|---|---|---|---|\n"
        + "\n".join(lines)
        + f"\n{TARGETS_END}\n"
    )
    replace_section(path, TARGETS_START, TARGETS_END, block)


# -- servers ------------------------------------------------------------------------------------------------
def importable_in_children() -> None:
    """Let processes started from here import the benchmark's modules (a `--plugin` path of the rollout
    service): they inherit PYTHONPATH."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(BENCH) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH), *filter(None, paths)])


def stop(service: Service, timeout: float = 120.0) -> None:
    """Stop a server started through localstack, then whatever it left behind outside its process group
    (sandboxes run in sessions of their own): only the very processes seen before, never a reused pid."""
    left = [(pid, procs.start_time(pid)) for pid in descendants(service.process.pid)]
    service.stop(timeout)
    for pid, started in left:
        if started is not None and procs.is_same_process(pid, started):
            procs.kill(pid)


# -- /proc --------------------------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    found, todo = [], procs.children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += procs.children(child)
    return found


def stat_cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """utime + stime of a process, all its threads, from /proc/PID/stat (10 ms ticks); with `reaped_children`,
    plus cutime + cstime (the children it has waited for). 0 for a process that is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = raw[raw.rindex(b")") + 2 :].split()  # after the comm: state ppid ... utime(14) stime(15) ...
    return sum(int(v) for v in fields[11 : 15 if reaped_children else 13]) / CLK_TCK


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of the given processes, every thread, in seconds; processes gone meanwhile count as zero.

    schedstat gives nanoseconds; /proc/PID/stat gives 10 ms ticks, too coarse for hundreds of shells that
    each run a few milliseconds, so it is only the fallback for kernels without schedstats.
    """
    if not HAVE_SCHEDSTAT:
        return sum(stat_cpu_seconds(pid) for pid in pids)
    total = 0.0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in os.scandir(f"/proc/{pid}/task"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    total += int(Path(task.path, "schedstat").read_text().split()[0]) / 1e9
    return total


def tree_cpu_seconds(root: int) -> float:
    """CPU of a process and all its descendants, reaped children included (through cutime/cstime)."""
    return sum(stat_cpu_seconds(pid, reaped_children=True) for pid in [root, *descendants(root)])


def voluntary_switches(pid: int) -> int:
    """How often the threads of a process have given up the CPU to wait (voluntary context switches, summed
    over /proc/PID/task/*/status): one per wake-up from a wait, the count that waking costs scale with."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
    return total


def pin_tree(root: int, cpus: frozenset[int]) -> None:
    """Every thread of `root` and its descendants on `cpus` (`sched_setaffinity` sets one thread's mask, so
    each one in /proc/PID/task); threads and processes started later inherit their parent thread's mask."""
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(tid), cpus)


def split_cpus() -> tuple[frozenset[int], frozenset[int]] | None:
    """This process's CPUs in two halves, for the LLM server and for everything else (a small model of separate
    machines); None on a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


def busy_cpu_seconds() -> float:
    """CPU time the whole machine spent not idle (all CPUs, /proc/stat), in seconds."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / CLK_TCK  # user..steal; guest is inside user
