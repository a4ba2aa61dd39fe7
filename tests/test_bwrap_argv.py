from pathlib import Path

import pytest

from sandbox_runtime.backends.base import SandboxDirs, ulimit_args
from sandbox_runtime.backends.bwrap import BwrapBackend
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
    targets = {t for _, t in pairs(argv, "--ro-bind")} | {t for _, t in pairs(argv, "--bind")}
    assert not {"/home", "/root", "/run", "/proc"} & {t for _, t in pairs(argv, "--ro-bind")}
    assert (str(dirs.workspace), "/workspace") in pairs(argv, "--bind")
    assert (str(dirs.tmp), "/tmp") in pairs(argv, "--bind")
    assert "/workspace" in targets
    assert argv[argv.index("--tmpfs") + 1] == "/var/lib/prorl"  # other sandboxes' workspaces hidden
    assert argv[argv.index("--remount-ro") + 1] == "/"
    assert argv[argv.index("--") + 1 :] == ["bash", "--norc", "--noprofile", "--noediting", "-i"]


def test_network_on_request_and_custom_workdir(dirs):
    argv = BwrapBackend(Path("/root/state")).argv(dirs, SandboxSpec(network="host", workdir="/code"))
    assert "--unshare-net" not in argv
    assert (str(dirs.workspace), "/code") in pairs(argv, "--bind")
    assert argv[argv.index("--chdir") + 1] == "/code"
    assert "--tmpfs" not in argv  # a state dir under /root is hidden already


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
