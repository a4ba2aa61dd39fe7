"""The apptainer backend through the real server and HTTP client, with tests/standins/apptainer in place of
Apptainer (which cannot be installed here): what a session sees, what the server's environment can no longer
add, and what is left once a sandbox is gone. The server runs unprivileged (nobody under root), as on a cluster.

What the stand-in stands for, and where it differs from Apptainer, is in its docstring; the real install's
run is tests/test_apptainer.py::test_real_instance_runs_a_session (skipped without Apptainer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_runtime.client import SandboxAPIError, SandboxClient
from tests.standins.rootfs import make_rootfs
from tests.standins.runtime import (
    NOBODY,
    REPO,
    STANDIN,
    StandinServer,
    private_dir,
    python_for_user,
    standin_bin,
    start_standin_server,
)

TEST_IMAGES = REPO / ".test-images"
SIF = TEST_IMAGES / "debian-python.sif"

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="the apptainer stand-in runs containers with bwrap"),
    pytest.mark.skipif(python_for_user() is None, reason="no Python the unprivileged user nobody can run"),
]


@pytest.fixture(scope="module")
def host_dirs() -> Iterator[dict[str, Path]]:
    """The image directory (a small root filesystem, `tiny`), the stand-in's bin dir and a host directory
    that the server's environment and the site configuration would bind into every container."""
    images, tools = private_dir("prorl-standin-images-"), private_dir("prorl-standin-bin-")
    secret = private_dir("prorl-secret-")
    make_rootfs(images / "tiny")
    (secret / "secret.txt").write_text("host secret\n")
    (secret / "secret.txt").chmod(0o644)
    secret.chmod(0o755)
    yield {"images": images, "bin": tools, "secret": secret}
    for path in (images, tools, secret):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(host_dirs) -> Iterator[StandinServer]:
    secret = host_dirs["secret"]
    # apptainer.conf's site `bind path` entries, and what HPC module files put in the environment.
    bin_dir = standin_bin(host_dirs["bin"] / "apptainer", conf=f"bind path = {secret}:/site\n")
    leaks = {
        "APPTAINER_BIND": f"{secret}:/leak",
        "SINGULARITY_BINDPATH": f"{secret}:/leak2",
        "APPTAINERENV_LEAKED": "from the server's environment",
    }
    image_dirs = [host_dirs["images"], *([TEST_IMAGES] if SIF.is_file() else [])]
    started = start_standin_server(bin_dir, image_dirs, leaks)
    yield started
    started.stop()


@pytest.fixture
async def client(server) -> Iterator[SandboxClient]:
    async with SandboxClient(server.url) as client:
        yield client


@pytest.fixture
async def box(client):
    info = await client.create_sandbox(image="tiny")
    yield info
    await client.delete_sandbox(info.id)


def live_processes(uid: int = NOBODY if os.geteuid() == 0 else os.getuid()) -> dict[int, str]:
    """pid -> command line of the user's processes that are not zombies."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid or (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
    return found


def wait_gone(needle: str, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = [cmd for cmd in live_processes().values() if needle in cmd]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def instances(server: StandinServer) -> list[str]:
    listed = server.apptainer("-s", "instance", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return [entry["instance"] for entry in json.loads(listed.stdout)["instances"]]


# -- what a session sees ----------------------------------------------------------------------------------
async def test_echo_is_exactly_its_output(client, box):
    first = await client.exec(box.id, "echo hi")
    assert (first.status, first.exit_code, first.output) == ("completed", 0, "hi\n")  # no `Apptainer> `, no INFO
    again = await client.exec(box.id, "echo hi")
    assert again.output == "hi\n"
    prompt = await client.exec(box.id, 'printf "[%s][%s][%s]" "$PS1" "$PS2" "${PROMPT_COMMAND:0:9}"')
    assert prompt.output == "[][][__prorl_r]"


async def test_the_servers_environment_adds_no_mount_and_no_variable(client, box):
    result = await client.exec(box.id, 'ls /leak /leak2 /site 2>&1; echo "${LEAKED-unset}"; cat /leak/secret.txt')
    assert "host secret" not in result.output
    for path in ("/leak", "/leak2", "/site"):
        assert f"cannot access '{path}'" in result.output
    assert "\nunset\n" in result.output


async def test_the_workdir_is_the_workspace_and_the_file_api_sees_it(client, box):
    result = await client.exec(box.id, 'pwd; echo "$HOME"; echo written > out.txt; mkdir -p sub; echo x > /tmp/t')
    assert result.output == "/workspace\n/workspace\n"
    assert await client.read_file(box.id, "out.txt") == b"written\n"
    assert await client.read_file(box.id, "/tmp/t") == b"x\n"
    await client.write_file(box.id, "sub/in.txt", "from the API\n")
    assert (await client.exec(box.id, "cat sub/in.txt")).output == "from the API\n"


async def test_a_custom_workdir(client):
    info = await client.create_sandbox(image="tiny", workdir="/code")
    try:
        assert (await client.exec(info.id, "pwd")).output == "/code\n"
    finally:
        await client.delete_sandbox(info.id)


@pytest.mark.parametrize("workdir", ["/data:ro", "/w,/etc:/x"])
async def test_a_workdir_with_bind_separators_is_a_400(client, workdir):
    with pytest.raises(SandboxAPIError) as info:
        await client.create_sandbox(image="tiny", workdir=workdir)
    assert info.value.status == 400 and "':' or ','" in info.value.message


async def test_what_the_backends_flags_and_environment_are_for(server, box):
    """Through the stand-in as the backend's commands reach it: without `-s` a notice leads the output, and an
    exec with another HOME than `instance start` had finds no instance."""
    instance = f"instance://prorl-{box.id}"
    quiet = server.apptainer("-s", "exec", "--cleanenv", instance, "echo", "hi")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "hi\n", "")
    noisy = server.apptainer("exec", "--cleanenv", instance, "true")
    assert noisy.returncode == 0 and noisy.stderr.startswith("INFO:")
    elsewhere = server.apptainer("-s", "exec", instance, "true", HOME="/")
    assert elsewhere.returncode == 255 and f"no instance found with name prorl-{box.id}" in elsewhere.stderr


# -- what is left ---------------------------------------------------------------------------------------
async def test_a_setsid_daemon_is_gone_after_end_processes(client, box):
    marker = "4242.25"  # sleep's argument: this test's process, and nobody else's
    await client.exec(box.id, f"setsid sleep {marker} > /dev/null 2>&1 < /dev/null &")
    deadline = time.monotonic() + 30  # a bound on a loaded machine, not a measurement
    while not any(f"sleep {marker}" in cmd for cmd in live_processes().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(f"sleep {marker}" in cmd for cmd in live_processes().values())
    await client.end_processes(box.id)
    assert wait_gone(f"sleep {marker}") == []
    assert (await client.exec(box.id, "echo back")).output == "back\n"  # a fresh instance and session


async def test_delete_leaves_no_instance_and_no_process(client, server):
    info = await client.create_sandbox(image="tiny")
    await client.exec(info.id, "setsid sleep 4343.5 > /dev/null 2>&1 < /dev/null & sleep 4343.75 &")
    name = f"prorl-{info.id}"
    assert name in instances(server)
    assert any(info.id in cmd for cmd in live_processes().values())  # its bwrap and its session's exec
    await client.delete_sandbox(info.id)
    assert name not in instances(server)
    assert wait_gone(info.id) == []
    assert wait_gone("sleep 4343.") == []
    assert not list(server.home.glob(f".apptainer/instances/app/*/*/{name}"))


async def test_a_sif_image(client):
    if not SIF.is_file():
        pytest.skip(f"{SIF} is not built (scripts/test-images.sh builds it)")
    info = await client.create_sandbox(image=SIF.name)
    try:
        result = await client.exec(info.id, 'python3 -c "print(6 * 7)"; pwd; grep ^ID= /etc/os-release')
        assert result.output == "42\n/workspace\nID=debian\n"
    finally:
        await client.delete_sandbox(info.id)


# -- SingularityCE 4 in OCI mode ------------------------------------------------------------------------
async def test_singularity_ce_in_oci_mode_gets_no_oci(host_dirs):
    bin_dir = standin_bin(host_dirs["bin"] / "singularity", "singularity", conf="oci mode = yes\n")
    refused = subprocess.run(
        [str(bin_dir / "singularity"), "instance", "start", str(host_dirs["images"] / "tiny"), "x"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
    )
    assert refused.returncode == 255 and "--no-oci" in refused.stderr  # what the backend would hit without it
    server = start_standin_server(bin_dir, [host_dirs["images"]], backend="singularity")
    try:
        async with SandboxClient(server.url) as client:
            info = await client.create_sandbox(image="tiny")
            assert (await client.exec(info.id, "echo hi")).output == "hi\n"
            await client.delete_sandbox(info.id)
    finally:
        server.stop()


# -- the stand-in's own command line --------------------------------------------------------------------
def standin(*args: str, name: str = "apptainer", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(STANDIN), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **(env or {})},
    )


def test_standin_versions_and_flags():
    assert standin("--version").stdout == "apptainer version 1.4.5\n"
    ce = {"STANDIN_APPTAINER_FLAVOUR": "singularity-ce"}
    assert standin("--version", env=ce).stdout == "singularity-ce version 4.3.0\n"
    refused = standin("-s", "instance", "start", "--no-oci", "/", "x")
    assert refused.returncode == 255 and "Error: unknown flag: --no-oci" in refused.stderr
    oci = standin("instance", "start", "/", "x", env={**ce, "STANDIN_SINGULARITY_OCI_MODE": "yes"})
    assert oci.returncode == 255 and "OCI-mode does not support instances" in oci.stderr
    missing = standin("-s", "exec", "instance://absent", "true")
    assert missing.returncode == 255 and "no instance found with name absent" in missing.stderr
    assert standin("instance", "list", "--json").stdout == '{\n\t"instances": []\n}\n'
