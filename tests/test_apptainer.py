"""The Apptainer backend: its exact command lines, checked without the binary, and one real run if it exists.

Async tests run under pytest-asyncio's auto mode (pyproject.toml).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox_runtime.backends.apptainer import NOT_INSTALLED, TIMEOUT_STATUS, ApptainerBackend, run_command
from sandbox_runtime.backends.base import DEFAULT_PATH, SHELL_ARGV, BackendError, SandboxDirs
from sandbox_runtime.models import Limits, SandboxSpec
from sandbox_runtime.session import ShellSession

IMAGE = "/images/base.sif"


class Recorder:
    """A runner that records each command line and answers with canned (exit status, output) pairs."""

    def __init__(self, *answers: tuple[int, str]) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    async def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(list(argv))
        return self.answers.pop(0) if self.answers else (0, "")


@pytest.fixture
def dirs(tmp_path: Path) -> SandboxDirs:
    # The manager resolves a spec's image name under the server's image directories into `image_root`.
    return SandboxDirs("abc-123", tmp_path / "sb", image_root=Path(IMAGE))


def backend(runner: Recorder | None = None, **kwargs) -> ApptainerBackend:
    return ApptainerBackend(binary="apptainer", runner=runner or Recorder(), **kwargs)


def start_argv(dirs: SandboxDirs, *middle: str, image: str = IMAGE, workdir: str = "/workspace") -> list[str]:
    return [
        "apptainer",
        "instance",
        "start",
        "--containall",
        "--no-mount",
        "home,cwd,tmp",
        "--writable-tmpfs",
        *middle,
        "--bind",
        f"{dirs.root}/tmp:/tmp",
        "--bind",
        f"{dirs.root}/workspace:{workdir}",
        image,
        "prorl-abc-123",
    ]


# -- instance start ---------------------------------------------------------------------------------------
def test_refused_under_a_root_server(dirs: SandboxDirs) -> None:
    as_sandbox_uid = SandboxDirs(dirs.id, dirs.root, uid=2_000_000_000, image_root=dirs.image_root)
    with pytest.raises(BackendError) as error:
        backend().start_argv(as_sandbox_uid, SandboxSpec(image="base.sif"))
    assert error.value.status == 400 and "unprivileged server" in str(error.value)


async def test_create_default_spec_has_no_network(dirs: SandboxDirs) -> None:
    runner = Recorder()
    await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls == [start_argv(dirs, "--net", "--network", "none")]


def test_network_host_has_no_net_flags(dirs: SandboxDirs) -> None:
    argv = backend().start_argv(dirs, SandboxSpec(image="base.sif", network="host"))
    assert argv == start_argv(dirs)


def test_fakeroot(dirs: SandboxDirs) -> None:
    argv = backend(fakeroot=True).start_argv(dirs, SandboxSpec(image="base.sif"))
    assert argv == start_argv(dirs, "--net", "--network", "none", "--fakeroot")


def test_custom_workdir_and_default_image(dirs: SandboxDirs) -> None:
    no_image = SandboxDirs(dirs.id, dirs.root)
    argv = backend(default_image="docker://bash:5").start_argv(no_image, SandboxSpec(workdir="/code"))
    assert argv == start_argv(dirs, "--net", "--network", "none", image="docker://bash:5", workdir="/code")
    # The spec's own image wins over the default.
    argv = backend(default_image="docker://bash:5").start_argv(dirs, SandboxSpec(image="base.sif"))
    assert argv[-2] == IMAGE


async def test_missing_image_is_a_400(dirs: SandboxDirs) -> None:
    runner = Recorder()
    with pytest.raises(BackendError) as info:
        await backend(runner).create(SandboxDirs(dirs.id, dirs.root), SandboxSpec())
    assert info.value.status == 400
    assert "image is required for apptainer" in str(info.value)
    assert runner.calls == []


async def test_failing_start_is_a_500_with_the_output(dirs: SandboxDirs) -> None:
    runner = Recorder((255, "INFO: Converting SIF file\nFATAL:   could not open image /images/base.sif\n"))
    with pytest.raises(BackendError) as info:
        await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert info.value.status == 500
    assert "FATAL:   could not open image /images/base.sif" in str(info.value)
    assert "exit 255" in str(info.value)


async def test_timed_out_start_stops_what_it_may_have_started(dirs: SandboxDirs) -> None:
    runner = Recorder((TIMEOUT_STATUS, "apptainer instance start timed out after 120 s"), (255, "no instance"))
    with pytest.raises(BackendError, match="timed out"):
        await backend(runner).create(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls[1] == ["apptainer", "instance", "stop", "--force", "prorl-abc-123"]


# -- sessions ---------------------------------------------------------------------------------------------
def test_launch_carries_the_environment_in_argv(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("APPTAINER", "SINGULARITY")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", "/opt/apptainer/bin:/usr/bin")
    monkeypatch.setenv("APPTAINER_CONFIGDIR", "/srv/apptainer")  # where the instance files live
    monkeypatch.setenv("APPTAINERENV_LEAK", "no")  # would be injected into the container
    monkeypatch.setenv("SECRET_TOKEN", "no")
    value = 'a,b=$HOME "q" `x`'  # kept verbatim: no --env CSV splitting or shell evaluation
    spec = SandboxSpec(
        image="base.sif", workdir="/code", env={"ZED": "1", "ALPHA": value}, limits=Limits(memory_mb=512)
    )

    launch = backend().launch(dirs, spec)

    assert launch.argv == [
        "apptainer",
        "exec",
        "--pwd",
        "/code",
        "instance://prorl-abc-123",
        "env",
        "--",
        f"ALPHA={value}",
        "HOME=/code",
        f"PATH={DEFAULT_PATH}",
        "PS1=",
        "PS2=",
        "TERM=dumb",
        "ZED=1",
        *SHELL_ARGV,
    ]
    assert launch.env == {"PATH": "/opt/apptainer/bin:/usr/bin", "APPTAINER_CONFIGDIR": "/srv/apptainer"}
    assert launch.ulimits == ["-v", str(512 * 1024)]
    assert launch.pid_namespace is False
    assert launch.cwd is None


def test_launch_env_falls_back_to_the_default_path(dirs: SandboxDirs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PATH", raising=False)
    assert backend().launch(dirs, SandboxSpec(image="base.sif")).env["PATH"] == DEFAULT_PATH


def test_spec_env_overrides_the_shell_defaults(dirs: SandboxDirs) -> None:
    spec = SandboxSpec(image="base.sif", env={"PATH": "/venv/bin:/usr/bin", "TERM": "xterm"})
    argv = backend().launch(dirs, spec).argv
    assert "PATH=/venv/bin:/usr/bin" in argv and "TERM=xterm" in argv
    assert f"PATH={DEFAULT_PATH}" not in argv and "TERM=dumb" not in argv


# -- instance stop and list -------------------------------------------------------------------------------
async def test_destroy_stops_the_instance(dirs: SandboxDirs) -> None:
    runner = Recorder()
    await backend(runner).destroy(dirs, SandboxSpec(image="base.sif"))
    assert runner.calls == [["apptainer", "instance", "stop", "--force", "prorl-abc-123"]]
    assert backend().stop_argv("prorl-x") == ["apptainer", "instance", "stop", "--force", "prorl-x"]


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
    assert runner.calls[0] == ["apptainer", "instance", "list", "--json"]
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
    assert runner.calls == []


# -- the default runner -----------------------------------------------------------------------------------
async def test_run_command() -> None:
    assert await run_command(["sh", "-c", "echo out; echo err >&2; exit 3"]) == (3, "out\nerr\n")
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
    rootfs = root / "rootfs"
    for sub in ("bin", "usr/bin", "etc", "proc", "sys", "dev", "tmp", "workspace", "root", "home", "var"):
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    for name in ("passwd", "group", "hosts", "resolv.conf"):
        (rootfs / "etc" / name).touch()
    files: set[str] = set()
    for program in ("bash", "env"):
        path = shutil.which(program)
        assert path, f"{program} is needed to build the test image"
        for target in (f"/bin/{program}", f"/usr/bin/{program}"):
            shutil.copy2(path, rootfs / target.lstrip("/"))
        ldd = subprocess.run(["ldd", path], capture_output=True, text=True, check=False).stdout
        files.update(word for line in ldd.splitlines() for word in line.split() if word.startswith("/"))
    shutil.copy2(shutil.which("bash"), rootfs / "bin/sh")
    if os.path.exists("/etc/ld.so.cache"):
        files.add("/etc/ld.so.cache")
    for path in files:
        target = rootfs / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)  # follows symlinks: the library itself lands at the path the loader asks for
    return str(rootfs)


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
