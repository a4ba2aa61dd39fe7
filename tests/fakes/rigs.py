"""The one place where unit tests build the service and its parts on the stand-ins, so that a change of a
constructor is a change here.

`rollout_stack`: the whole service, driven through its HTTP API.

    async with rollout_stack(script=[bash_call("ls"), finish_call("42")]) as stack:
        trajectory = await stack.client.run(shell_job())

The service is the real one (`create_app`: the pipeline, the pools, the producer, the plugins installed as entry
points), with a `ScriptedLLM` as its one LLM server, a `SandboxStandIn` as its one sandbox runtime and `CharChat`
as its tokenizer. `stack.http` is aiohttp's test client (raw status codes and bodies), `stack.client` the
project's own `RolloutClient`.

`episode_rig`: the agent loop alone (`run_episode`) with a real `LLMPool` and a real sandbox `Environment` on the
stand-ins. `llm_pool`: an `LLMPool` over some `ScriptedLLM`s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from prorl_adapter.models import JobRequest
from prorl_adapter.service.agent import Episode, run_episode
from prorl_adapter.service.circuit_breaker import BreakerConfig
from prorl_adapter.service.config import RolloutConfig
from prorl_adapter.service.decoupled import ProducerConfig
from prorl_adapter.service.llm import OUTAGE_WAIT_S, LLMPool
from prorl_adapter.service.pipeline import PipelineConfig
from prorl_adapter.service.server import GATEWAY_APP, create_app
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.service.weight_barrier import WeightBarrier
from prorl_adapter.tasks import Environment, TaskHandler
from prorl_adapter.trainer.client import RolloutClient
from sandbox_runtime.client import SandboxClient

from .chat import CharChat
from .llm import Answer, ScriptedLLM
from .sandbox import SandboxStandIn

CHECK = "test -f /workspace/goal-reached"  # the shell task's check: passes unless exit_codes says otherwise


@dataclass
class Stack:
    llm: ScriptedLLM
    sandboxes: list[SandboxStandIn]
    chat: CharChat
    app: web.Application
    http: TestClient
    client: RolloutClient
    url: str
    gateway: TestClient  # the LLM gateway's own application, on its own port

    @property
    def sandbox(self) -> SandboxStandIn:
        return self.sandboxes[0]


@asynccontextmanager
async def rollout_stack(
    script: list[Answer] | None = None,
    scripts: dict[str, list[Answer]] | None = None,
    *,
    token: str | None = None,
    plugin_config: dict[str, Any] | None = None,
    decoupled: dict[str, Any] | None = None,
    pipeline: dict[str, Any] | None = None,
    llm_health_interval_s: float = 3600.0,
    llm_outage_wait_s: float = OUTAGE_WAIT_S,
    llm_stream: bool = False,
    sandbox_runtimes: int = 1,
    plugins: tuple[str, ...] = (),
    record_dir: Path | None = None,
    breaker: dict[str, Any] | None = None,
    chat: Any = None,
) -> AsyncIterator[Stack]:
    """The service with stand-ins around it. `chat`: a real ChatTokenizer for the service and the LLM stand-in
    alike (default: the CharChat stand-in)."""
    workers = {"max_init_workers": 4, "max_run_workers": 8, "max_eval_workers": 4}
    async with AsyncExitStack() as started:
        llm = await started.enter_async_context(ScriptedLLM(script, scripts))
        llm.chat = chat or llm.chat
        sandboxes = [await started.enter_async_context(SandboxStandIn()) for _ in range(sandbox_runtimes)]
        config = RolloutConfig(
            sandbox_urls=[sandbox.url for sandbox in sandboxes],
            llm_urls=[llm.url],
            tokenizer="(the CharChat stand-in)",
            token=token,
            plugins=list(plugins),
            plugin_config=dict(plugin_config or {}),
            decoupled=ProducerConfig(**(decoupled or {})),
            pipeline=PipelineConfig(**{**workers, **(pipeline or {})}),
            llm_health_interval_s=llm_health_interval_s,
            llm_outage_wait_s=llm_outage_wait_s,
            llm_stream=llm_stream,
            service_id="unit-tests",
            record_dir=record_dir,
            breaker=BreakerConfig(**(breaker or {})),
        )
        chat = llm.chat
        app = create_app(config, chat=chat)  # type: ignore[arg-type]  # a stand-in for ChatTokenizer
        async with TestClient(TestServer(app)) as http, TestClient(TestServer(app[GATEWAY_APP])) as gateway:
            url = str(http.make_url("")).rstrip("/")
            async with RolloutClient(url, token=token) as client:
                yield Stack(llm, sandboxes, chat, app, http, client, url, gateway)


def shell_job(script: str | None = None, **fields: Any) -> JobRequest:
    """A job of the built-in `shell` task whose prompt names the LLM stand-in's script `script`."""
    goal = f"[script:{script}] reach the goal" if script else "reach the goal"
    return JobRequest(task="shell", instance={"goal": goal, "check": CHECK, **fields.pop("instance", {})}, **fields)


@asynccontextmanager
async def llm_pool(servers: list[ScriptedLLM], **options: Any) -> AsyncIterator[LLMPool]:
    """A started `LLMPool` over the stand-ins (no background health checks unless `health_interval` says)."""
    pool = LLMPool([server.url for server in servers], **{"health_interval": 3600.0, **options})
    await pool.start()
    try:
        yield pool
    finally:
        try:
            await pool.close()
        finally:  # a close that failed (a test of a bug) must not leak the session into the next tests
            if pool._http is not None and not pool._http.closed:
                await pool._http.close()


@asynccontextmanager
async def scripted_llms(count: int, script: list[Answer] | None = None) -> AsyncIterator[list[ScriptedLLM]]:
    async with AsyncExitStack() as started:
        yield [await started.enter_async_context(ScriptedLLM(script)) for _ in range(count)]


@dataclass
class EpisodeRig:
    llm: ScriptedLLM
    sandbox: SandboxStandIn
    chat: CharChat
    pool: LLMPool
    env: Environment

    async def run(self, request: JobRequest, handler: TaskHandler, barrier: WeightBarrier | None = None) -> Episode:
        """The episode, through `barrier` (by default one of its own, at version 0, never held)."""
        barrier = barrier or WeightBarrier(MemoryCoordination("rig"), self.pool)
        return await run_episode(request, handler, self.env, self.chat, self.pool, barrier)  # type: ignore[arg-type]


@asynccontextmanager
async def episode_rig(script: list[Answer] | None = None) -> AsyncIterator[EpisodeRig]:
    """One sandbox on the sandbox stand-in, the LLM stand-in behind an `LLMPool`: what `run_episode` needs."""
    async with ScriptedLLM(script) as llm, SandboxStandIn() as sandbox, llm_pool([llm]) as pool:
        client = SandboxClient(sandbox.url)
        try:
            info = await client.create_sandbox()
            yield EpisodeRig(llm, sandbox, CharChat(), pool, Environment(client, info.id, sandbox.url, info.workdir))
        finally:
            await client.aclose()
