"""The Apptainer backend: its exact command lines and their environment, checked without the binary, and one
real run where Apptainer is installed (tests/standins/apptainer stands in for it in
integration_tests/test_apptainer_standin.py).

Async tests run under pytest-asyncio's auto mode (pyproject.toml).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from sandbox_runtime.backends import apptainer as apptainer_module
from sandbox_runtime.backends.apptainer import (
    NO_MOUNT,
    NOT_INSTALLED,
    TIMEOUT_STATUS,
    ApptainerBackend,
    Flavour,
    cgroup_limits_here,
    cgroup_limits_usable,
    command_env,
    parse_version,
    run_command,
)
from sandbox_runtime.backends.base import DEFAULT_PATH, SHELL_ARGV, BackendError, SandboxDirs
from sandbox_runtime.models import Limits, SandboxSpec
from sandbox_runtime.session import ShellSession
from tests.standins.rootfs import make_rootfs

IMAGE = "/images/base.sif"
APPTAINER_VERSION = "apptainer version 1.4.5\n"


class Recorder:
    """A runner that records each command line (and its environment) and answers with canned (exit status,
    output) pairs; `--version` is answered with `version` and recorded apart, in `version_calls`."""

    def __init__(self, *answers: tuple[int, str], version: str = APPTAINER_VERSION) -> None:
        self.answers = list(answers)
        self.version = version
        self.calls: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.version_calls = 0

    async def __call__(self, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        if argv[1:] == ["--version"]:
            self.version_calls += 1
            await asyncio.sleep(0)  # let concurrent creates overlap
            return (0, self.version) if self.version else (255, "FATAL: something\n")
        self.calls.append(list(argv))
        self.envs.append(dict(env))
        return self.answers.pop(0) if self.answers else (0, "")


@pytest.fixture
def dirs(tmp_path: Path) -> SandboxDirs:
    # The manager resolves a spec's image name under the server's image directories into `image_file` (a SIF).
    return SandboxDirs("abc-123", tmp_path / "sb", image_file=Path(IMAGE))


def backend(runner: Recorder | None = None, cgroups: bool = False, **kwargs) -> ApptainerBackend:
    return ApptainerBackend(binary="apptainer", runner=runner or Recorder(), cgroups=cgroups, **kwargs)


def start_argv(
    dirs: SandboxDirs, *middle: str, image: str = IMAGE, workdir: str = "/workspace", no_oci: bool = False
) -> list[str]:
    return [
        "apptainer",
        "-s",
        "instance",
        "start",
        *(["--no-oci"] if no_oci else []),
        "--containall",
        "--no-mount",
        "home,cwd,tmp,hostfs,bind-paths",
        "--writable-tmpfs",
        *middle,
        "--bind",
        f"{dirs.root}/tmp:/tmp",
        "--bind",
        f"{dirs.root}/workspace:{workdir}",
        image,
        "prorl-abc-123",
    ]


def clear_apptainer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("APPTAINER", "SINGULARITY")) or key in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS"):
            monkeypatch.delenv(key)


# -- instance start ---------------------------------------------------------------------------------------
def test_refused_under_a_root_server(dirs: SandboxDirs) -> None:
    as_sandbox_uid = SandboxDirs(dirs.id, dirs.root, uid=2_000_000_000, image_file=dirs.image_file)
    with pytest.raises(BackendError) as error:
        backend().start_argv(as_sandbox_uid, SandboxSpec(image="base.sif"))
    assert error.value.status == 400 and "unprivileged server" in str(error.value)


async def test_create_default_spec_has_no_network(dirs: SandboxDirs) -> None:
    runner = Recorder()
    await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls == [start_argv(dirs, "--net", "--network", "none")]
    assert runner.version_calls == 1


def test_network_host_has_no_net_flags(dirs: SandboxDirs) -> None:
    argv = backend().start_argv(dirs, SandboxSpec(image="base.sif", network="host"))
    assert argv == start_argv(dirs)


def test_fakeroot(dirs: SandboxDirs) -> None:
    argv = backend(fakeroot=True).start_argv(dirs, SandboxSpec(image="base.sif"))
    assert argv == start_argv(dirs, "--net", "--network", "none", "--fakeroot")


def test_site_bind_paths_and_hostfs_are_not_mounted() -> None:
    assert set(NO_MOUNT.split(",")) == {"home", "cwd", "tmp", "hostfs", "bind-paths"}


def test_custom_workdir_and_default_image(dirs: SandboxDirs) -> None:
    no_image = SandboxDirs(dirs.id, dirs.root)
    argv = backend(default_image="docker://bash:5").start_argv(no_image, SandboxSpec(workdir="/code"))
    assert argv == start_argv(dirs, "--net", "--network", "none", image="docker://bash:5", workdir="/code")
    # The spec's own image wins over the default.
    argv = backend(default_image="docker://bash:5").start_argv(dirs, SandboxSpec(image="base.sif"))
    assert argv[-2] == IMAGE


def test_image_file_root_directory_or_default() -> None:
    assert ApptainerBackend.runs_sif is True
    apptainer = backend(default_image="/default.sif")
    sif, rootfs = Path("/images/a.sif"), Path("/images/unpacked/a")
    assert apptainer.image(SandboxDirs("x", Path("/s"), image_file=sif, image_root=rootfs)) == str(sif)
    assert apptainer.image(SandboxDirs("x", Path("/s"), image_root=rootfs)) == str(rootfs)  # a sandbox directory
    assert apptainer.image(SandboxDirs("x", Path("/s"))) == "/default.sif"


async def test_missing_image_is_a_400(dirs: SandboxDirs) -> None:
    runner = Recorder()
    with pytest.raises(BackendError) as info:
        await backend(runner).create(SandboxDirs(dirs.id, dirs.root), SandboxSpec())
    assert info.value.status == 400
    assert "image is required for apptainer" in str(info.value)
    assert runner.calls == [] and runner.version_calls == 0


@pytest.mark.parametrize("workdir", ["/data:ro", "/w,/etc:/x", "/a:b"])
async def test_workdir_with_bind_separators_is_a_400(dirs: SandboxDirs, workdir: str) -> None:
    runner = Recorder()
    spec = SandboxSpec(image="base.sif", workdir=workdir)  # the spec's own validation lets them through
    with pytest.raises(BackendError) as info:
        await backend(runner).create(dirs, spec)
    assert info.value.status == 400 and "':' or ','" in str(info.value) and workdir in str(info.value)
    assert runner.calls == []
    with pytest.raises(BackendError):
        backend().start_argv(dirs, spec)


@pytest.mark.parametrize("state", ["state:ro", "a,b"])
async def test_state_dir_with_bind_separators_is_a_500(tmp_path: Path, state: str) -> None:
    runner = Recorder()
    dirs = SandboxDirs("abc-123", tmp_path / state / "sb", image_file=Path(IMAGE))
    with pytest.raises(BackendError) as info:
        await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert info.value.status == 500 and "--state-dir" in str(info.value)
    assert runner.calls == []


async def test_failing_start_is_a_500_with_the_output(dirs: SandboxDirs) -> None:
    runner = Recorder((255, "FATAL:   could not open image /images/base.sif\n"))
    with pytest.raises(BackendError) as info:
        await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert info.value.status == 500
    assert "FATAL:   could not open image /images/base.sif" in str(info.value)
    assert "exit 255" in str(info.value)


async def test_timed_out_start_stops_what_it_may_have_started(dirs: SandboxDirs) -> None:
    runner = Recorder((TIMEOUT_STATUS, "apptainer instance start timed out after 120 s"), (255, "no instance"))
    with pytest.raises(BackendError, match="timed out"):
        await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls[1] == ["apptainer", "-s", "instance", "stop", "--force", "prorl-abc-123"]


# -- the environment of the apptainer command ------------------------------------------------------------
HOST_ENV = {
    "PATH": "/opt/apptainer/bin:/usr/bin",
    "HOME": "/home/alice",
    "USER": "alice",
    "LOGNAME": "alice",
    "XDG_RUNTIME_DIR": "/run/user/1000",
    "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/1000/bus",
    "APPTAINER_CACHEDIR": "/scratch/alice/cache",
    "APPTAINER_TMPDIR": "/scratch/alice/tmp",
    "APPTAINER_CONFIGDIR": "/scratch/alice/apptainer",  # where the instance files live
    "SINGULARITY_CACHEDIR": "/scratch/alice/scache",
}
LEAKS = {
    "APPTAINER_BIND": "/data:/data",  # as HPC module files set: would add mounts despite --containall
    "SINGULARITY_BINDPATH": "/scratch",
    "APPTAINERENV_LEAK": "no",  # would be injected into the container
    "SINGULARITYENV_PATH": "/evil",
    "APPTAINER_NO_MOUNT": "",
    "SECRET_TOKEN": "no",
    "LD_PRELOAD": "/tmp/x.so",
}


def test_command_env_is_fixed_and_minimal() -> None:
    assert command_env({**HOST_ENV, **LEAKS}) == HOST_ENV
    assert command_env({}) == {"PATH": DEFAULT_PATH}
    assert command_env({"HOME": "", "PATH": ""}) == {"PATH": DEFAULT_PATH}  # empty is unset


async def test_every_command_gets_that_environment(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_apptainer_env(monkeypatch)
    for key, value in {**HOST_ENV, **LEAKS}.items():
        monkeypatch.setenv(key, value)
    runner = Recorder((0, ""), (0, '{"instances": []}'), (0, ""))
    apptainer = backend(runner)
    await apptainer.create(dirs, SandboxSpec(image="base.sif"))
    await apptainer.instance_names()
    await apptainer.destroy(dirs, SandboxSpec(image="base.sif"))
    assert [call[2:4] for call in runner.calls] == [["instance", "start"], ["instance", "list"], ["instance", "stop"]]
    assert runner.envs == [HOST_ENV] * 3
    assert apptainer.launch(dirs, SandboxSpec(image="base.sif")).env == HOST_ENV


# -- sessions ---------------------------------------------------------------------------------------------
def test_launch_carries_the_environment_in_argv(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_apptainer_env(monkeypatch)
    monkeypatch.setenv("PATH", "/opt/apptainer/bin:/usr/bin")
    monkeypatch.setenv("HOME", "/home/alice")
    monkeypatch.setenv("APPTAINER_CONFIGDIR", "/srv/apptainer")  # where the instance files live
    monkeypatch.setenv("APPTAINERENV_LEAK", "no")  # would be injected into the container
    monkeypatch.setenv("APPTAINER_BIND", "/data")
    monkeypatch.setenv("SECRET_TOKEN", "no")
    for key in ("USER", "LOGNAME"):
        monkeypatch.delenv(key, raising=False)
    value = 'a,b=$HOME "q" `x`'  # kept verbatim: no --env CSV splitting or shell evaluation
    spec = SandboxSpec(
        image="base.sif", workdir="/code", env={"ZED": "1", "ALPHA": value}, limits=Limits(memory_mb=512)
    )

    launch = backend().launch(dirs, spec)

    assert launch.argv == [
        "apptainer",
        "-s",
        "exec",
        "--cleanenv",
        "--pwd",
        "/code",
        "instance://prorl-abc-123",
        "env",
        "-u",
        "PROMPT_COMMAND",
        "--",
        f"ALPHA={value}",
        "HOME=/code",  # no PATH: in an image, PATH is the image's
        "PS1=",
        "PS2=",
        "TERM=dumb",
        "ZED=1",
        *SHELL_ARGV,
    ]
    assert launch.env == {
        "PATH": "/opt/apptainer/bin:/usr/bin",
        "HOME": "/home/alice",
        "APPTAINER_CONFIGDIR": "/srv/apptainer",
    }
    assert launch.ulimits == ["-v", str(512 * 1024)]
    assert launch.pid_namespace is False


def test_launch_env_falls_back_to_the_default_path(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PATH", raising=False)
    assert backend().launch(dirs, SandboxSpec(image="base.sif")).env["PATH"] == DEFAULT_PATH


def test_spec_env_overrides_the_shell_defaults(dirs: SandboxDirs) -> None:
    spec = SandboxSpec(image="base.sif", env={"PATH": "/venv/bin:/usr/bin", "TERM": "xterm"})
    argv = backend().launch(dirs, spec).argv
    assert "PATH=/venv/bin:/usr/bin" in argv and "TERM=xterm" in argv
    assert "TERM=dumb" not in argv
    # With no image of its own (a default image reference), the shell gets the default PATH.
    no_image = SandboxDirs(dirs.id, dirs.root)
    assert f"PATH={DEFAULT_PATH}" in backend(default_image="docker://bash:5").launch(no_image, SandboxSpec()).argv


# -- which flavour: --no-oci for SingularityCE 4 ------------------------------------------------------------
@pytest.mark.parametrize(
    ("output", "flavour"),
    [
        ("apptainer version 1.4.5\n", Flavour("apptainer", (1, 4, 5))),
        ("singularity-ce version 4.3.0\n", Flavour("singularity-ce", (4, 3, 0))),
        ("singularity-ce version 3.11.4-1.el8\n", Flavour("singularity-ce", (3, 11, 4))),
        ("singularity version 3.7.1\n", Flavour("singularity", (3, 7, 1))),
        ("WARNING: a notice first\napptainer version 1.3.0-rc.2\n", Flavour("apptainer", (1, 3, 0))),
        ("garbage", Flavour("unknown")),
    ],
)
def test_parse_version(output: str, flavour: Flavour) -> None:
    assert parse_version(output) == flavour


def test_only_singularity_ce_4_needs_no_oci() -> None:
    assert Flavour("singularity-ce", (4, 3, 0)).needs_no_oci
    assert Flavour("singularity-ce", (4,)).needs_no_oci
    assert not Flavour("singularity-ce", (3, 11, 4)).needs_no_oci
    assert not Flavour("apptainer", (1, 4, 5)).needs_no_oci  # Apptainer refuses the flag
    assert not Flavour("singularity", (4, 0)).needs_no_oci
    assert not Flavour("unknown").needs_no_oci


async def test_singularity_ce_4_starts_with_no_oci(dirs: SandboxDirs) -> None:
    runner = Recorder(version="singularity-ce version 4.3.0\n")
    await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls == [start_argv(dirs, "--net", "--network", "none", no_oci=True)]


async def test_the_flavour_is_asked_once(tmp_path: Path) -> None:
    runner = Recorder(version="singularity-ce version 4.1.2\n")
    apptainer = backend(runner)
    boxes = [SandboxDirs(f"b{i}", tmp_path / f"b{i}", image_file=Path(IMAGE)) for i in range(5)]
    await asyncio.gather(*(apptainer.create(box, SandboxSpec(image="base.sif")) for box in boxes))
    await apptainer.create(boxes[0], SandboxSpec(image="base.sif"))
    assert runner.version_calls == 1
    assert all("--no-oci" in call for call in runner.calls) and len(runner.calls) == 6


async def test_an_unknown_flavour_gets_no_no_oci(dirs: SandboxDirs) -> None:
    runner = Recorder(version="")  # --version failed
    apptainer = backend(runner)
    await apptainer.create(dirs, SandboxSpec(image="base.sif"))
    assert await apptainer.flavour() == Flavour("unknown")
    assert "--no-oci" not in runner.calls[0] and runner.version_calls == 1


# -- cgroup limits ----------------------------------------------------------------------------------------
SYSTEMD = {"XDG_RUNTIME_DIR": "/run/user/1000", "DBUS_SESSION_BUS_ADDRESS": "unix:path=/run/user/1000/bus"}
UNIFIED = "cpuset cpu io memory hugetlb pids rdma misc\n"
DELEGATED = "cgroups v2 with the memory and pids controllers delegated to this user"


@pytest.mark.parametrize(
    ("unified", "user", "environ", "usable", "why"),
    [
        (UNIFIED, "cpu memory pids\n", SYSTEMD, True, "delegated"),
        (UNIFIED, "memory pids", SYSTEMD, True, "delegated"),
        (None, "memory pids", SYSTEMD, False, "no cgroups v2 unified hierarchy"),  # v1 or hybrid
        (UNIFIED, None, SYSTEMD, False, "no systemd user slice"),
        (UNIFIED, "cpu memory", SYSTEMD, False, "does not delegate the pids"),
        (UNIFIED, "", SYSTEMD, False, "memory and pids"),
        (UNIFIED, "memory pids", {}, False, "XDG_RUNTIME_DIR and DBUS_SESSION_BUS_ADDRESS not set"),
        (UNIFIED, "memory pids", {"XDG_RUNTIME_DIR": "/run/user/1"}, False, "DBUS_SESSION_BUS_ADDRESS not set"),
    ],
)
def test_cgroup_limits_usable(unified, user, environ, usable, why) -> None:
    decided, reason = cgroup_limits_usable(unified, user, environ)
    assert decided is usable and why in reason


def test_cgroup_limits_here_reads_the_users_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apptainer_module, "_CGROUP_ROOT", tmp_path)
    assert cgroup_limits_here(1000, SYSTEMD)[0] is False
    (tmp_path / "cgroup.controllers").write_text(UNIFIED)
    service = tmp_path / "user.slice" / "user-1000.slice" / "user@1000.service"
    service.mkdir(parents=True)
    (service / "cgroup.controllers").write_text("memory pids\n")
    assert cgroup_limits_here(1000, SYSTEMD) == (
        True,
        "cgroups v2 with the memory and pids controllers delegated to this user",
    )
    assert cgroup_limits_here(1001, SYSTEMD)[0] is False


def test_cgroup_limits_on_instance_start(dirs: SandboxDirs) -> None:
    spec = SandboxSpec(image="base.sif", network="host", limits=Limits(memory_mb=512, pids=64, cpu_seconds=10))
    argv = backend(cgroups=True).start_argv(dirs, spec)
    assert argv == start_argv(dirs, "--memory", "512M", "--pids-limit", "64")
    assert backend(cgroups=True).start_argv(dirs, SandboxSpec(image="base.sif", network="host")) == start_argv(dirs)
    assert backend(cgroups=False).start_argv(dirs, spec) == start_argv(dirs)
    # The session's ulimits stay, with cgroups or without.
    assert backend(cgroups=True).launch(dirs, spec).ulimits == ["-v", str(512 * 1024), "-u", "64", "-t", "10"]


def test_cgroups_are_decided_once_from_the_machine(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []
    monkeypatch.setattr(apptainer_module, "cgroup_limits_here", lambda: asked.append(1) or (True, "test"))
    apptainer = ApptainerBackend(binary="apptainer", runner=Recorder())
    spec = SandboxSpec(image="base.sif", limits=Limits(memory_mb=100))
    assert "--memory" in apptainer.start_argv(dirs, spec) and "--memory" in apptainer.start_argv(dirs, spec)
    assert asked == [1]


# -- instance stop and list -------------------------------------------------------------------------------
async def test_destroy_stops_the_instance(dirs: SandboxDirs) -> None:
    runner = Recorder()
    await backend(runner).destroy(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls == [["apptainer", "-s", "instance", "stop", "--force", "prorl-abc-123"]]
    assert backend().stop_argv("prorl-x") == ["apptainer", "-s", "instance", "stop", "--force", "prorl-x"]


async def test_destroy_is_idempotent(dirs: SandboxDirs) -> None:
    runner = Recorder(
        (255, "FATAL:   no instance found with name prorl-abc-123\n"),
        (1, "ERROR:  No instance found with name prorl-abc-123\n"),  # Singularity 3.x
    )
    await backend(runner).destroy(dirs, SandboxSpec(image="base.sif"))
    await backend(runner).destroy(dirs, SandboxSpec(image="base.sif"))
    assert len(runner.calls) == 2


async def test_destroy_failure_is_a_500(dirs: SandboxDirs) -> None:
    runner = Recorder((255, "FATAL:   permission denied\n"))
    with pytest.raises(BackendError, match="permission denied") as info:
        await backend(runner).destroy(dirs, SandboxSpec(image="base.sif"))
    assert info.value.status == 500


async def test_a_reset_restarts_the_instance(dirs: SandboxDirs) -> None:
    runner = Recorder()
    await backend(runner).reset(dirs, SandboxSpec(image="base.sif"))
    assert [call[2:4] for call in runner.calls] == [["instance", "stop"], ["instance", "start"]]


async def test_a_wipe_cleans_between_the_stop_and_the_start(dirs: SandboxDirs) -> None:
    """The new instance never sees the workspace half emptied or half seeded."""
    runner = Recorder()
    order: list[str] = []

    async def clean() -> None:
        order.append(f"clean after {len(runner.calls)} calls")

    await backend(runner).reset(dirs, SandboxSpec(image="base.sif"), clean)
    assert order == ["clean after 1 calls"]
    assert [call[2:4] for call in runner.calls] == [["instance", "stop"], ["instance", "start"]]


async def test_instance_names() -> None:
    listing = {
        "instances": [
            {"instance": "prorl-abc-123", "pid": 4242, "img": IMAGE},
            {"instance": "someone-elses", "pid": 4343, "img": "/x.sif"},
        ]
    }
    runner = Recorder(
        (0, "WARNING: a warning first\n" + json.dumps(listing, indent="\t") + "\n"), (0, '{"instances": []}')
    )
    assert await backend(runner).instance_names() == {"prorl-abc-123", "someone-elses"}
    assert runner.calls[0] == ["apptainer", "-s", "instance", "list", "--json"]
    assert await backend(runner).instance_names() == set()


async def test_instance_names_errors() -> None:
    assert await backend(Recorder((1, "INFO: No instances found.\n"))).instance_names() == set()
    with pytest.raises(BackendError, match="could not retrieve"):
        await backend(Recorder((255, "FATAL: could not retrieve instance list\n"))).instance_names()
    with pytest.raises(BackendError, match="no JSON"):
        await backend(Recorder((0, "garbage"))).instance_names()


# -- which binary -----------------------------------------------------------------------------------------
def fake_executable(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_binary_preference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    apptainer = fake_executable(tmp_path, "apptainer")
    singularity = fake_executable(tmp_path, "singularity")
    assert ApptainerBackend().binary == str(apptainer)
    assert ApptainerBackend.probe() == (True, str(apptainer))
    assert ApptainerBackend(binary="/opt/sing/bin/singularity").binary == "/opt/sing/bin/singularity"
    apptainer.unlink()
    assert ApptainerBackend().binary == str(singularity)
    assert ApptainerBackend.probe() == (True, str(singularity))


async def test_probe_and_create_when_neither_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dirs: SandboxDirs
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ApptainerBackend.probe() == (False, "neither apptainer nor singularity is installed")
    runner = Recorder()
    missing = ApptainerBackend(runner=runner)
    assert missing.binary is None
    with pytest.raises(BackendError, match=NOT_INSTALLED):
        await missing.create(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls == [] and runner.version_calls == 0


# -- the default runner -----------------------------------------------------------------------------------
async def test_run_command() -> None:
    assert await run_command(["sh", "-c", "echo out; echo err >&2; exit 3"]) == (3, "out\nerr\n")
    code, output = await run_command(["sh", "-c", "echo ${HOME-unset} $X"], {"PATH": DEFAULT_PATH, "X": "1"})
    assert (code, output) == (0, "unset 1\n")  # exactly the environment given
    code, output = await run_command(["sleep", "30"], timeout=0.2)
    assert code == TIMEOUT_STATUS and "timed out after 0.2 s" in output
    code, output = await run_command(["/nonexistent/apptainer", "instance", "list"])
    assert code == 127 and "cannot run /nonexistent/apptainer" in output


# -- the real thing ---------------------------------------------------------------------------------------
def tiny_image(root: Path) -> str:
    """A root filesystem holding only bash, env and the libraries they load, copied from this host.

    Set PRORL_APPTAINER_TEST_IMAGE to a SIF (or any image reference with bash and env) to use that instead.
    """
    if image := os.environ.get("PRORL_APPTAINER_TEST_IMAGE"):
        return image
    return str(make_rootfs(root / "rootfs", ("bash", "env")))


@pytest.mark.skipif(
    not ApptainerBackend.probe()[0],
    reason=("apptainer/singularity is not installed on this machine; the argv tests above cover the command lines"),
)
async def test_real_instance_runs_a_session(tmp_path: Path) -> None:
    apptainer = ApptainerBackend()
    dirs = SandboxDirs("t" + secrets.token_hex(4), tmp_path / "sandbox", image_root=Path(tiny_image(tmp_path)))
    dirs.workspace.mkdir(parents=True)
    dirs.tmp.mkdir()
    spec = SandboxSpec(image="test", env={"GREETING": 'a,b=$HOME "q"'})
    name = apptainer.instance_name(dirs)

    await apptainer.create(dirs, spec)
    try:
        assert name in await apptainer.instance_names()
        session = ShellSession("default", apptainer.launch(dirs, spec), 65536)
        await session.start()
        try:
            result = await session.run("echo hi", timeout=10, max_output=None, keep=False)
            assert (result.status, result.exit_code, result.output.strip()) == ("completed", 0, "hi")
            result = await session.run(
                'printf "%s|%s|%s" "$HOME" "$PWD" "$GREETING" > /workspace/out; cat /workspace/out',
                timeout=10,
                max_output=None,
                keep=False,
            )
            assert result.output.strip() == '/workspace|/workspace|a,b=$HOME "q"'
            assert (dirs.workspace / "out").read_text() == '/workspace|/workspace|a,b=$HOME "q"'
        finally:
            await session.close()
    finally:
        await apptainer.destroy(dirs, spec)
    assert name not in await apptainer.instance_names()
    await apptainer.destroy(dirs, spec)  # idempotent
