"""What a client gets wrong, against real servers: the sandbox runtime run by root (each sandbox a uid of its own)
and by an unprivileged user, and the rollout service's Redis buffer against a real Redis. Every mistake is a 4xx
whose message names it; nothing of a refused or deleted sandbox stays behind. The in-process counterparts (and
most cases) are in tests/test_bad_inputs.py."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import httpx
import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import free_port
from prorl_adapter.trainer.samples import trajectory_from_tensors
from tests.test_bad_inputs import HOST_PATH, MINIMUMS, ORDINARY, SPEC_MISTAKES, processes_naming

from .conftest import BACKEND_SKIPS, RunningRuntime, start_server, start_unprivileged_server, stop_server
from .redis_server import REDIS_SKIP, RedisServer

# A tree deeper than Python's recursion limit, and corners the agent locked: unreadable, unwritable, and not
# traversable with something inside (their owner may unlock them: an unprivileged server owns its sandboxes' files).
DEEP_AND_LOCKED = (
    "mkdir -p $(printf 'd/%.0s' {1..1500}) locked/in half/sub && touch half/f"
    " && chmod 0 locked/in && chmod 500 locked && chmod 600 half"
)


def assert_nothing_left(server: RunningRuntime) -> None:
    assert httpx.get(f"{server.url}/v1/sandboxes").json()["sandboxes"] == []
    assert list((server.state_dir / "sandboxes").iterdir()) == []
    assert set(processes_naming(server.state_dir)) == {server.process.pid}  # the server itself: --state-dir


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def server(request, tmp_path_factory) -> Iterator[RunningRuntime]:
    """The runtime with bwrap, run by root (as CI runs it) and by an unprivileged user (nobody, under root)."""
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    state = tmp_path_factory.mktemp(f"state-{request.param}")
    HOST_PATH.mkdir(mode=0o755, exist_ok=True)  # a host path the sandboxes see read-only (SPEC_MISTAKES)
    shown = ("--host-path", str(HOST_PATH))
    unprivileged = request.param == "unprivileged"
    started = (
        start_unprivileged_server(state, "bwrap", *shown)
        if unprivileged
        else start_server(state, "bwrap", None, *shown)
    )
    yield started
    stop_server(started)


async def test_a_sandbox_at_every_minimum_runs_ordinary_commands(server):
    async with server.client() as client:
        box = await client.create_sandbox(limits={**MINIMUMS, "cpu_seconds": 1, "file_size_mb": 1})
        for session in ("default", "second"):
            result = await client.exec(box.id, ORDINARY, session=session, timeout=30)
            assert (result.exit_code, result.output.splitlines()[-1]) == (0, "ok"), result
        run = await client.run(box.id, script=ORDINARY, timeout=30)
        assert (run.exit_code, run.output.splitlines()[-1]) == (0, "ok"), run
        await client.delete_sandbox(box.id)
    assert_nothing_left(server)


# What the in-process tests refuse, but for images (these servers have no image directory).
@pytest.mark.parametrize(("spec", "words"), [case for case in SPEC_MISTAKES if "image" not in case.values[0]])
def test_a_spec_a_shell_cannot_start_with_is_a_400_naming_the_field(server, spec, words):
    answer = httpx.post(f"{server.url}/v1/sandboxes", json=spec, timeout=60)
    assert answer.status_code == 400, answer.text
    for word in words:
        assert word in answer.json()["error"]
    assert_nothing_left(server)


async def test_a_sandbox_whose_agent_deepened_and_locked_its_tree_is_wiped_and_deleted(server):
    async with server.client() as client:
        box = await client.create_sandbox()
        for _ in range(2):
            assert (await client.exec(box.id, DEEP_AND_LOCKED, timeout=60)).exit_code == 0
            await client.wipe(box.id)
            assert (await client.exec(box.id, "ls -A | wc -l", timeout=30)).output == "0\n"
        assert (await client.exec(box.id, DEEP_AND_LOCKED, timeout=60)).exit_code == 0
        await client.delete_sandbox(box.id)
    assert_nothing_left(server)


async def test_a_sandbox_whose_agent_locked_its_workdir_answers_409_until_it_is_wiped(server):
    async with server.client() as client:
        box = await client.create_sandbox()
        assert (await client.exec(box.id, "mkdir -p a/b && chmod 0 a /workspace /tmp")).exit_code == 0
        answer = httpx.post(f"{server.url}/v1/sandboxes/{box.id}/exec", json={"command": "true", "session": "new"})
        assert answer.status_code == 409 and "wipe" in answer.json()["error"], answer.text
        # A root server writes what its sandbox's uid locked; a server that is that uid cannot.
        written = httpx.put(f"{server.url}/v1/sandboxes/{box.id}/files", params={"path": "x"}, content=b"x")
        if server.unprivileged:
            assert written.status_code == 403 and "'/workspace': permission denied" in written.json()["error"]
        else:
            assert written.status_code == 201
        await client.wipe(box.id)
        assert (await client.exec(box.id, "touch /tmp/t && echo hi", session="new")).output == "hi\n"
        assert await client.write_file(box.id, "x", b"x") == 1
        await client.delete_sandbox(box.id)
    assert_nothing_left(server)


async def test_a_server_killed_with_a_deep_tree_in_a_sandbox_restarts_and_reaps_it(tmp_path):
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    first = start_server(tmp_path / "state", "bwrap")
    async with first.client() as client:
        box = await client.create_sandbox()
        assert (await client.exec(box.id, DEEP_AND_LOCKED, timeout=60)).exit_code == 0
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_server(tmp_path / "state", "bwrap")  # it used to die reaping the tree (RecursionError)
    try:
        assert_nothing_left(second)
    finally:
        stop_server(second)


# -- the Redis buffer --------------------------------------------------------------------------------------
MALFORMED_IDS = ["garbage", "", "x" * 10000, "1-2-3", "1:1-2\n", "1:\u0661-\u0661", "1:18446744073709551616-0"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    if REDIS_SKIP:
        pytest.skip(REDIS_SKIP)
    pytest.importorskip("redis", reason="the redis Python package is missing (pip install 'prorl-adapter[redis]')")
    started = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield started
    started.kill()


async def test_a_malformed_id_of_an_existing_version_is_refused_and_nothing_is_acknowledged(redis_server):
    """Ids of version 1 reach Redis only if the stream of version 1 exists: Redis refused them with an error."""
    from prorl_adapter.service.storage.buffer import MalformedEntryId
    from prorl_adapter.service.storage.redis_buffer import RedisBuffer

    async with RedisBuffer(redis_server.url, prefix=f"test:{uuid.uuid4().hex[:8]}") as buffer:
        entry_id = await buffer.put(trajectory_from_tensors([1], [2], [1], [-0.5], 1, 1, job_id="j", task="t"))
        for entry_id_sent in MALFORMED_IDS:
            for call in (buffer.ack, buffer.release):
                with pytest.raises(MalformedEntryId, match="not an entry id of this buffer"):
                    await call([entry_id_sent])
        [item] = await buffer.take(1, timeout=0)
        assert item.id == entry_id and item.deliveries == 1
        assert await buffer.ack([entry_id]) == 1


def test_the_service_answers_every_malformed_ack_id_with_a_400_and_ignores_unknown_logprob_keys(redis_server):
    localstack.build_tiny_model()
    dead = f"http://127.0.0.1:{free_port()}"  # no LLM or sandbox is needed to acknowledge
    prefix = f"--buffer={redis_server.url.rsplit('/', 1)[0]}/5"
    rollout = localstack.start_rollout_service([dead], [dead], prefix)
    try:
        with httpx.Client(base_url=rollout.url, timeout=30) as http:
            for entry_id in MALFORMED_IDS:
                answer = http.post("/v1/batches/ack", json={"ids": ["0:1-1", entry_id]})
                assert answer.status_code == 400, answer.text
                assert "not an entry id of this buffer" in answer.json()["error"]
            logprobs = {entry_id: [0.0] for entry_id in MALFORMED_IDS}
            answer = http.post("/v1/batches", json={"size": 1, "timeout_s": 0, "current_logprobs": logprobs})
            assert answer.status_code == 200 and answer.json()["items"] == []
    finally:
        rollout.stop()
