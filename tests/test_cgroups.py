"""Where a root server makes its sandboxes' memory cgroups, from /proc/self/cgroup and /proc/self/mountinfo as the
hosts write them: cgroup v2 where the server's cgroup offers `memory`, else cgroup v1's memory hierarchy, mapped
through the mount's own root (a container sees its cgroup as `/`). The hierarchies here are plain directories
standing in for cgroupfs; integration_tests/test_sandbox_limits.py uses the host's real one."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from sandbox_runtime import cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only a root server makes cgroups")


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def test_cgroup_v1_memory_as_on_these_machines(tmp_path):
    memory = tmp_path / "memory"
    (memory / "process_api" / "abc").mkdir(parents=True)
    proc = fake_proc(
        tmp_path,
        "4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
        f"35 31 0:32 / {memory} rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n",
    )
    found, why = cgroups.find(proc)
    assert found == cgroups.MemoryCgroups("cgroup v1", memory / "process_api" / "abc"), why
    assert found.path("0123") == memory / "process_api" / "abc" / "prorl-sandbox-0123"


def test_cgroup_v2_where_the_servers_cgroup_offers_memory(tmp_path):
    unified = tmp_path / "unified with space"
    service = unified / "system.slice" / "prorl.service"
    service.mkdir(parents=True)
    (service / "cgroup.controllers").write_text("cpu io memory pids\n")
    (service / "cgroup.subtree_control").write_text("")
    escaped = str(unified).replace(" ", "\\040")
    proc = fake_proc(tmp_path, "0::/system.slice/prorl.service\n", f"41 31 0:38 / {escaped} rw - cgroup2 cgroup2 rw\n")
    found, why = cgroups.find(proc)
    assert found == cgroups.MemoryCgroups("cgroup v2", service), why
    assert "memory" in (service / "cgroup.subtree_control").read_text()  # offered to its children


def test_a_mount_of_part_of_the_hierarchy_is_mapped_through_its_root(tmp_path):
    memory = tmp_path / "memory"
    (memory / "abc").mkdir(parents=True)
    proc = fake_proc(
        tmp_path, "4:memory:/container/abc\n", f"35 31 0:32 /container {memory} rw - cgroup cgroup rw,memory\n"
    )
    assert cgroups.find(proc)[0] == cgroups.MemoryCgroups("cgroup v1", memory / "abc")


def test_no_memory_controller_says_so(tmp_path):
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpu pids\n")
    proc = fake_proc(tmp_path, "0::/\n", f"41 31 0:38 / {unified} rw - cgroup2 cgroup2 rw\n")
    found, why = cgroups.find(proc)
    assert found is None and "no memory cgroup controller" in why


def test_the_launch_prefix_joins_before_it_execs(tmp_path):
    procs = tmp_path / "cgroup.procs"
    argv = [*cgroups.join_argv(tmp_path), "sh", "-c", 'echo "$$" > "$0"', str(tmp_path / "exec-pid")]
    subprocess.run(argv, check=True)
    assert procs.read_text().strip() == (tmp_path / "exec-pid").read_text().strip()  # the same process: exec'd


def unified_service(tmp_path: Path) -> tuple[Path, Path]:
    unified = tmp_path / "unified"
    service = unified / "prorl.service"
    service.mkdir(parents=True)
    (service / "cgroup.controllers").write_text("cpu memory pids\n")
    (service / "cgroup.subtree_control").write_text("")
    proc = fake_proc(tmp_path, "0::/prorl.service\n", f"41 31 0:38 / {unified} rw - cgroup2 cgroup2 rw\n")
    return proc, service


def test_v2_where_moving_into_a_leaf_does_not_help_the_server_moves_back_and_the_leaf_goes(tmp_path, monkeypatch):
    """Other processes share the server's cgroup: `+memory` is refused (EBUSY) before and after the move."""
    proc, service = unified_service(tmp_path)
    writes = []

    def write(path, value):
        writes.append((path.relative_to(service), str(value)))
        if path.name == "cgroup.subtree_control":
            raise OSError(errno.EBUSY, "Device or resource busy")  # cgroupfs makes no files: nothing is written

    monkeypatch.setattr(cgroups, "_write", write)
    found, why = cgroups.find(proc)
    assert found is None and "cgroup v2" in why and "busy" in why, why
    pid = str(os.getpid())
    assert writes == [
        (Path("cgroup.subtree_control"), "+memory"),
        (Path("prorl-server/cgroup.procs"), pid),  # into the leaf
        (Path("cgroup.subtree_control"), "+memory"),
        (Path("cgroup.procs"), pid),  # and back
    ]
    assert not (service / "prorl-server").exists()


def test_v2_where_the_leaf_helps_the_server_stays_there_and_sandboxes_are_its_siblings(tmp_path, monkeypatch):
    proc, service = unified_service(tmp_path)
    moved = []

    def write(path, value):
        if path.name == "cgroup.subtree_control" and not moved:
            raise OSError(errno.EBUSY, "Device or resource busy")
        if path.name == "cgroup.procs" and path.parent.name == "prorl-server":
            moved.append(value)
        elif path.name != "cgroup.subtree_control":
            path.write_text(str(value))  # the probe cgroup's limit

    monkeypatch.setattr(cgroups, "_write", write)
    found, why = cgroups.find(proc)
    assert found == cgroups.MemoryCgroups("cgroup v2", service), why
    assert moved == [os.getpid()] and (service / "prorl-server").is_dir()
    assert found.path("ab").parent == service  # beside the server's leaf, not in it


def test_v1_without_swap_accounting_keeps_a_sandbox_out_of_swap_and_says_so(tmp_path):
    memory = tmp_path / "memory"
    (memory / "abc").mkdir(parents=True)
    proc = fake_proc(tmp_path, "4:memory:/abc\n", f"35 31 0:32 / {memory} rw - cgroup cgroup rw,memory\n")
    found, why = cgroups.find(proc)
    assert found is not None and "memory.swappiness 0" in why, why
    cgroup = found.create("0123", 64 << 20)
    assert (cgroup / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (cgroup / "memory.swappiness").read_text() == "0"
    (memory / "abc" / "memory.memsw.limit_in_bytes").write_text("")  # swap accounting on: memsw bounds it
    assert "memsw" in found.swap() and "swappiness" not in found.swap()
