"""What a client gets wrong, sent to the real sandbox runtime in process: each mistake is answered with a 4xx
whose message names it, never a 5xx, and nothing of a refused sandbox stays behind (no folder, no process).

The runtime runs sandboxes with bubblewrap where it is installed (as root: each as a uid of its own), else with
the `local` backend; what only bwrap decides (images, a workdir inside the host's directories) is skipped without
it. A server run by an unprivileged user, and the Redis buffer against a real Redis, are in
integration_tests/test_bad_inputs.py.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sandbox_runtime.config import ServerConfig
from sandbox_runtime.files import FileAccessError, SandboxFiles
from sandbox_runtime.host_tree import empty_directory, remove_tree
from sandbox_runtime.manager import SandboxManager
from sandbox_runtime.metrics import Metrics
from sandbox_runtime.models import MIN_MEMORY_MB, MIN_OPEN_FILES, MIN_PIDS
from sandbox_runtime.server import RUNTIME_API, create_app

BWRAP = shutil.which("bwrap") is not None
BACKEND = "bwrap" if BWRAP else "local"
# A host directory the runtime shows its image-less sandboxes (--host-path): the one read-only place left there in
# which a workdir cannot be made. Not under /tmp, which a host path may not be.
HOST_PATH = Path("/var/tmp/prorl-test-bad-inputs-host-path")
NEEDS_BWRAP = pytest.mark.skipif(not BWRAP, reason="bubblewrap is not installed (apt-get install bubblewrap)")
MINIMUMS = {"memory_mb": MIN_MEMORY_MB, "pids": MIN_PIDS, "open_files": MIN_OPEN_FILES}
# A pipeline of coreutils, a command substitution, a subshell and a background job: what an agent's shell does.
ORDINARY = "ls / | wc -l >/dev/null; x=$(echo sub); (echo $x) | cat | cat; sleep 0 & wait; echo ok"


@dataclass
class Runtime:
    http: TestClient
    state: Path
    images: Path

    async def create(self, **spec) -> tuple[int, dict]:
        response = await self.http.post("/v1/sandboxes", json=spec)
        return response.status, await response.json()


@asynccontextmanager
async def runtime(token: str | None = None) -> AsyncIterator[Runtime]:
    """The real runtime in process, with an image directory of images that are no root filesystem. Its state
    and image dirs lie outside pytest's private temporary directories: a root server's sandbox uids must reach
    them."""
    base = Path(tempfile.mkdtemp(prefix="prorl-test-bad-inputs-"))
    base.chmod(0o711)
    state, images = base / "state", base / "images"
    (images / "empty").mkdir(parents=True)
    (images / "no-bash" / "bin").mkdir(parents=True)
    (images / "a-file").write_text("not a root filesystem")
    (images / "dangling").symlink_to(base / "nowhere")
    (images / "leaves").symlink_to("/usr")
    HOST_PATH.mkdir(mode=0o755, exist_ok=True)  # shown to image-less sandboxes read-only (--host-path)
    for directory in (images, images / "empty", images / "no-bash", images / "no-bash" / "bin"):
        directory.chmod(0o755)
    config = ServerConfig(
        state_dir=state,
        backend=BACKEND,
        allow_local=not BWRAP,
        image_dirs=[images],
        host_paths=[HOST_PATH],
        token=token,
        reap_interval_s=3600,
    )
    try:
        async with TestClient(TestServer(create_app(config))) as http:
            yield Runtime(http, state, images)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def refused(status: int, body: dict, expected: int, *words: str) -> None:
    assert (status, body.get("status")) == (expected, expected), body
    for word in words:
        assert word in body["error"], body["error"]


def processes_naming(path: Path) -> list[int]:
    """Processes whose command line names `path` (every launcher of a sandbox names its workspace)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


async def assert_nothing_left(rt: Runtime) -> None:
    listed = await (await rt.http.get("/v1/sandboxes")).json()
    assert listed["sandboxes"] == []
    assert list((rt.state / "sandboxes").iterdir()) == []
    assert processes_naming(rt.state) == []


# -- specs a sandbox cannot be made of ------------------------------------------------------------------------
def mistake(spec: dict, *words: str, bwrap: bool = False, name: str) -> object:
    return pytest.param(spec, words, id=name, marks=[NEEDS_BWRAP] if bwrap else [])


HUGE_ENV = {f"V{i}": "x" * 100_000 for i in range(11)}  # each under MAX_ARG_STRLEN, over 1 MiB in all
SPEC_MISTAKES = [
    *(
        mistake({"limits": {limit: value}}, f"limits.{limit}", str(minimum), name=f"{limit}={value}")
        for limit, minimum in {**MINIMUMS, "cpu_seconds": 0, "file_size_mb": 0, "disk_mb": 0}.items()
        for value in sorted({1 if minimum else -1, minimum - 1})
    ),
    mistake({"env": HUGE_ENV}, "bytes in all, over 1048576", name="env-too-large"),
    mistake({"env": {"ONE": "x" * (128 << 10)}}, "'ONE' is over 131072 bytes", name="env-entry-too-large"),
    mistake({"env": {"UID": "1"}}, "environment variable 'UID' is reserved", name="env-read-only"),
    mistake({"env": {"TMOUT": "1"}}, "environment variable 'TMOUT' is reserved", name="env-logout"),
    mistake({"workdir": "/workspace/\x00"}, "workdir", "control characters", name="workdir-nul"),
    mistake({"workdir": "/workspace\nx"}, "workdir", "control characters", name="workdir-newline"),
    mistake({"workdir": "/" + "a" * 256}, "workdir is too long", "255 bytes", name="workdir-name-too-long"),
    mistake({"workdir": "/a" * 600}, "workdir", "at most 1024", name="workdir-too-long"),
    mistake({"workdir": "//proc"}, "workdir '//proc' would hide a system directory", name="workdir-proc"),
    mistake({"workdir": "relative"}, "workdir must be an absolute path", name="workdir-relative"),
    mistake(
        {"workdir": f"{HOST_PATH}/no-such-directory"},
        f"workdir '{HOST_PATH}/no-such-directory' does not exist inside {HOST_PATH}",
        "/workspace",
        bwrap=True,
        name="workdir-in-read-only-host-path",
    ),
    mistake(
        {"image": "empty"}, "image 'empty' is neither a SIF file", "root directory", bwrap=True, name="image-empty"
    ),
    mistake({"image": "no-bash"}, "image 'no-bash'", "cannot start a shell", bwrap=True, name="image-no-bash"),
    mistake({"image": "a-file"}, "image 'a-file' is neither a SIF file", bwrap=True, name="image-file"),
    mistake({"image": "dangling"}, "no image named 'dangling'", bwrap=True, name="image-dangling-link"),
    mistake({"image": "leaves"}, "no image named 'leaves'", bwrap=True, name="image-link-out"),
    mistake({"image": "empty/deeper"}, "no image named 'empty/deeper'", bwrap=True, name="image-missing"),
]


@pytest.mark.parametrize(("spec", "words"), SPEC_MISTAKES)
async def test_a_spec_a_sandbox_cannot_be_made_of_is_refused_naming_what_to_fix(spec, words):
    async with runtime() as rt:
        status, body = await rt.create(**spec)
        refused(status, body, 400, *words)
        await assert_nothing_left(rt)


def test_the_minimums_are_in_the_openapi_document():
    limits = RUNTIME_API.document()["components"]["schemas"]["Limits"]["properties"]
    for name, minimum in MINIMUMS.items():
        [number] = [s for s in limits[name]["anyOf"] if s.get("type") == "integer"]
        assert number["minimum"] == minimum


async def test_a_sandbox_at_every_minimum_runs_ordinary_commands_in_sessions_and_runs():
    async with runtime() as rt:
        status, box = await rt.create(limits={**MINIMUMS, "cpu_seconds": 1, "file_size_mb": 1, "disk_mb": 1})
        assert status == 201, box
        for session in ("default", "second"):
            answer = await rt.http.post(
                f"/v1/sandboxes/{box['id']}/exec", json={"command": ORDINARY, "session": session}
            )
            result = await answer.json()
            assert (result["exit_code"], result["output"].splitlines()[-1]) == (0, "ok"), result
        answer = await rt.http.post(f"/v1/sandboxes/{box['id']}/run", json={"script": ORDINARY})
        result = await answer.json()
        assert (result["exit_code"], result["output"].splitlines()[-1]) == (0, "ok"), result
        assert (await rt.http.delete(f"/v1/sandboxes/{box['id']}")).status == 200
        await assert_nothing_left(rt)


@pytest.mark.parametrize("name", ["UID", "TMOUT"])
async def test_a_run_with_an_env_variable_the_shell_keeps_is_refused_naming_it(name):
    async with runtime() as rt:
        status, box = await rt.create()
        assert status == 201, box
        answer = await rt.http.post(f"/v1/sandboxes/{box['id']}/run", json={"script": "true", "env": {name: "1"}})
        refused(answer.status, await answer.json(), 400, f"environment variable {name!r} is reserved")


@NEEDS_BWRAP
async def test_a_workdir_that_is_a_whole_top_level_host_directory_replaces_it():
    async with runtime() as rt:
        status, box = await rt.create(workdir="/var")
        assert status == 201 and box["sessions"][0]["cwd"] == "/var", box


# -- sessions ---------------------------------------------------------------------------------------------
async def test_a_sandbox_whose_agent_locked_its_workdir_answers_409_until_it_is_wiped():
    async with runtime() as rt:
        status, box = await rt.create()
        assert status == 201, box
        sandbox = f"/v1/sandboxes/{box['id']}"
        locked = await rt.http.post(f"{sandbox}/exec", json={"command": "chmod 0 /workspace /tmp"})
        assert (await locked.json())["exit_code"] == 0
        answer = await rt.http.post(f"{sandbox}/exec", json={"command": "echo hi", "session": "new"})
        refused(answer.status, await answer.json(), 409, "no longer starts", "Permission denied", f"{sandbox}/wipe")
        # A root server reads and writes what its sandbox's uid locked; a server that is that uid cannot.
        written = await rt.http.put(f"{sandbox}/files", params={"path": "x"}, data=b"x")
        if os.geteuid() == 0:
            assert written.status == 201
        else:
            refused(written.status, await written.json(), 403, "'/workspace': permission denied")
        assert (await rt.http.post(f"{sandbox}/wipe")).status == 200
        answer = await rt.http.post(f"{sandbox}/exec", json={"command": "touch /tmp/t && echo hi", "session": "new"})
        assert (await answer.json())["output"] == "hi\n"
        assert (await rt.http.put(f"{sandbox}/files", params={"path": "x"}, data=b"x")).status == 201


@pytest.mark.parametrize("key", ["C-\u0130", "C-\uff5a", "C-1", "Hyper"])  # İ lowercases to two characters
async def test_an_unknown_key_is_refused_naming_it(key):
    async with runtime() as rt:
        status, box = await rt.create()
        assert status == 201, box
        answer = await rt.http.post(f"/v1/sandboxes/{box['id']}/sessions/default/input", json={"keys": [key]})
        refused(answer.status, await answer.json(), 400, f"unknown key {key!r}", "C-a..C-z")


# -- headers no browser or client should send -----------------------------------------------------------------
async def raw_request(rt: Runtime, head: bytes) -> tuple[int, dict]:
    """GET /v1/info with exactly these header bytes (aiohttp's own client would not send them)."""
    reader, writer = await asyncio.open_connection(rt.http.host, rt.http.port)
    writer.write(b"GET /v1/info HTTP/1.1\r\n" + head + b"Connection: close\r\n\r\n")
    await writer.drain()
    reply = await reader.read()
    writer.close()
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize(
    ("head", "words"),
    [
        (b"Host: \xff\xfe\r\n", ("Host", "not a loopback name")),
        (b"Host: [::1\r\n", ("Host '[::1'", "not a loopback name")),
        (b"Host: [zz]\r\n", ("Host '[zz]'", "not a loopback name")),
        (b"Host: 127.0.0.1\r\nOrigin: http://\xff\r\n", ("cross-origin request",)),
        (b"Host: 127.0.0.1\r\nOrigin: http://[::1\r\n", ("cross-origin request from 'http://[::1'",)),
        (b"Host: 127.0.0.1\r\nOrigin: http://[zz]\r\n", ("cross-origin request from 'http://[zz]'",)),
    ],
)
async def test_a_token_less_server_refuses_odd_host_and_origin_headers(head, words):
    async with runtime() as rt:
        status, body = await raw_request(rt, head)
        refused(status, body, 403, *words)


@pytest.mark.parametrize(
    "authorization", [b"Bearer \xff\xfe", b"\x80", b"Bearer secret\xff", "Bearer sécret".encode("latin-1")]
)
async def test_a_non_utf8_authorization_header_is_a_wrong_token(authorization):
    async with runtime(token="secret") as rt:
        status, body = await raw_request(rt, b"Host: 127.0.0.1\r\nAuthorization: " + authorization + b"\r\n")
        refused(status, body, 401, "bearer token")
        status, _ = await raw_request(rt, b"Host: [::1\r\nOrigin: http://\xff\r\nAuthorization: Bearer secret\r\n")
        assert status == 200  # with a token, the token is the gate


# -- the file API -----------------------------------------------------------------------------------------
def tar_of(*members: tarfile.TarInfo) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isreg() else None)
    return buffer.getvalue()


def member(name: str, size: int = 0, **fields) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    for key, value in fields.items():
        setattr(info, key, value)
    return info


def test_replacing_a_program_that_runs_is_a_conflict_naming_it(tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    files = SandboxFiles({"/workspace": workspace}, "/workspace")
    program = workspace / "prog"
    shutil.copy("/bin/sleep", program)
    running = subprocess.Popen([program, "60"])  # Popen returns once the program is executing
    try:
        for attempt in (
            lambda: files.write("prog", b"new"),
            lambda: files.unpack("/workspace", tar_of(member("prog", 1))),
        ):
            with pytest.raises(FileAccessError) as refusal:
                attempt()
            assert refusal.value.status == 409 and "'/workspace/prog' is a program running" in str(refusal.value)
    finally:
        running.kill()
        running.wait()


def test_an_archive_with_more_hard_links_than_the_filesystem_allows_is_refused(tmp_path, monkeypatch):
    """ext4 allows 65000 links to one file; an archive may hold more. The filesystem's refusal is simulated."""
    (tmp_path / "workspace").mkdir()
    files = SandboxFiles({"/workspace": tmp_path / "workspace"}, "/workspace")

    def too_many(*args, **kwargs):
        raise OSError(errno.EMLINK, os.strerror(errno.EMLINK))

    monkeypatch.setattr(os, "link", too_many)
    with pytest.raises(FileAccessError) as refusal:
        files.unpack("/workspace", tar_of(member("f", 1), member("g", type=tarfile.LNKTYPE, linkname="f")))
    assert refusal.value.status == 400 and "'/workspace/g': too many hard links" in str(refusal.value)


async def test_a_tree_deeper_than_python_recurses_is_wiped_and_deleted_with_its_sandbox():
    async with runtime() as rt:
        status, box = await rt.create()
        assert status == 201, box
        deep = "d/" * 1500 + "f"  # 1500 levels: shutil.rmtree would hit the recursion limit
        for then in ("wipe", "delete"):
            answer = await rt.http.put(f"/v1/sandboxes/{box['id']}/files", params={"path": deep}, data=b"x")
            assert answer.status == 201, await answer.text()
            if then == "wipe":
                assert (await rt.http.post(f"/v1/sandboxes/{box['id']}/wipe")).status == 200
                assert list((rt.state / "sandboxes" / box["id"] / "workspace").iterdir()) == []
        assert (await rt.http.delete(f"/v1/sandboxes/{box['id']}")).status == 200
        await assert_nothing_left(rt)


def make_deep_tree(top: Path, depth: int) -> None:
    """`depth` nested directories below `top`, made through directory fds (their path is longer than PATH_MAX),
    with a file in each tenth and the deepest one unreadable."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            if level % 10 == 0:
                os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.fchmod(fd, 0)
    finally:
        os.close(fd)


def test_removing_a_tree_deeper_than_path_max_follows_no_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("host data")
    top = tmp_path / "top"
    top.mkdir()
    make_deep_tree(top, 3000)
    (top / "link").symlink_to(outside)
    (top / "d" / "link").symlink_to(outside / "keep")
    empty_directory(top)
    assert list(top.iterdir()) == [] and (outside / "keep").read_text() == "host data"
    make_deep_tree(top, 3000)
    remove_tree(top)
    assert not top.exists() and (outside / "keep").read_text() == "host data"


async def test_a_restarted_server_reaps_a_leftover_tree_deeper_than_python_recurses(tmp_path):
    state = tmp_path / "state"
    leftover = state / "sandboxes" / "0123456789ab"
    (leftover / "workspace").mkdir(parents=True)
    make_deep_tree(leftover / "workspace", 3000)
    manager = SandboxManager(ServerConfig(state_dir=state, backend="local", allow_local=True), Metrics())
    assert await manager.reap_leftovers() == 1
    assert list((state / "sandboxes").iterdir()) == []


# -- the Redis buffer's entry ids (no Redis needed: they are refused before any call) ---------------------------
MALFORMED_IDS = [
    "garbage",
    "",
    "x" * 10000,
    "1-2-3",
    "1:1-2-3",
    "1:1-2\n",
    "1:\u0661-\u0661",  # Arabic-Indic digits: Python's \d takes them, Redis does not
    "1:18446744073709551616-0",  # past Redis's 64-bit stream id parts
    "1:0-18446744073709551616",
    "1_0:1-1",
    " 1:1-1",
    "9" * 5000 + ":1-1",  # more digits than int() converts
]


@pytest.mark.parametrize("entry_id", MALFORMED_IDS, ids=lambda i: repr(i)[:30])
async def test_a_malformed_entry_id_is_refused_by_the_redis_buffer_before_redis_is_asked(entry_id):
    pytest.importorskip("redis")
    from prorl_adapter.service.storage.buffer import MalformedEntryId
    from prorl_adapter.service.storage.redis_buffer import RedisBuffer

    buffer = RedisBuffer("redis://127.0.0.1:1/0")  # nothing listens there: no call may reach it
    try:
        for call in (buffer.ack, buffer.release):
            with pytest.raises(MalformedEntryId, match="not an entry id of this buffer") as refusal:
                await call(["1:1-1", entry_id])
            assert refusal.value.status == 400 and len(str(refusal.value)) < 200
    finally:
        await buffer.close()
