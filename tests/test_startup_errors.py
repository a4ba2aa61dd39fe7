"""Both servers failing to start (issue 45): whatever an operator can get wrong is one line on stderr that says
what to change, the flag or the step, and a non-zero exit status; never a traceback (that is --debug's).

The real commands run as subprocesses (`python -m sandbox_runtime`, `python -m prorl_adapter`), as root where
the tests run as root (as CI does) and, where it matters, as the unprivileged user nobody. The failures that
tests/test_runtime_first_hour.py and tests/test_service_first_hour.py already cover (a port in use, a state dir
another server holds or this user cannot enter, a missing image directory, bubblewrap missing, a tokenizer that
is not there, a buffer URL of no known scheme, bad flag values) are not repeated here."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_runtime_first_hour import NOBODY, one_line_failure, prorl_sandbox
from tests.test_service_first_hour import assert_one_line, run

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="what a root server refuses: the tests do not run as root")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may traverse (pytest's own are root's, 0700), holding `closed`, which only its
    owner may enter (0700), and `nobody`, which the unprivileged user owns."""
    base = Path(tempfile.mkdtemp(prefix="prorl-test-startup-"))
    base.chmod(0o711)
    (base / "closed").mkdir(mode=0o700)
    (base / "nobody").mkdir()
    if os.geteuid() == 0:
        os.chown(base / "nobody", NOBODY, NOBODY)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def unprivileged() -> int:
    """The user an unprivileged server runs as here: nobody, when the tests run as root."""
    if os.geteuid() != 0:
        pytest.skip("becoming the unprivileged user nobody needs root")
    probe = prorl_sandbox("--help", user=NOBODY)
    if probe.returncode != 0:
        pytest.skip(f"this checkout cannot be run by the unprivileged user nobody: {probe.stderr[-200:]}")
    return NOBODY


def serve_runtime(state: Path, *flags: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return prorl_sandbox("serve", "--port", "0", "--state-dir", str(state), "--backend", "local", *flags, **kwargs)


# -- prorl-sandbox serve ------------------------------------------------------------------------------------
@ROOT
def test_a_state_dir_below_a_directory_the_sandbox_uids_cannot_traverse_names_both_and_state_dir(shared):
    """`--state-dir ~/prorl` as root: the state dir does not exist yet, and lies below a 0700 home."""
    state = shared / "closed" / "prorl" / "state"
    line = one_line_failure(serve_runtime(state), f"the state dir {state} lies below {shared / 'closed'}")
    assert "cannot traverse" in line and "give --state-dir one they can reach" in line


@ROOT
def test_an_image_dir_the_sandbox_uids_cannot_traverse_names_image_dir_not_state_dir(shared, tmp_path):
    line = one_line_failure(
        serve_runtime(shared / "state", "--image-dir", str(shared / "closed")),
        f"the image directory {shared / 'closed'} is one the sandboxes' unprivileged uids cannot traverse",
        "give --image-dir one they can reach",
    )
    assert "--state-dir" not in line


def test_an_image_dir_that_is_a_file_names_image_dir(tmp_path):
    (tmp_path / "images.sif").write_bytes(b"")
    result = serve_runtime(tmp_path / "s", "--image-dir", str(tmp_path / "images.sif"))
    one_line_failure(result, f"image directory {tmp_path / 'images.sif'} is not a directory: fix --image-dir")


@pytest.mark.parametrize("where", ["state", "images"], ids=["the state dir", "its image cache"])
def test_a_file_where_the_state_dir_needs_a_directory_names_state_dir(where, tmp_path):
    """The state dir itself a file, or its `images` (the unpacked images' cache) one."""
    state = tmp_path / "state"
    if where == "state":
        state.write_text("")
    else:
        state.mkdir()
        (state / "images").write_text("")
    one_line_failure(serve_runtime(state), "Not a directory" if where == "state" else "File exists", "--state-dir")


@pytest.mark.parametrize("backend", ["apptainer", "singularity"])
def test_an_apptainer_backend_that_is_not_installed_names_backend(backend, tmp_path):
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "s"), "--backend", backend]
    result = prorl_sandbox(*argv, env={**os.environ, "PATH": str(tmp_path)})  # neither program on this PATH
    one_line_failure(result, f"--backend {backend}: neither apptainer nor singularity is installed")


def test_an_apptainer_binary_that_is_not_there_names_apptainer_binary(tmp_path):
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "s"), "--backend", "apptainer"]
    result = prorl_sandbox(*argv, "--apptainer-binary", str(tmp_path / "apptainer"))
    one_line_failure(result, f"--apptainer-binary {tmp_path / 'apptainer'} is not an executable")


@ROOT
def test_the_apptainer_backend_under_a_root_server_is_refused_at_start_up(tmp_path):
    """Apptainer started by root would run each sandbox as root: every creation would be refused."""
    argv = ["serve", "--port", "0", "--state-dir", str(tmp_path / "s"), "--backend", "apptainer"]
    result = prorl_sandbox(*argv, "--apptainer-binary", shutil.which("true") or "/bin/true")
    one_line_failure(result, "--backend apptainer runs only under an unprivileged server", "as a normal user")


@ROOT
def test_sandbox_uids_that_hold_an_account_are_refused_naming_it(tmp_path):
    account = next((entry for entry in pwd.getpwall() if entry.pw_uid > 0), None)
    if account is None:
        pytest.skip("this machine has no account but root")
    uids = f"{account.pw_uid}-{account.pw_uid}"
    line = one_line_failure(serve_runtime(tmp_path / "s", "--sandbox-uids", uids), f"--sandbox-uids {uids}")
    assert f"holds uid {account.pw_uid} of the account {account.pw_name!r}" in line
    assert "give a range no account uses" in line


@pytest.mark.parametrize("variable", [None, "PRORL_SANDBOX_TOKEN"])
def test_a_token_with_a_newline_is_refused_naming_where_it_came_from(variable, tmp_path):
    """A newline kept from a file: no Authorization header carries it, so every request would be a 401."""
    if variable is None:
        result = serve_runtime(tmp_path / "s", "--token", "secret\n")
    else:
        result = serve_runtime(tmp_path / "s", env={**os.environ, variable: "secret\n"})
    one_line_failure(result, "--token (or PRORL_SANDBOX_TOKEN) holds a control character")


def test_a_host_path_this_user_cannot_reach_says_so_not_that_it_is_missing(shared):
    user = unprivileged()
    result = serve_runtime(shared / "nobody" / "s", "--host-path", str(shared / "closed" / "agent"), user=user)
    one_line_failure(result, f"--host-path {shared / 'closed' / 'agent'} cannot be reached by this server")


def test_an_image_dir_this_user_cannot_list_names_image_dir(shared):
    user = unprivileged()
    for image_dir in (shared / "closed", shared / "closed" / "images"):  # unreadable; below one it cannot enter
        result = serve_runtime(shared / "nobody" / "s", "--image-dir", str(image_dir), user=user)
        one_line_failure(result, f"cannot list the image directory {image_dir}: Permission denied", "--image-dir")


# -- prorl-rollout serve ------------------------------------------------------------------------------------
def rollout(tmp_path: Path, *flags: str, tokenizer: Path | None = None, user: int | None = None, **env: str):
    """`python -m prorl_adapter serve` on a free port, with a directory that passes the tokenizer check (it holds
    a tokenizer's file, which does not load), run as `user` (through setpriv) where given."""
    if tokenizer is None:
        tokenizer = tmp_path / "tok"
        tokenizer.mkdir(exist_ok=True)
        (tokenizer / "tokenizer.json").write_text("{}")
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    argv = [*prefix, sys.executable, "-m", "prorl_adapter", "serve", "--tokenizer", str(tokenizer), "--port", "0"]
    return run([*argv, *flags], tmp_path, **env)


def test_a_redis_buffer_that_cannot_be_reached_fails_at_once_naming_buffer_and_not_the_password(tmp_path):
    """It would otherwise retry for ever before it listens, saying only that Redis is away."""
    with socket.socket() as refusing:  # bound, never listening: connections to it are refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        result = rollout(tmp_path, "--buffer", f"redis://:mypassword@127.0.0.1:{port}/0")
    assert result.returncode == 1
    line = assert_one_line(result, "--buffer (or PRORL_BUFFER_URL): Redis at", f"127.0.0.1:{port}", "cannot be reached")
    assert "mypassword" not in line


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://:mypassword@host:port/0", "Port could not be cast to integer value as 'port'"),
        ("redis://:mypassword@host:6379/zero", "what follows HOST:PORT is no database number"),
        ("redis:///:mypassword@host:6379/0", "what follows HOST:PORT is no database number"),
        ("unix://", "unix:// names no socket"),
    ],
)
def test_a_malformed_redis_url_is_refused_naming_buffer_and_not_the_password(url, says, tmp_path):
    result = rollout(tmp_path, "--buffer", url)
    assert result.returncode == 2
    line = assert_one_line(result, "--buffer (or PRORL_BUFFER_URL)", says)
    assert "mypassword" not in line


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--llm-url", "http//gpu-0:8000", "--llm-url 'http//gpu-0:8000' is not an LLM server's URL"),
        ("--llm-url", "http://gpu-0:port", "--llm-url 'http://gpu-0:port' is not an LLM server's URL"),
        ("--sandbox-url", "node-7:8765", "--sandbox-url 'node-7:8765' is not a sandbox runtime's URL"),
        ("--gateway-address", "node-7", "--gateway-address 'node-7' is not HOST:PORT"),
        ("--gateway-port", "70000", "--gateway-port 70000 is not a port"),
        ("--token", "t0k\n", "--token (or PRORL_ROLLOUT_TOKEN) holds a control character"),
        ("--sandbox-token", " t0k", "--sandbox-token (or PRORL_SANDBOX_TOKEN) holds a control character"),
    ],
)
def test_a_value_that_names_nothing_usable_is_refused_naming_the_flag(flag, value, says, tmp_path):
    """URLs and addresses the service would otherwise start with, then fail on (or wait for) at every use."""
    result = rollout(tmp_path, flag, value)
    assert result.returncode == 2
    assert_one_line(result, says)


def test_a_record_dir_that_cannot_be_made_names_record(tmp_path):
    (tmp_path / "file").write_text("")
    result = rollout(tmp_path, "--record", str(tmp_path / "file" / "records"))
    assert result.returncode == 1
    assert_one_line(result, f"--record {tmp_path / 'file' / 'records'}: cannot write records", "Not a directory")


def test_a_record_dir_this_user_cannot_write_names_record(shared):
    """An existing directory the unprivileged user may read and not write: refused at start-up, not when the
    first shard is written."""
    user = unprivileged()
    records = shared / "records"
    records.mkdir(mode=0o755)
    tokenizer = shared / "nobody" / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    result = rollout(shared / "nobody", "--record", str(records), tokenizer=tokenizer, user=user)
    assert_one_line(result, f"--record {records}: cannot write records", "Permission denied")


def test_a_tokenizer_below_a_directory_this_user_cannot_enter_names_tokenizer(shared):
    user = unprivileged()
    tokenizer = shared / "closed" / "tok"
    result = rollout(shared / "nobody", tokenizer=tokenizer, user=user)
    assert_one_line(result, f"--tokenizer {tokenizer}: this user cannot reach it (Permission denied)")


def test_a_plugin_that_does_not_import_names_plugin(tmp_path):
    result = rollout(tmp_path, "--plugin", "no_such_module_here:Plugin")
    assert result.returncode == 1
    line = assert_one_line(result, "cannot load plugin 'no_such_module_here:Plugin'", "fix --plugin or --block-plugin")
    assert "No module named 'no_such_module_here'" in line


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ('{"staleness": {"mode": "off", "max_stalenes": 2}}', "staleness.max_stalenes: Extra inputs are not permitted"),
        ('{"stalenes": {}}', "plugin configuration has unknown section(s) 'stalenes'"),
    ],
)
def test_a_plugin_config_with_unknown_keys_names_plugin_config(config, says, tmp_path):
    (tmp_path / "plugins.json").write_text(config)
    result = rollout(tmp_path, "--plugin-config", str(tmp_path / "plugins.json"))
    assert result.returncode == 1
    assert_one_line(result, says, "fix --plugin-config")


def test_a_gateway_port_in_use_names_gateway_port(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        result = rollout(tmp_path, "--gateway-port", str(held.getsockname()[1]))
    assert result.returncode == 1
    assert_one_line(result, "the LLM gateway cannot listen on", "Address already in use", "give --gateway-port")


def test_a_tokenizer_that_does_not_load_names_tokenizer(tmp_path):
    """Found once the service loads it, after the LLM pool started: --log-level ERROR keeps the start-up's own
    notices out of stderr, and the failure is still one line."""
    result = rollout(tmp_path, "--log-level", "ERROR")  # the tokenizer's file is `{}`
    assert result.returncode == 1
    assert_one_line(result, f"tokenizer '{tmp_path / 'tok'}' cannot be loaded", "give --tokenizer")
