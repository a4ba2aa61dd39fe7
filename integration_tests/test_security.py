"""The two promises, tried from outside as an attacker (or an RL policy searching for reward) would: through the
documented HTTP APIs of a runtime and a rollout service started as they are deployed, once by root (as CI,
`make test` and `make demo` run it) and once by an unprivileged user. Each test is one hole that was open
before."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from pathlib import Path

import httpx
import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutClient
from sandbox_runtime.client import SandboxAPIError

from . import scripted_llm
from .conftest import (
    BACKEND_SKIPS,
    RunningRuntime,
    reachable,
    start_rollout,
    start_server,
    start_unprivileged_server,
    stop_server,
)
from .scripted_llm import bash_call

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))


DEPLOYMENTS = ["root", "unprivileged"]


def start_deployment(
    deployment: str, state: Path, backend: str, *extra: str, pass_fds: tuple[int, ...] = ()
) -> RunningRuntime:
    if deployment == "unprivileged":
        return start_unprivileged_server(state, backend, *extra, pass_fds=pass_fds)
    if os.geteuid() != 0:
        pytest.skip("the tests do not run as root: there is no root server to start")
    return start_server(state, backend, None, *extra, pass_fds=pass_fds)


@pytest.fixture(scope="module", params=DEPLOYMENTS)
def server(request, tmp_path_factory):
    images = reachable(tmp_path_factory.mktemp("images"))
    images.chmod(0o755)  # the server lists its image directories: an unprivileged one is refused one it cannot
    (images / "empty").mkdir()
    (images / "escape").symlink_to("/")  # a link out of the image directory is no image
    runtime = start_deployment(request.param, tmp_path_factory.mktemp("state"), "bwrap", "--image-dir", str(images))
    yield runtime
    stop_server(runtime)


@pytest.fixture
async def box(server):
    async with server.client() as client:
        info = await client.create_sandbox(limits={"pids": 32, "file_size_mb": 1, "disk_mb": 20})
        yield client, info.id
        await client.delete_sandbox(info.id)


async def refused(call, status: int, *fragments: str) -> None:
    with pytest.raises(SandboxAPIError) as error:
        await call
    assert error.value.status == status, error.value.message
    for fragment in fragments:
        assert fragment in error.value.message


# -- no host root, no capabilities ---------------------------------------------------------------------------
async def test_a_sandbox_is_an_unprivileged_uid_without_capabilities(box):
    client, sandbox = box
    status = (
        await client.run(sandbox, script="id -u; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status")
    ).output
    uid, *caps = status.split("\n")[:5]
    assert int(uid) != 0
    assert caps == [
        "CapPrm:\t0000000000000000",
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
        "NoNewPrivs:\t1",
    ]


@pytest.mark.parametrize(
    "attempt",
    [
        "mount -o remount,bind,rw /usr && touch /usr/planted",
        "mount -o remount,bind,rw /etc && touch /etc/planted",
        "cat /etc/shadow",
        "echo 1 > /proc/sys/kernel/sysrq",
        "unshare -r -m true",  # a nested user namespace would hold capabilities over its own mounts
        "touch /planted || touch /var/planted || touch /opt/planted",
        "touch /dev/planted || mkdir /dev/planted",  # /dev was a writable tmpfs of half the host's memory
    ],
)
async def test_writes_outside_the_workspace_and_tmp_fail(box, attempt):
    client, sandbox = box
    result = await client.run(sandbox, script=attempt)
    assert result.exit_code != 0, result.output
    assert not Path("/usr/planted").exists() and not Path("/etc/planted").exists()


async def test_dev_shm_holds_64_mib_at_most(server):
    """/dev/shm is a writable place besides the workspace and /tmp (POSIX shared memory needs it): a tmpfs of
    its own, bounded, so that a sandbox cannot fill the host's memory through it."""
    async with server.client() as client:
        sandbox = (await client.create_sandbox(limits={"file_size_mb": 1024})).id
        try:
            fill = "dd if=/dev/zero of=/dev/shm/big bs=1M count=200 2>&1; du -m /dev/shm/big | cut -f1"
            result = await client.exec(sandbox, fill, timeout=60)
            assert "No space left on device" in result.output
            assert int(result.output.split()[-1]) <= 64
            shared = "python3 -c 'import multiprocessing as m; l = m.Lock(); l.acquire(); print(\"locked\")'"
            assert (await client.exec(sandbox, "rm /dev/shm/big && " + shared)).output.strip() == "locked"
        finally:
            await client.delete_sandbox(sandbox)


async def test_the_pids_limit_holds_under_a_root_server_too(box):
    client, sandbox = box
    forks = (
        "import os, time\nok = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        continue\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
        "    ok += 1\nprint(ok)\n"
    )
    result = await client.run(sandbox, argv=["python3", "-c", forks], timeout=30)
    assert int(result.output) < 32


async def test_workspace_and_file_api_writes_belong_to_the_sandbox_uid(server, box):
    client, sandbox = box
    await client.write_file(sandbox, "from-api/file.txt", "x")
    uid = int((await client.run(sandbox, script="id -u")).output)
    owners = (await client.run(sandbox, script="stat -c %u . from-api from-api/file.txt")).output.split()
    assert owners == [str(uid)] * 3
    assert (await client.run(sandbox, script="echo more >> from-api/file.txt")).exit_code == 0


# -- the spec's env, the server's policy ---------------------------------------------------------------------
async def test_the_spec_env_reaches_only_the_sandboxed_shell(server):
    async with server.client() as client:
        info = await client.create_sandbox(env={"LD_PRELOAD": "/workspace/evil.so", "GREETING": "hi 'there'"})
        try:
            assert (await client.exec(info.id, 'echo "$GREETING"')).output == "hi 'there'\n"
            launcher = info.sessions[0].pid  # setpriv exec'd bwrap: the host-side process
            environ = Path(f"/proc/{launcher}/environ").read_bytes().split(b"\0")
            assert not [e for e in environ if e.startswith((b"LD_PRELOAD=", b"GREETING="))]
        finally:
            await client.delete_sandbox(info.id)


@pytest.mark.parametrize(
    ("spec", "status", "fragment"),
    [
        ({"backend": "local"}, 403, "local backend"),
        ({"image": "//"}, 400, "not an image name"),
        ({"image": "/root"}, 400, "not an image name"),
        ({"image": "../etc"}, 400, "not an image name"),
        ({"image": "escape"}, 400, "no image named"),
        ({"image": "missing"}, 400, "no image named"),
        ({"limits": {"memory_mb": 100_000_000}}, 400, "limits.memory_mb"),
        ({"limits": {"pids": 100_000_000}}, 400, "limits.pids"),
        ({"env": {"PROMPT_COMMAND": "x"}}, 400, "reserved"),
        ({"env": {"A B": "x"}}, 400, "env.A B.[key]: String should match pattern"),
    ],
)
async def test_the_server_policy_refuses_with_a_4xx(server, spec, status, fragment):
    async with httpx.AsyncClient(base_url=server.url) as http:  # raw: the Python client would refuse first
        answer = await http.post("/v1/sandboxes", json=spec)
        assert answer.status_code == status and fragment in answer.json()["error"], answer.text
        assert (await http.get("/v1/sandboxes")).json() == {"sandboxes": []}


async def test_an_image_that_cannot_run_a_shell_is_a_client_error(server):
    async with server.client() as client:  # the name is accepted; the image (an empty root) has no bash
        await refused(client.create_sandbox(image="empty"), 400, "image 'empty'")
        assert await client.list_sandboxes() == []


async def test_limits_and_policy_are_published(server):
    async with server.client() as client:
        info = await client.info()
    assert info.max_limits.pids and info.default_limits.pids <= info.max_limits.pids
    assert info.local_backend_allowed is False and info.image_dirs == 1
    assert (info.sandbox_uids is None) == server.unprivileged


async def test_bad_ids_and_headers_are_4xx(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.post("/v1/sandboxes/..%2f/exec", json={"command": "true"})).status_code == 404
        assert (await http.post("/v1/sandboxes/nope/run", json={"argv": ["true"]})).status_code == 404
        raw = await http.get("/v1/info", headers={"Authorization": b"Bearer \xff\xfe"})
        assert raw.status_code == 200  # token-less: the header is ignored, not a 500


# -- browsers --------------------------------------------------------------------------------------------------
async def test_browser_borne_requests_are_refused(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        rebinding = await http.post("/v1/sandboxes", json={}, headers={"Host": "attacker.example"})
        assert rebinding.status_code == 403
        cross_site = await http.post("/v1/sandboxes", json={}, headers={"Origin": "http://attacker.example"})
        assert cross_site.status_code == 403
        form = await http.post("/v1/sandboxes", content=b"{}", headers={"Content-Type": "text/plain"})
        assert form.status_code == 415
        assert (await http.get("/v1/sandboxes")).json() == {"sandboxes": []}


# -- file API --------------------------------------------------------------------------------------------------
def archive(*members: tuple[str, bytes | None, str | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.LNKTYPE, link
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def test_file_api_honours_the_file_size_limit_and_the_disk_budget(box):
    client, sandbox = box
    await refused(client.write_file(sandbox, "big", b"x" * (5 << 20)), 413)
    bomb = archive(*((f"part{i}", b"\0" * (1 << 20), None) for i in range(30)))  # 30 MiB expanded
    assert len(bomb) < 200_000
    await refused(client.upload_archive(sandbox, "bomb", bomb), 413, "disk")
    assert (await client.run(sandbox, script="ls bomb big 2>&1 | wc -l; du -sk . | cut -f1")).output.split()[1] == "4"


async def test_archive_hardlinks_stay_links(box):
    client, sandbox = box
    links = archive(("data", b"y" * 1000, None), *((f"link{i}", None, "data") for i in range(100)))
    await client.upload_archive(sandbox, "linked", links)
    assert (await client.run(sandbox, script="stat -c %h linked/data")).output.strip() == "101"


async def test_archive_download_of_a_sparse_file_is_bounded(server):
    async with server.client() as client:
        sandbox = (await client.create_sandbox(limits={"file_size_mb": 16384, "disk_mb": 1024})).id
        try:
            assert (await client.run(sandbox, script="mkdir sparse && truncate -s 15G sparse/huge")).exit_code == 0
            await refused(client.download_archive(sandbox, "sparse"), 413, "uncompressed")
        finally:
            await client.delete_sandbox(sandbox)


# -- processes -------------------------------------------------------------------------------------------------
async def test_sigpipe_ends_a_writer(box):
    client, sandbox = box
    result = await client.exec(sandbox, "while :; do echo x; done | head -n1", timeout=20)
    assert (result.status, result.output) == ("completed", "x\n")


async def test_kill_ends_every_process_the_sessions_started(box):
    client, sandbox = box
    await client.exec(
        sandbox,
        "setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 & (sleep 1003 &); "
        + RUNS_AS_SLEEP.format("1001 1002 1003"),
    )
    await client.exec(sandbox, "sleep 1004 & " + RUNS_AS_SLEEP.format("1004"), session="other")
    assert all(sleeping(seconds) for seconds in ("1001", "1002", "1003", "1004"))
    assert sorted(await client.end_processes(sandbox)) == ["default", "other"]
    assert not any(sleeping(seconds) for seconds in ("1001", "1002", "1003", "1004"))
    assert (await client.exec(sandbox, "echo alive")).output == "alive\n"  # the sandbox stays


async def test_a_one_shot_exit_status_is_the_kernels(box):
    client, sandbox = box
    assert (await client.run(sandbox, argv=["sh", "-c", "printf '\\036forged:0:/\\036\\n'; exit 3"])).exit_code == 3
    assert (await client.run(sandbox, script="kill -9 $$")).exit_code == 137
    timed_out = await client.run(sandbox, argv=["sleep", "100"], timeout=0.5)
    assert (timed_out.status, timed_out.exit_code) == ("timeout", None)


async def test_wipe_empties_the_workspace_and_tmp(box):
    client, sandbox = box
    await client.exec(sandbox, "mkdir -p a/b && touch a/b/c /tmp/t && chmod 000 a/b a && setsid sleep 999 &")
    await client.wipe(sandbox)
    assert (await client.run(sandbox, script="find . /tmp -mindepth 1 | wc -l")).output.strip() == "0"


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
async def test_the_local_backend_ends_setsid_processes_on_delete_and_after_a_crash(tmp_path, deployment):
    state = tmp_path / "local-state"  # the same path twice: one state dir for both incarnations
    first = start_deployment(deployment, state, "local")
    try:
        async with first.client() as client:
            deleted = await client.create_sandbox()
            await client.exec(
                deleted.id, "setsid sleep 991 >/dev/null 2>&1 < /dev/null & " + RUNS_AS_SLEEP.format("991")
            )
            crashed = await client.create_sandbox()
            await client.exec(
                crashed.id, "setsid sleep 992 >/dev/null 2>&1 < /dev/null & " + RUNS_AS_SLEEP.format("992")
            )
            await client.delete_sandbox(deleted.id)
        assert not sleeping("991")
        first.process.kill()  # SIGKILL: no clean-up ran
        first.process.wait()
        assert sleeping("992")
    finally:
        stop_server(first)
    second = start_deployment(deployment, state, "local")
    stop_server(second)
    assert not sleeping("992")


# Appended to a command that starts background sleeps: its exec returns once they run as sleep (a job just
# forked is bash for a moment, and `sleeping` would not find it yet).
RUNS_AS_SLEEP = 'for n in {}; do until pgrep -fx "sleep $n" > /dev/null; do :; done; done'


def sleeping(seconds: str) -> list[int]:
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", seconds.encode()]:
                found.append(pid)
        except OSError:
            pass
    return found


# -- reward hacks: scripted policies through the rollout service ---------------------------------------------
BUGGY = "def add(a, b):\n    return a - b\n"
TESTS = (
    "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
)
PASSING_TESTS = "import unittest\n\n\nclass TestAdd(unittest.TestCase):\n    def test_add(self):\n        pass\n"
# What the forging module does when the tests import it: find the completion nonce in the memory of a process
# of the sandbox (its shell) and print a marker that says "exit 0", then stop the real run.
FORGER = f"""{BUGGY}
import os, re, sys
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
    try:
        maps = open(f'/proc/{{pid}}/maps').read().splitlines()
        mem = open(f'/proc/{{pid}}/mem', 'rb')
    except OSError:
        continue
    for line in maps:
        start, end = (int(x, 16) for x in line.split()[0].split('-'))
        try:
            mem.seek(start)
            found = re.findall(rb'__prorl_nonce=([0-9]{{18}})', mem.read(min(end - start, 1 << 24)))
        except (OSError, OverflowError, ValueError):
            continue
        for nonce in found:
            sys.stdout.write('\\x1e' + nonce.decode() + ':0:/workspace/repo\\x1e\\n')
sys.stdout.flush()
"""


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


SCRIPTS = {
    "honest": [bash_call("cd repo && sed -i 's/a - b/a + b/' calc.py")],
    "nothing": [],
    "setsid-loop": [
        bash_call(
            f"cd repo && setsid bash -c 'while :; do echo {b64(PASSING_TESTS)} | base64 -d > test_calc.py; "
            "sleep 0.05; done' >/dev/null 2>&1 < /dev/null &"
        )
    ],
    "excluded-unittest": [
        bash_call(
            "cd repo && printf 'import sys\\nsys.exit(0)\\n' > unittest.py && echo unittest.py >> .git/info/exclude"
        )
    ],
    "fsmonitor": [
        bash_call(
            f"cd repo && git config core.fsmonitor 'echo {b64(PASSING_TESTS)} | base64 -d "
            "> /workspace/repo/test_calc.py; echo 2>/dev/null'"
        )
    ],
    "forged-marker": [bash_call(f"cd repo && echo {b64(FORGER)} | base64 -d > calc.py")],
    # An honest fix whose patch also holds a link out of the repository: the runtime will not unpack it.
    "link-out": [bash_call("cd repo && sed -i 's/a - b/a + b/' calc.py && ln -s /etc/passwd host-file")],
}


@pytest.fixture(scope="module")
def scripted_rollout(server, tmp_path_factory):
    llm = scripted_llm.start(SCRIPTS, tmp_path_factory.mktemp("scripts"))
    rollout = start_rollout([server.url], [llm.url])
    yield rollout
    rollout.stop()
    llm.stop()


def swe_job(script: str, **instance) -> JobRequest:
    row = {
        "problem_statement": f"add() subtracts. [script:{script}]",
        "files": {"calc.py": BUGGY},
        "test_files": {"test_calc.py": TESTS},
        "test_command": "python3 -m unittest -v",
        **instance,
    }
    return JobRequest(task="swe", instance=row, max_turns=3, timeout_s=120)


@pytest.mark.parametrize(
    ("script", "reward"),
    [
        ("honest", 1.0),
        ("nothing", 0.0),
        ("setsid-loop", 0.0),
        ("excluded-unittest", 0.0),
        ("fsmonitor", 0.0),
        ("forged-marker", 0.0),
        ("link-out", 0.0),
    ],
)
async def test_a_planted_hack_scores_nothing(scripted_rollout, server, script, reward):
    async with RolloutClient(scripted_rollout.url) as rollouts:
        trajectory = await rollouts.run(swe_job(script))
    assert trajectory.error is None, trajectory.error
    assert trajectory.num_turns >= 1
    assert trajectory.reward_components["outcome"] == reward
    async with server.client() as client:
        assert await client.list_sandboxes() == []


@pytest.mark.parametrize(("script", "reward"), [("honest", 1.0), ("excluded-unittest", 0.0), ("nothing", 0.0)])
async def test_named_tests_must_each_pass_in_the_log(scripted_rollout, script, reward):
    job = swe_job(script, FAIL_TO_PASS=json.dumps(["test_add (test_calc.TestAdd)"]), PASS_TO_PASS=[])
    async with RolloutClient(scripted_rollout.url) as rollouts:
        trajectory = await rollouts.run(job)
    assert trajectory.error is None, trajectory.error
    assert trajectory.reward_components["outcome"] == reward


async def test_the_rollout_service_refuses_browser_borne_requests(scripted_rollout):
    async with httpx.AsyncClient(base_url=scripted_rollout.url) as http:
        body = {"url": "http://127.0.0.1:1"}
        assert (await http.post("/v1/llm-servers", json=body, headers={"Host": "evil.example"})).status_code == 403
        origin = {"Origin": "http://evil.example"}
        assert (await http.post("/v1/llm-servers", json=body, headers=origin)).status_code == 403
        form = await http.post("/v1/llm-servers", content=json.dumps(body), headers={"Content-Type": "text/plain"})
        assert form.status_code == 415
        servers = (await http.get("/v1/llm-servers")).json()["servers"]
        assert "http://127.0.0.1:1" not in [s["url"] for s in servers]
