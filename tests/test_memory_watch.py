"""The unprivileged server's memory watchdog (memory_watch.py) finds a sandbox's processes under its launchers and
kills only the processes its scan saw: never a pid that was freed and reused by another process meanwhile."""

import os
import subprocess
import sys
import time

from sandbox_runtime import memory_watch, procs

# A launcher and one child that outlive each other: a shell's `wait` would return when the child is killed, and the
# shell could exit on its own before its own SIGKILL arrived (status 137, not -9).
LAUNCHER = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\ntime.sleep(60)"


def test_the_watchdog_finds_a_launchers_tree_and_kills_what_it_saw(tmp_path):
    boxes = tmp_path / "sandboxes"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(boxes / "abc" / "workspace")])
    try:
        deadline = time.monotonic() + 60  # a bound for a loaded machine, not a timing assertion
        while not procs.children(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        found = memory_watch.over_limit(os.getpid(), boxes, {"abc": 1, "other": 1})
        assert list(found) == ["abc"]
        held, processes = found["abc"]
        assert held > 1 and processes[-1] == (launcher.pid, procs.start_time(launcher.pid))  # deepest first
        assert len(processes) == 2
        assert memory_watch.kill(processes) == 2
        assert launcher.wait(timeout=10) == -9
    finally:
        launcher.kill()
        launcher.wait()


def test_a_pid_whose_process_is_not_the_one_scanned_is_not_killed():
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        started = procs.start_time(bystander.pid)
        assert started is not None
        # The scan saw another process under this pid (a start time of its own): it ended, the pid was reused.
        assert memory_watch.kill([(bystander.pid, started - 1)]) == 0
        assert bystander.poll() is None
        assert memory_watch.kill([(bystander.pid, started)]) == 1
        assert bystander.wait(timeout=10) == -9
    finally:
        bystander.kill()
        bystander.wait()
