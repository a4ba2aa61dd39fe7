from pathlib import Path

import pytest

from sandbox_runtime.backends.base import BackendError, SandboxDirs, ulimit_args
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
    argv = BwrapBackend(tmp_path / "state").argv(dirs, SandboxSpec(image=str(image)))
    assert (str(image / "usr"), "/usr") in pairs(argv, "--ro-bind")
    assert ("usr/bin", "/bin") in pairs(argv, "--symlink")
    assert (str(image / "home"), "/home") not in pairs(argv, "--ro-bind")
    assert "/sys" not in argv


def test_missing_image_is_a_client_error(dirs):
    with pytest.raises(BackendError) as error:
        BwrapBackend(Path("/srv")).argv(dirs, SandboxSpec(image="/no/such/root"))
    assert error.value.status == 400


def test_limits_become_ulimit_flags():
    limits = Limits(memory_mb=512, pids=64, cpu_seconds=30, file_size_mb=5, open_files=256)
    assert ulimit_args(limits) == ["-v", "524288", "-u", "64", "-t", "30", "-f", "5120", "-n", "256"]
    assert ulimit_args(Limits()) == []
