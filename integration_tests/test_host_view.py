"""What a sandbox without an image sees of the host, and what it inherits of the server, tried from inside the
sandbox through the HTTP API of a runtime started as deployed: by root (as CI runs it) and by an unprivileged user.
Before: every top-level host directory but a few was bound read-only (/srv, /var/lib, /opt, the host's whole
/etc, a repository checkout), and a descriptor the server inherited without close-on-exec reached every sandbox."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_adapter.dev.localstack import REPO
from sandbox_runtime.host_view import ETC_FROM_HOST, MERGED_USR

from .conftest import BACKEND_SKIPS, RunningRuntime, stop_server
from .test_security import DEPLOYMENTS, start_deployment

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))

INHERITED_SECRET = "a secret the server's starter left open"
GENERATED_ETC = {"passwd", "group", "hostname", "hosts", "nsswitch.conf", "resolv.conf"}


def host_directory(prefix: str) -> Path:
    """A directory beside the host's own state (not under /tmp, which every sandbox has its own of), readable by
    every uid: what an operator keeps in /var or /srv."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    path.chmod(0o755)
    return path


class Deployment:
    """A runtime started with one named host path and one descriptor inherited without close-on-exec, and the
    host directories next to the named one that nobody named."""

    def __init__(self, kind: str, state: Path) -> None:
        self.named = host_directory("prorl-test-named-")
        (self.named / "tool.txt").write_text("from the host\n")
        self.unnamed = host_directory("prorl-test-unnamed-")
        (self.unnamed / "hidden-tests.txt").write_text("the dataset's hidden tests\n")
        self.secret = self.unnamed / "inherited.txt"
        self.secret.write_text(INHERITED_SECRET)
        self.secret.chmod(0o600)  # the sandbox could not open it by name; only the descriptor would give it away
        self.fd = os.open(self.secret, os.O_RDONLY)  # not inheritable (PEP 446) until pass_fds makes it so
        try:
            self.runtime: RunningRuntime = start_deployment(
                kind, state, "bwrap", "--host-path", str(self.named), pass_fds=(self.fd,)
            )
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        os.close(self.fd)
        shutil.rmtree(self.named, ignore_errors=True)
        shutil.rmtree(self.unnamed, ignore_errors=True)


@pytest.fixture(scope="module", params=DEPLOYMENTS)
def deployment(request, tmp_path_factory) -> Iterator[Deployment]:
    started = Deployment(request.param, tmp_path_factory.mktemp("state"))
    yield started
    stop_server(started.runtime)
    started.remove()


@pytest.fixture
async def box(deployment):
    async with deployment.runtime.client() as client:
        info = await client.create_sandbox()
        yield client, info.id
        await client.delete_sandbox(info.id)


async def output(box, command: str) -> str:
    client, sandbox = box
    result = await client.exec(sandbox, command)
    assert result.exit_code == 0, result.output
    return result.output


# -- item 5: only what a shell needs ----------------------------------------------------------------------------
async def test_the_root_holds_only_usr_its_links_etc_and_the_sandboxs_own(deployment, box):
    top = set((await output(box, "ls -A /")).split())
    named_top = deployment.named.parts[1]  # var: made by bwrap to hold the named path, nothing else of it
    assert top <= {"usr", "etc", "dev", "proc", "tmp", "workspace", named_top, *MERGED_USR}, top
    assert (await output(box, f"ls -A /{named_top}")).split() == [deployment.named.parts[2]]


@pytest.mark.parametrize(
    "path",
    ["/srv", "/var/lib", "/opt", "/home", "/root", "/run", "/sys", "/mnt", "/boot", str(REPO / "pyproject.toml")],
)
async def test_host_directories_are_absent(box, path):
    client, sandbox = box
    result = await client.exec(sandbox, f"ls -A {path}")
    assert result.exit_code != 0, f"{path} is visible: {result.output}"


async def test_a_host_directory_nobody_named_is_absent_beside_a_named_one(deployment, box):
    client, sandbox = box
    result = await client.exec(sandbox, f"cat {deployment.unnamed}/hidden-tests.txt; ls {deployment.unnamed}")
    assert result.exit_code != 0 and "hidden tests" not in result.output


async def test_etc_is_made_for_sandboxes_with_no_host_secret(deployment, box):
    names = set((await output(box, "ls -A /etc")).split())
    allowed = {*GENERATED_ETC, *(n.split("/")[0] for n in ETC_FROM_HOST)}
    assert {n for n in names if not n.startswith("python3.")} <= allowed, names - allowed
    for secret in ("shadow", "gshadow", "machine-id", "ssh", "gitconfig", "pip.conf", "npmrc", "ld.so.preload"):
        assert secret not in names
    assert await output(box, "cat /etc/hostname") == "sandbox\n"
    assert "ssl" not in names or "private" not in (await output(box, "ls -A /etc/ssl")).split()
    host_users = {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines()} - {"root", "nobody"}
    users = set((await output(box, "cut -d: -f1 /etc/passwd")).split())
    assert users <= {"root", "nobody", "sandbox"} and not users & host_users
    assert await output(box, "cat /etc/resolv.conf") == ""  # no network, no resolver


async def test_tools_find_their_user_and_what_they_need(deployment, box):
    uid = int(await output(box, "id -u"))
    assert (await output(box, "whoami")).strip() == ("nobody" if uid == 65534 else "sandbox")
    assert await output(box, "bash -c 'echo $((6 * 7))'; ls /usr/bin/env") == "42\n/usr/bin/env\n"
    python = (
        "import json, sqlite3, ssl, subprocess; print(ssl.create_default_context().cert_store_stats()['x509_ca'] > 0)"
    )
    assert await output(box, f'python3 -c "{python}"') == "True\n"  # Debian's sitecustomize and the CA certificates
    git = "git init -q r && cd r && echo a > a && git add a && git -c user.name=a -c user.email=a@b commit -qm x"
    assert await output(box, f"{git} && git --no-pager log --format=%s") == "x\n"


async def test_a_named_host_path_is_visible_read_only_and_listed(deployment, box):
    client, sandbox = box
    assert await output(box, f"cat {deployment.named}/tool.txt") == "from the host\n"
    for write in (f"echo x > {deployment.named}/tool.txt", f"touch {deployment.named}/planted"):
        assert (await client.exec(sandbox, write)).exit_code != 0
    assert (deployment.named / "tool.txt").read_text() == "from the host\n"
    assert not (deployment.named / "planted").exists()
    assert (await client.info()).host_paths == [str(deployment.named)]


async def test_a_sandbox_with_the_network_gets_the_hosts_resolver(deployment):
    if not Path("/etc/resolv.conf").is_file():
        pytest.skip("this host has no /etc/resolv.conf")
    async with deployment.runtime.client() as client:
        info = await client.create_sandbox(network="host")
        try:
            result = await client.exec(info.id, "cat /etc/resolv.conf")
            assert result.output == Path("/etc/resolv.conf").read_text()
        finally:
            await client.delete_sandbox(info.id)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("relative/dir", "is not an absolute path"),
        ("/no/such/prorl/path", "does not exist"),
        ("/usr/lib", "sandboxes see already or have their own of"),
        ("/etc", "sandboxes see already or have their own of"),
        ("/", "sandboxes see already or have their own of"),
        ("{state}", "the state dir"),
        ("{state_parent}", "the state dir"),
    ],
)
def test_a_host_path_that_cannot_be_shown_is_refused_at_start_up_in_one_line(tmp_path, path, reason):
    state = host_directory("prorl-test-state-")
    try:
        path = path.format(state=state, state_parent=state.parent)
        argv = [sys.executable, "-m", "sandbox_runtime", "serve", "--state-dir", str(state), "--host-path", path]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        shutil.rmtree(state)
    assert done.returncode == 2
    assert done.stderr.startswith("prorl-sandbox: --host-path") and done.stderr.count("\n") == 1, done.stderr
    assert reason in done.stderr


# -- item 6: nothing the server inherited ----------------------------------------------------------------------
async def test_a_descriptor_the_server_inherited_reaches_no_sandbox(deployment, box):
    client, sandbox = box
    server = deployment.runtime.process.pid  # setpriv execs the server under an unprivileged deployment
    assert os.readlink(f"/proc/{server}/fd/{deployment.fd}") == str(deployment.secret)  # the server holds it
    shell = await output(box, "ls /proc/$$/fd")  # an interactive bash keeps its terminal as 255 too
    assert sorted(shell.split(), key=int) == ["0", "1", "2", "255"]
    run = await client.run(sandbox, argv=["ls", "/proc/self/fd"])  # a one-shot run: its pipes, not a terminal
    assert sorted(run.output.split(), key=int) == ["0", "1", "2", "3"]
    for read in (f"cat <&{deployment.fd}", f"cat /proc/self/fd/{deployment.fd}", f"cat {deployment.secret}"):
        result = await client.exec(sandbox, read)
        assert result.exit_code != 0 and INHERITED_SECRET not in result.output
