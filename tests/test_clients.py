"""The two Python clients against the real servers: every public method of `RolloutClient` (on the in-process
service, `rollout_stack`) and of `SandboxClient` (on the real runtime, `sandbox_runtime.server.create_app`) is
called once, so each request body and query it builds from a wire model is one the server's model accepts
(otherwise the call would raise a 400), and each reply comes back as its wire model.

The runtime runs sandboxes with bubblewrap where it is installed, else with the `local` backend: what is tested
here is the wire, not the isolation (integration_tests/ covers that)."""

from __future__ import annotations

import asyncio
import inspect
import io
import shutil
import tarfile
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from prorl_adapter.models import (
    Batch,
    BreakerState,
    BufferStatus,
    JobState,
    JobStatus,
    LLMServerInfo,
    PluginInfo,
    PluginList,
    ServiceHealth,
    ServiceStatus,
    TrajectoriesImported,
    Trajectory,
    WeightUpdateState,
)
from prorl_adapter.trainer.client import RolloutClient, SyncRolloutClient
from sandbox_runtime.client import SandboxClient
from sandbox_runtime.config import ServerConfig
from sandbox_runtime.models import (
    ExecResult,
    RunResult,
    SandboxDeleted,
    SandboxInfo,
    SandboxWiped,
    ServerInfo,
    SessionDeleted,
)
from sandbox_runtime.server import create_app
from tests.fakes import HANG, ScriptedLLM, bash_call, finish_call, on_virtual_time, rollout_stack, shell_job


class Calls:
    """A client that records the names of the methods called on it."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.names: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.names.add(name)
        return getattr(self._client, name)


def operations(client_class: type) -> set[str]:
    """The client's public coroutine methods: one per operation of the API (closing the client aside)."""
    methods = inspect.getmembers(client_class, inspect.iscoroutinefunction)
    return {name for name, _ in methods if not name.startswith("_")} - {"aclose"}


# -- the rollout service ----------------------------------------------------------------------------------
@on_virtual_time
async def test_every_rollout_client_method_speaks_the_service_models():
    staleness = {"mode": "linear", "max_staleness": 4}
    script = [bash_call("echo hi"), finish_call("42")]
    async with rollout_stack(script=script, plugin_config={"staleness": staleness}) as stack, ScriptedLLM() as other:
        client = Calls(stack.client)

        health = await client.health()
        assert isinstance(health, ServiceHealth) and health.ok and health.degraded is None
        assert "shell" in await client.tasks()
        plugins = await client.plugins()
        assert isinstance(plugins, PluginList) and all(isinstance(p, PluginInfo) for p in plugins.plugins)
        assert plugins.config["staleness"] == staleness  # what verl's agent loop compares its block with
        assert await client.set_policy_version(2) == 2

        # jobs
        trajectory = await client.run(shell_job(), wait=600)
        assert isinstance(trajectory, Trajectory) and trajectory.reward == 1.0 and trajectory.policy_version_min == 2
        [again] = await client.run_many([shell_job()], wait=600)
        assert isinstance(again, Trajectory) and again.error is None
        group = await client.run_samples(shell_job(job_id="g", num_samples=2), wait=600)
        assert [t.job_id for t in group] == ["g.0", "g.1"] and {t.group for t in group} == {"g"}
        job = await client.submit(shell_job(job_id="by-hand"))
        assert isinstance(job, JobStatus) and job.job_id == "by-hand"
        assert (await client.result(job.job_id, wait=600)).job_id == "by-hand"
        assert (await client.job(job.job_id)).state == JobState.done
        stack.llm.cue(HANG)
        held = await client.submit(shell_job(job_id="held"))
        await stack.llm.until(lambda: stack.llm.held == 1)
        with pytest.raises(TimeoutError, match="it is running"):  # the 202 of each round is a JobStatus
            await client.result(held.job_id, wait=5)
        assert (await client.cancel(held.job_id)).state == JobState.cancelled
        stack.llm.release()

        status = await client.status()
        assert isinstance(status, ServiceStatus) and status.policy_version == 2 and status.finished["done"] == 5
        assert [server.url for server in status.llm_servers] == [stack.llm.url]

        # LLM servers
        added = await client.add_llm_server(other.url)
        assert isinstance(added, LLMServerInfo) and added.url == other.url and added.healthy
        servers = await client.llm_servers()
        assert all(isinstance(s, LLMServerInfo) for s in servers)
        assert [s.url for s in servers] == [stack.llm.url, other.url]
        assert await client.remove_llm_server(other.url) is True
        assert await client.remove_llm_server(other.url) is False  # gone already: not an error
        replaced = await client.set_llm_servers([stack.llm.url])
        assert [(s.url, s.healthy) for s in replaced] == [(stack.llm.url, True)]

        # decoupled mode
        assert await client.enqueue_prompts([shell_job(job_id="prompt")]) == 1
        batch = await client.take_batch(1, timeout=600, lease_s=60)
        assert isinstance(batch, Batch) and [item.trajectory.job_id for item in batch.items] == ["prompt"]
        buffer = await client.buffer()
        assert isinstance(buffer, BufferStatus) and (buffer.pending, buffer.produced, buffer.leased) == (1, 1, 1)
        assert await client.ack([item.id for item in batch.items]) == 1
        buffer = await client.buffer()
        assert (buffer.pending, buffer.acked, buffer.buffer_expired, buffer.expired) == (0, 1, 0, 0)
        replay = batch.items[0].trajectory
        item = {k: getattr(replay, k) for k in ("prompt_ids", "response_ids", "response_mask", "response_logprobs")}
        imported = await client.import_trajectories([{**item, "reward": 1.0, "policy_version": 0}])
        assert isinstance(imported, TrajectoriesImported) and imported.imported == 1
        assert (await client.buffer()).imported == 1
        assert isinstance(await client.reset_breaker(), BreakerState)

        # weight updates
        paused = await client.pause_generation("drain", timeout_s=60)
        assert isinstance(paused, WeightUpdateState) and paused.paused and paused.mode == "drain"
        assert (await client.weight_update_state()).barrier == paused.barrier
        resumed = await client.resume_generation(version=3)
        assert isinstance(resumed, WeightUpdateState) and not resumed.paused and resumed.policy_version == 3

    assert client.names >= operations(RolloutClient), "a client method this test does not call"


@on_virtual_time
async def test_the_sync_client_answers_with_the_same_models():
    async with rollout_stack() as stack:

        def read() -> tuple[ServiceStatus, list[LLMServerInfo]]:
            with SyncRolloutClient(stack.url) as client:
                return client.status(), client.llm_servers()

        status, servers = await asyncio.to_thread(read)  # its own event loop, in a thread of its own
    assert isinstance(status, ServiceStatus) and status.policy_version == 0
    assert [server.url for server in servers] == [stack.llm.url]


# -- the sandbox runtime ----------------------------------------------------------------------------------
@asynccontextmanager
async def sandbox_runtime() -> AsyncIterator[SandboxClient]:
    """The real runtime in process. Its state dir lies outside pytest's private temporary directories: under
    a root server each sandbox runs as a uid of its own, which must traverse to its workspace."""
    state = Path(tempfile.mkdtemp(prefix="prorl-test-clients-"))
    state.chmod(0o711)
    backend = "bwrap" if shutil.which("bwrap") else "local"
    config = ServerConfig(state_dir=state, backend=backend, allow_local=backend == "local")
    try:
        async with (
            TestServer(create_app(config)) as server,
            SandboxClient(str(server.make_url("")).rstrip("/")) as client,
        ):
            yield client
    finally:
        shutil.rmtree(state, ignore_errors=True)


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


async def test_every_sandbox_client_method_speaks_the_runtime_models():
    async with sandbox_runtime() as sandboxes:
        client = Calls(sandboxes)
        assert await client.health() is True
        assert await client.healthy(5.0) is True
        info = await client.info()
        assert isinstance(info, ServerInfo) and info.sandboxes == 0
        assert (await client.list_images()).images == []  # no --image-dir

        box = await client.create_sandbox(labels={"test": "clients"}, limits={"memory_mb": 1024})
        assert isinstance(box, SandboxInfo) and box.labels == {"test": "clients"} and box.limits.memory_mb == 1024
        assert [b.id for b in await client.list_sandboxes()] == [box.id]
        assert (await client.get_sandbox(box.id)).id == box.id

        # commands and sessions
        result = await client.exec(box.id, "echo hi", timeout=30, max_output_bytes=1024)
        assert isinstance(result, ExecResult) and (result.output, result.exit_code) == ("hi\n", 0)
        asked = await client.exec(box.id, "read line; echo got $line", timeout=0.5, session="s", on_timeout="keep")
        assert asked.status == "timeout"
        answered = await client.send_input(box.id, "s", text="yes\n", timeout=10)
        assert isinstance(answered, ExecResult) and "got yes" in answered.output
        assert isinstance(await client.read_output(box.id, "s"), ExecResult)
        ended = await client.delete_session(box.id, "s")
        assert isinstance(ended, SessionDeleted) and ended.session == "s"
        run = await client.run(box.id, argv=["sh", "-c", "exit 3"], env={"A": "1"}, timeout=30)
        assert isinstance(run, RunResult) and run.exit_code == 3

        # files
        assert await client.write_file(box.id, "dir/a.txt", "hello") == 5
        assert await client.read_file(box.id, "dir/a.txt") == b"hello"
        assert await client.upload_archive(box.id, "unpacked", tar_of({"b.txt": b"bee"})) == 1
        with tarfile.open(fileobj=io.BytesIO(await client.download_archive(box.id, "unpacked"))) as tar:
            assert "b.txt" in [name.removeprefix("./") for name in tar.getnames()]

        # ending things
        assert await client.end_processes(box.id) == ["default"]
        wiped = await client.wipe(box.id)
        assert isinstance(wiped, SandboxWiped) and wiped.id == box.id
        deleted = await client.delete_sandbox(box.id)
        assert isinstance(deleted, SandboxDeleted) and not deleted.already_deleted
        assert (await client.delete_sandbox(box.id)).already_deleted  # idempotent
        assert await client.list_sandboxes() == []

    assert client.names >= operations(SandboxClient), "a client method this test does not call"
