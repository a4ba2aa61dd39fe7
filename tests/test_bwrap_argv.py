import os
from pathlib import Path

import pytest

from sandbox_runtime.backends.base import BackendError, SandboxDirs, ulimit_args
from sandbox_runtime.backends.bwrap import SHM_BYTES, BwrapBackend, unmountable_in
from sandbox_runtime.host_view import MERGED_USR
from sandbox_runtime.models import Limits, SandboxSpec


@pytest.fixture
def dirs(tmp_path):
    return SandboxDirs("abc123", tmp_path / "state" / "sandboxes" / "abc123")


def pairs(argv, flag):
    return [tuple(argv[i + 1 : i + 3]) for i, a in enumerate(argv) if a == flag]


def test_default_sandbox_is_isolated_and_read_only(dirs):
    argv = BwrapBackend(Path("/var/lib/prorl")).argv(dirs, SandboxSpec())
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent"):
        assert flag in argv
    assert ("/usr", "/usr") in pairs(argv, "--ro-bind")
    assert (str(dirs.workspace), "/workspace") in pairs(argv, "--bind")
    assert (str(dirs.tmp), "/tmp") in pairs(argv, "--bind")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--remount-ro"] == ["/dev", "/"]
    assert argv[argv.index("--") + 1 :] == ["bash", "--norc", "--noprofile", "--noediting", "-i"]


def test_without_an_image_only_usr_its_links_and_a_minimal_etc_come_from_the_host(dirs):
    argv = BwrapBackend(Path("/var/lib/prorl")).argv(dirs, SandboxSpec())
    read_only = dict((t, s) for s, t in pairs(argv, "--ro-bind"))
    assert read_only.pop("/usr") == "/usr"
    assert read_only.pop("/etc") == "/var/lib/prorl/host-etc"  # made for sandboxes, not the host's
    assert read_only.pop("/etc/passwd") == str(dirs.root / "passwd")  # the sandbox's own uid has an entry
    assert read_only.pop("/etc/group") == str(dirs.root / "group")
    for target, source in read_only.items():  # what is left: merged-/usr entries where the host has directories
        assert target.lstrip("/") in MERGED_USR and source == target
    for source, target in pairs(argv, "--symlink"):  # links stay links: /bin -> usr/bin
        assert target.lstrip("/") in MERGED_USR and os.readlink(target) == source
    assert "/etc/resolv.conf" not in argv  # no network, no resolver: its /etc has an empty one
    tmpfs = [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert "/sys" not in argv and tmpfs == ["/dev/shm"]  # the state dir is not there to hide


def test_a_sandbox_with_the_network_gets_the_hosts_resolver_and_named_host_paths_read_only(dirs):
    backend = BwrapBackend(Path("/var/lib/prorl"), host_paths=[Path("/opt/b"), Path("/opt/a/x"), Path("/opt/a")])
    argv = backend.argv(dirs, SandboxSpec(network="host"))
    assert ("/etc/resolv.conf", "/etc/resolv.conf") in pairs(argv, "--ro-bind-try")
    binds = [pair for pair in pairs(argv, "--ro-bind") if pair[0].startswith("/opt")]
    assert binds == [("/opt/a", "/opt/a"), ("/opt/a/x", "/opt/a/x"), ("/opt/b", "/opt/b")]  # parents first
    assert argv.index("--ro-bind-try") < argv.index(str(dirs.workspace))  # the workspace goes on top


def test_a_host_path_that_is_a_link_is_bound_from_where_it_resolves(dirs, tmp_path):
    real = tmp_path / "agent-v3"
    (real / "bin").mkdir(parents=True)
    (tmp_path / "agent").symlink_to(real)
    backend = BwrapBackend(dirs.root.parent, host_paths=[tmp_path / "agent"])
    assert (str(real), str(tmp_path / "agent")) in pairs(backend.argv(dirs, SandboxSpec()), "--ro-bind")
    # The workdir check reads the same binds: what exists in the resolved directory is there.
    assert unmountable_in(backend.read_only(dirs), f"{tmp_path}/agent/bin/x") == str(tmp_path / "agent")
    assert unmountable_in(backend.read_only(dirs), f"{tmp_path}/agent/bin") is None


def test_dev_is_read_only_and_dev_shm_a_small_tmpfs_of_its_own(dirs):
    argv = BwrapBackend(Path("/var/lib/prorl")).argv(dirs, SandboxSpec())
    size = argv.index("--size")
    assert argv[size + 1 : size + 4] == [str(SHM_BYTES), "--tmpfs", "/dev/shm"]  # --size applies to the next op
    assert argv.index("--dev") < size  # made inside bwrap's /dev, then /dev remounted read-only after it
    assert argv.index("--remount-ro") > size and argv[argv.index("--remount-ro") + 1] == "/dev"
    small = BwrapBackend(Path("/var/lib/prorl")).argv(dirs, SandboxSpec(limits=Limits(memory_mb=32)))
    assert small[small.index("--size") + 1] == str(32 << 20)  # never more than its memory limit


def test_network_on_request_and_custom_workdir(dirs):
    argv = BwrapBackend(Path("/root/state")).argv(dirs, SandboxSpec(network="host", workdir="/code"))
    assert "--unshare-net" not in argv
    assert (str(dirs.workspace), "/code") in pairs(argv, "--bind")
    assert argv[argv.index("--chdir") + 1] == "/code"


@pytest.mark.parametrize(
    ("workdir", "blocked"),
    [("/workspace", None), ("/opt/ws", None), ("{agent}", None), ("{agent}/present", None), ("{agent}/x", "{agent}")],
)
def test_a_workdir_inside_a_read_only_host_path_must_exist_there(dirs, tmp_path, workdir, blocked):
    agent = tmp_path / "agent"
    (agent / "present").mkdir(parents=True)
    backend = BwrapBackend(dirs.root.parent, host_paths=[agent])
    where = unmountable_in(backend.read_only(dirs), workdir.format(agent=agent))
    assert where == (blocked and blocked.format(agent=agent))


async def test_an_unmountable_workdir_is_the_clients_error(dirs):
    backend = BwrapBackend(dirs.root.parent, host_paths=[Path("/opt")])
    with pytest.raises(BackendError, match="inside /opt") as error:
        await backend.create(dirs, SandboxSpec(workdir="/opt/no-such-directory"))
    assert error.value.status == 400


def test_image_directory_becomes_the_root(dirs, tmp_path):
    image = tmp_path / "image"
    (image / "usr" / "bin").mkdir(parents=True)
    (image / "etc").mkdir()
    (image / "bin").symlink_to("usr/bin")
    (image / "home").mkdir()
    with_image = SandboxDirs(dirs.id, dirs.root, image_root=image)
    argv = BwrapBackend(tmp_path / "state").argv(with_image, SandboxSpec(image="image"))
    assert (str(image / "usr"), "/usr") in pairs(argv, "--ro-bind")
    assert ("usr/bin", "/bin") in pairs(argv, "--symlink")
    assert (str(image / "home"), "/home") in pairs(argv, "--ro-bind")  # the image's own, not the host's
    assert "/sys" not in argv


@pytest.mark.parametrize("name", ["/etc", "//", "../x", "a/../../b", "", "-rf"])
def test_an_image_is_a_name_never_a_host_path(name):
    with pytest.raises(ValueError, match="image"):
        SandboxSpec(image=name)


def test_under_a_root_server_bwrap_runs_as_the_sandbox_uid_without_capabilities(dirs):
    as_uid = SandboxDirs(dirs.id, dirs.root, uid=2_000_000_007)
    launch = BwrapBackend(Path("/var/lib/prorl")).launch(as_uid, SandboxSpec(env={"LD_PRELOAD": "/workspace/x.so"}))
    prefix = launch.argv[: launch.argv.index("--") + 1]
    assert prefix[0] == "setpriv" and "--reuid=2000000007" in prefix and "--regid=2000000007" in prefix
    for flag in ("--clear-groups", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs"):
        assert flag in prefix
    assert launch.argv[len(prefix)] == "bwrap" and "--disable-userns" in launch.argv
    # The spec's env reaches the sandboxed shell only: the launchers' environment is fixed.
    assert "LD_PRELOAD" not in launch.env and launch.sandbox_env["LD_PRELOAD"] == "/workspace/x.so"
    assert BwrapBackend(Path("/srv")).argv(dirs, SandboxSpec())[0] == "bwrap"  # unprivileged server: no switch


def test_limits_become_ulimit_flags():
    limits = Limits(memory_mb=512, pids=64, cpu_seconds=30, file_size_mb=5, open_files=256)
    assert ulimit_args(limits) == ["-v", "524288", "-u", "64", "-t", "30", "-f", "5120", "-n", "256"]
    assert ulimit_args(Limits()) == []
