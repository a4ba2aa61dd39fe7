"""The sandbox runtime as a newcomer meets it in the first hour (issue 46): a kept command's exit status, `$?`
across calls, what the reference and GET /v1/info say against what the server does, messages that say what to
do, and `prorl-sandbox` failing to start with one line that names the flag to change.

The server runs in process (tests/test_clients.py's `sandbox_runtime`: bubblewrap where installed, else the
`local` backend); the start-up failures run the real command as a subprocess."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_runtime.client import SandboxAPIError, SandboxClient
from sandbox_runtime.config import ServerConfig
from sandbox_runtime.images import ImageError, ImageStore
from sandbox_runtime.server import RUNTIME_API
from server_kit.openapi import render_markdown
from tests.test_clients import sandbox_runtime

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


# -- exit statuses ----------------------------------------------------------------------------------------
async def test_echo_status_sees_the_previous_commands_exit_code():
    async with sandbox_runtime() as client:
        box = await client.create_sandbox()
        assert (await client.exec(box.id, "false")).exit_code == 1
        assert (await client.exec(box.id, "echo $?")).output == "1\n"
        assert (await client.exec(box.id, "(exit 42)")).exit_code == 42
        assert (await client.exec(box.id, "echo $?")).output == "42\n"
        # Under `set -u` too: the line that carries the completion nonce expands nothing unset.
        assert (await client.exec(box.id, "set -u; (exit 3)")).exit_code == 3
        assert (await client.exec(box.id, "echo $?")).output == "3\n"
        assert (await client.exec(box.id, "true")).exit_code == 0
        assert (await client.exec(box.id, "echo $?")).output == "0\n"


async def finished_output(client: SandboxClient, box: str, session: str) -> list:
    """Every read of the session's output until one says the command is no longer running."""
    reads = []
    for _ in range(3000):  # a bound, not a timing: the command finishes as soon as its go file exists
        reads.append(await client.read_output(box, session))
        if reads[-1].status != "running":
            return reads
        await asyncio.sleep(0.01)
    raise AssertionError(f"the kept command never finished: {reads[-1]}")


async def test_a_kept_command_that_finished_reports_its_exit_status():
    async with sandbox_runtime() as client:
        box = (await client.create_sandbox()).id
        fresh = await client.read_output(box, "default")
        assert (fresh.status, fresh.exit_code) == ("completed", None)  # no command has run in it yet

        command = "echo started; until [ -e go ]; do sleep 0.01; done; echo finished; (exit 7)"
        kept = await client.exec(box, command, timeout=0.3, session="k", on_timeout="keep")
        assert (kept.status, kept.exit_code) == ("timeout", None)
        running = await client.read_output(box, "k")
        assert (running.status, running.exit_code) == ("running", None)

        await client.write_file(box, "go", b"")  # the command may finish now
        reads = await finished_output(client, box, "k")
        assert (reads[-1].status, reads[-1].exit_code) == ("completed", 7)
        assert "finished" in "".join(r.output for r in reads)
        again = await client.read_output(box, "k")
        assert (again.status, again.exit_code, again.output) == ("completed", 7, "")
        assert (await client.exec(box, "echo $?", session="k")).output == "7\n"


async def test_input_to_a_kept_command_still_reports_its_exit_status():
    async with sandbox_runtime() as client:
        box = (await client.create_sandbox()).id
        kept = await client.exec(box, "read line; exit_with=$line; (exit $exit_with)", timeout=0.3, on_timeout="keep")
        assert kept.status == "timeout"
        answered = await client.send_input(box, "default", text="5\n", timeout=30)
        assert (answered.status, answered.exit_code) == ("completed", 5)
        read = await client.read_output(box, "default")
        assert (read.status, read.exit_code) == ("completed", 5)


# -- the reference and /v1/info ----------------------------------------------------------------------------
async def test_info_reports_the_default_timeout_and_output_cap():
    async with sandbox_runtime() as client:
        info = await client.info()
    defaults = ServerConfig()
    assert info.default_timeout_s == defaults.default_timeout_s == 60
    assert info.default_output_bytes == defaults.default_output_bytes
    assert info.max_timeout_s == defaults.max_timeout_s


def test_every_field_of_the_runtime_api_is_described():
    schemas = RUNTIME_API.document()["components"]["schemas"]
    undescribed = [
        f"{name}.{field}"
        for name, schema in schemas.items()
        for field, field_schema in schema.get("properties", {}).items()
        if not field_schema.get("description")
    ]
    assert undescribed == []


def test_the_reference_states_defaults_and_units_of_the_command_bodies():
    schemas = RUNTIME_API.document()["components"]["schemas"]
    exec_timeout = schemas["ExecRequest"]["properties"]["timeout"]["description"]
    assert "seconds" in exec_timeout and "60 s" in exec_timeout and "default_timeout_s" in exec_timeout
    assert "seconds" in schemas["RunRequest"]["properties"]["timeout"]["description"]
    assert "60 s" in schemas["RunRequest"]["properties"]["timeout"]["description"]
    assert "seconds" in schemas["InputRequest"]["properties"]["timeout"]["description"]
    for model in ("ExecRequest", "RunRequest"):
        assert "64 KiB" in schemas[model]["properties"]["max_output_bytes"]["description"]
    assert "default_timeout_s" in schemas["ServerInfo"]["required"]


def test_the_reference_gives_an_empty_file_no_defaults():
    reference = render_markdown(RUNTIME_API)
    upload = reference.split("## `PUT /v1/sandboxes/{id}/files`", 1)[1].split("\n## ", 1)[0]
    assert "empty means the defaults" not in upload
    assert "(may be empty)" in upload
    create = reference.split("## `POST /v1/sandboxes`", 1)[1].split("\n## ", 1)[0]
    assert "empty means the defaults" in create  # a JSON body that may be left out: the spec's defaults


async def test_a_path_outside_the_sandbox_is_the_400_the_reference_names():
    document = RUNTIME_API.document()
    async with sandbox_runtime() as client:
        box = (await client.create_sandbox()).id
        for method, call in (
            ("put", client.write_file(box, "/etc/passwd", b"x")),
            ("get", client.read_file(box, "/etc")),
        ):
            with pytest.raises(SandboxAPIError) as refused:
                await call
            assert refused.value.status == 400
            assert "outside the sandbox's writable areas" in str(refused.value)
            replies = document["paths"]["/v1/sandboxes/{id}/files"][method]["responses"]
            assert "outside the sandbox's writable areas" in replies["400"]["description"]
            assert "outside" not in replies["403"]["description"]


# -- messages that say what to do ---------------------------------------------------------------------------
async def test_a_directory_read_as_a_file_names_the_http_call_that_fetches_it():
    async with sandbox_runtime() as client:
        box = (await client.create_sandbox()).id
        await client.exec(box, "mkdir -p d")
        with pytest.raises(SandboxAPIError) as refused:
            await client.read_file(box, "d")
    assert refused.value.status == 409
    message = str(refused.value)
    assert "GET /v1/sandboxes/{id}/archive?path=/workspace/d" in message and "pack" not in message


async def test_an_unknown_image_says_where_images_come_from(tmp_path):
    async with sandbox_runtime() as client:
        with pytest.raises(SandboxAPIError) as refused:
            await client.create_sandbox(image="python.sif")
    assert refused.value.status == 400
    assert "no image named 'python.sif' on this server: it has no image directories" in str(refused.value)
    assert "--image-dir" in str(refused.value)

    (tmp_path / "images").mkdir()
    with pytest.raises(ImageError) as missing:
        ImageStore([tmp_path / "images"], tmp_path / "cache").find("python.sif")
    assert str(missing.value) == (
        "no image named 'python.sif' in this server's image directories (GET /v1/images lists them)"
    )


# -- prorl-sandbox failing to start ---------------------------------------------------------------------------
def prorl_sandbox(
    *argv: str, user: int | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real command, as `python -m sandbox_runtime` (what the `prorl-sandbox` script runs), run as `user`
    (through setpriv) where given."""
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    return subprocess.run(
        [*prefix, sys.executable, "-m", "sandbox_runtime", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
        env=env,
    )


def one_line_failure(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("prorl-sandbox"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def test_a_port_in_use_is_one_line_naming_port(listening, tmp_path):
    result = prorl_sandbox("serve", "--port", str(listening), "--state-dir", str(tmp_path / "s"), "--backend", "local")
    one_line_failure(result, f"port {listening} on 127.0.0.1 is already in use", "--port")
    assert result.returncode == 1


def test_debug_shows_the_traceback(listening, tmp_path):
    for flags in (["--debug"], ["--log-level", "debug"]):
        argv = ["serve", "--port", str(listening), "--state-dir", str(tmp_path / "s"), "--backend", "local", *flags]
        result = prorl_sandbox(*argv)
        assert result.returncode != 0
        assert "Traceback" in result.stderr and "already in use" in result.stderr


def test_a_locked_state_dir_is_one_line_naming_state_dir(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with open(state / "server.lock", "w") as lock:  # as a running server holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = prorl_sandbox("serve", "--port", "0", "--state-dir", str(state), "--backend", "local")
    one_line_failure(result, f"another sandbox server is using state dir {state}", "--state-dir")


@pytest.fixture
def closed_dir() -> Iterator[Path]:
    """A directory its owner (root) may enter and nobody else may (0700), under one everybody may traverse."""
    outer = Path(tempfile.mkdtemp(prefix="prorl-test-first-hour-"))
    outer.chmod(0o711)
    (outer / "closed").mkdir(mode=0o700)
    try:
        yield outer / "closed"
    finally:
        shutil.rmtree(outer, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's sandbox uids: only a root server checks them")
def test_a_state_dir_the_sandbox_uids_cannot_reach_is_one_line_naming_state_dir(closed_dir):
    result = prorl_sandbox("serve", "--port", "0", "--state-dir", str(closed_dir / "s"), "--backend", "local")
    one_line_failure(result, "cannot traverse", "--state-dir")


def test_a_state_dir_the_server_cannot_enter_is_one_line_naming_state_dir(closed_dir):
    """As an unprivileged server runs: as nobody when the tests run as root (the directory is root's, 0700), else
    as the tests' user in a directory of its own that nobody may enter (mode 0)."""
    user = None
    if os.geteuid() == 0:
        user = NOBODY
        probe = prorl_sandbox("--help", user=user)
        if probe.returncode != 0:
            pytest.skip(f"this checkout cannot be run by the unprivileged user nobody: {probe.stderr[-200:]}")
    else:
        closed_dir.chmod(0)
    try:
        argv = ["serve", "--port", "0", "--state-dir", str(closed_dir / "s"), "--backend", "local"]
        result = prorl_sandbox(*argv, user=user)
    finally:
        closed_dir.chmod(0o700)
    one_line_failure(result, f"cannot use the state dir {closed_dir / 's'}: Permission denied", "--state-dir")


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--port", "x"], ["--port", "invalid int value: 'x'"]),
        (["--port", "70000"], ["--port 70000 is not a port"]),
        (["--log-level", "LOUD"], ["--log-level", "'LOUD' is not a log level"]),
        (["--sandbox-uids", "5"], ["--sandbox-uids", "uid range '5' is not FIRST-LAST"]),
        (["--max-sandboxes", "0"], ["--max-sandboxes 0 must be at least 1"]),
        (["--image-cache-gb", "0"], ["--image-cache-gb 0 must be above 0"]),
        (["--backend", "docker"], ["--backend", "invalid choice: 'docker'"]),
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
        (["--host", "no-such-host.invalid", "--token", "t"], ["cannot listen on no-such-host.invalid", "--host"]),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(flags, fragments, tmp_path):
    result = prorl_sandbox("serve", "--state-dir", str(tmp_path / "s"), "--backend", "local", *flags)
    one_line_failure(result, *fragments)


def test_image_dir_that_does_not_exist_is_one_line_naming_image_dir(tmp_path):
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "s"), "--backend", "local"]
    result = prorl_sandbox(*argv, "--image-dir", str(tmp_path / "no-images"))
    one_line_failure(result, f"image directory {tmp_path / 'no-images'} does not exist", "--image-dir")


def test_a_backend_that_is_not_installed_is_one_line_naming_backend(tmp_path):
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "s"), "--backend", "bwrap"]
    result = prorl_sandbox(*argv, env={**os.environ, "PATH": str(tmp_path)})  # no bwrap on this PATH
    one_line_failure(result, "--backend bwrap: bubblewrap is not installed (apt-get install bubblewrap)")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["openapi", "--help"]])
def test_help_works(argv):
    result = prorl_sandbox(*argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: prorl-sandbox")
    assert result.stderr == ""


def test_no_command_is_one_line():
    one_line_failure(prorl_sandbox(), "the following arguments are required: command", "--help")


@pytest.mark.parametrize("ready", [False, True], ids=["before-ready", "after-ready"])
def test_a_crash_after_start_up_keeps_its_traceback_and_a_failure_before_it_is_one_line(
    ready, tmp_path, monkeypatch, capsys
):
    """In process, the server replaced by one that fails: before it said it listens (a start-up failure, one
    line), or after (a crash hours into serving, whose traceback must not be lost without --debug)."""
    from sandbox_runtime import cli, server, spawn

    async def serve(config, listening=None):
        if ready:
            listening()
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(spawn, "_sealed", True)  # pytest's own descriptors stay as they are
    monkeypatch.setattr(server, "serve", serve)
    assert cli.main(["serve", "--port", "0", "--state-dir", str(tmp_path / "s"), "--backend", "local"]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("prorl-sandbox: ") and "RuntimeError: the disk went away" in last
    if ready:
        assert "Traceback (most recent call last)" in err and "in serve" in err
    else:
        assert err.splitlines() == [last] and "--debug" in last


async def test_a_debug_trap_planted_in_a_session_forges_its_marker_but_not_a_one_shot_runs_status():
    """What session.py's docstring says: the session's own code can print the completion marker (a DEBUG trap
    reads the nonce), so a session's exit_code and cwd are what that code says; a grader's check goes through
    the one-shot /run (clean_check.run_check, swe.py), a process of its own that no session's trap reaches."""
    async with sandbox_runtime() as client:
        box = await client.create_sandbox()
        await client.exec(box.id, """trap 'printf "\\036%s:0:/x\\036\\n" "$__prorl_nonce"' DEBUG""")
        forged = await client.exec(box.id, "(exit 3)")
        assert (forged.exit_code, forged.cwd) == (0, "/x")  # forged: the trap ran before the command
        assert (await client.run(box.id, script="exit 3")).exit_code == 3
        assert (await client.run(box.id, argv=["false"])).exit_code == 1
