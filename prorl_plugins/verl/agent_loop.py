"""`prorl_agent`: verl's agent loop for one dataset row, run as an episode by the rollout service.

verl calls `run()` once per sample (GRPO: n times per row). The loop hands its sample to the rollout driver
(`RolloutDriver.generate`), which calls the verl backend hooks (backend.py: the trainer's step as the policy
version, the row as a job, the trajectory as verl's `AgentLoopOutput`), runs the job on the service and waits
for it. What only a verl agent loop does stays here:

- verl's vLLM replicas (their HTTP addresses, from the LLM server client's load balancer) become the service's
  LLM servers, so the service generates with the weights verl keeps in sync;
- at its first contact with the service, a worker compares the plugin sections the service was started with
  (`GET /v1/plugins`) with the `prorl` block (`check_service`): staleness is stated once, in the block;
- the prompt is left-truncated to verl's prompt_length, as verl's own loops do;
- with `prorl.launch=ray`, the workers start the rollout stack on verl's own Ray cluster, once per run: the
  first worker to create the stack's record actor starts it, the others wait for it, and each worker then uses
  one replica (`prorl_adapter.launch.ray_stack`). The stack ends with the worker that started it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import logging
import os
import weakref
import zlib
from typing import Any

import httpx
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient
from prorl_adapter.trainer.driver import RolloutDriver

from .backend import EpisodeFailed, VerlBackend, VerlSample, row_task_and_instance
from .config import (
    AGENT_LOOP_NAME,
    BLOCK,
    ProrlVerlConfig,
    ProrlVerlConfigError,
    check_service,
    check_verl_config,
    plugin_set,
)

logger = logging.getLogger(__name__)


# -- per-process state: one client per service and event loop; what was registered and checked there -----
# Nothing is keyed by id(): an id is reused once its object is collected, and would hand back the state of
# another block, or a client bound to a closed event loop. Blocks are keyed by value (`block_key`), event
# loops by the loop itself, weakly: an entry never meets another loop, and goes with its loop where nothing
# else holds it (a pending launch's future does, for as long as the worker lives).
def block_key(prorl: ProrlVerlConfig) -> str:
    """A block by value: its fields' reprs (a frozen dataclass whose dict fields keep it from hashing)."""
    return repr(prorl)


class _ServiceSession:
    def __init__(self, prorl: ProrlVerlConfig) -> None:
        self.url = prorl.service_url
        self.client = RolloutClient(prorl.service_url, token=prorl.token)
        self.registered: set[str] = set()
        self.checked: set[str] = set()  # the blocks already compared with the service's sections
        self.drivers: dict[str, RolloutDriver] = {}
        self.answered = False  # whether the service has answered this process yet
        self.lock = asyncio.Lock()

    async def call(self, what: str, coroutine):
        try:
            result = await coroutine
        except httpx.TransportError as exc:
            if self.answered:  # it worked before: a failure of the service, not of the config
                raise EpisodeFailed(
                    f"the rollout service at {self.url} stopped answering ({what}): {type(exc).__name__}: {exc}"
                ) from exc
            raise ProrlVerlConfigError(
                f"the rollout service at {self.url} ({BLOCK}.service_url) does not answer ({what}): "
                f"{type(exc).__name__}: {exc}; start it (`prorl-rollout serve --sandbox-url ...`) or fix the URL"
            ) from exc
        self.answered = True
        return result

    async def check_sections(self, prorl: ProrlVerlConfig) -> None:
        """The service's plugin sections must not contradict the block (once per block and process)."""
        async with self.lock:
            if block_key(prorl) in self.checked:
                return
            plugins = await self.call("reading its plugin configuration", self.client.plugins())
            check_service(prorl, None, plugins.config)
            self.checked.add(block_key(prorl))

    async def register_llm_servers(self, urls: list[str]) -> None:
        """Make verl's replicas the service's only LLM servers: any other one (the `--llm-url` the service
        was started with) serves weights verl never updates, and its turns would be tagged as current."""
        async with self.lock:
            if set(urls) <= self.registered:
                return
            # One idempotent call: workers of one trainer each set the same set, in any order, without a race.
            await self.call("setting the LLM servers", self.client.set_llm_servers(urls))
            logger.info("the LLM servers of the rollout service %s are now verl's: %s", self.url, ", ".join(urls))
            self.registered.update(urls)

    def driver(self, prorl: ProrlVerlConfig) -> RolloutDriver:
        """The driver for this block. Its plugins are the installed ones without sections, plus the verl
        backend: staleness is weighed by verl's sampler when a batch is sampled, not here (at generation time
        a trajectory may already be newer than its row's step, which other workers' rows have published)."""
        key = block_key(prorl)
        if key not in self.drivers:
            self.drivers[key] = RolloutDriver(
                self.client,
                plugin_set({}, objects=[VerlBackend(prorl)]),
                wait_s=2 * prorl.timeout_s if prorl.timeout_s else 3600.0,
                shared_version=True,  # verl's workers publish the steps in no fixed order
            )
        return self.drivers[key]


# event loop -> service URL -> its session
_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _ServiceSession]]
_sessions = weakref.WeakKeyDictionary()
# id(config) -> (config, its block): the config is held, so that its id cannot pass to another object
_checked: dict[int, tuple[Any, ProrlVerlConfig]] = {}


def _session(prorl: ProrlVerlConfig) -> _ServiceSession:
    sessions = _sessions.setdefault(asyncio.get_running_loop(), {})
    if prorl.service_url not in sessions:
        sessions[prorl.service_url] = _ServiceSession(prorl)
    return sessions[prorl.service_url]


def _settings(config) -> ProrlVerlConfig:
    """The validated block, checked once per process and config object (every sample builds a new loop; verl
    hands each the same config object, which is not hashable)."""
    if id(config) not in _checked:
        _checked[id(config)] = (config, check_verl_config(config))
    return _checked[id(config)][1]


# event loop -> block -> the stack's start (or attachment), which the samples of a worker wait on together
_launches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Future]]
_launches = weakref.WeakKeyDictionary()
_stacks: dict[str, Any] = {}  # the launched stacks, by namespace: the one this worker started lives while it does


async def _with_service(prorl: ProrlVerlConfig, config) -> ProrlVerlConfig:
    """The block as given, or, with `launch=ray`, with the launched stack's replica URL and token (started or
    attached once per process; the samples of a worker wait on the same start)."""
    if prorl.launch is None:
        return prorl
    launches = _launches.setdefault(asyncio.get_running_loop(), {})
    key = block_key(prorl)
    if key not in launches:
        launches[key] = asyncio.ensure_future(asyncio.to_thread(launched_block, prorl, config))
    return await launches[key]


def launched_block(prorl: ProrlVerlConfig, config) -> ProrlVerlConfig:
    """Start the stack on this Ray cluster (or attach to the one another worker starts) and pick this worker's
    replica; blocking, so it runs in a thread."""
    import ray

    from prorl_adapter.launch.ray_stack import RayStack, StackError

    context = ray.get_runtime_context()
    namespace = prorl.launch_namespace or f"prorl-{context.get_job_id()}"
    model = "actor_rollout_ref.model"
    tokenizer = OmegaConf.select(config, f"{model}.tokenizer_path") or OmegaConf.select(config, f"{model}.path")
    try:
        stack = RayStack.up_or_attach(
            namespace,
            tokenizer=str(tokenizer),
            replicas=prorl.launch_replicas,
            runtime_resource=prorl.runtime_resource,
            token=prorl.token,
            runtime_args=[arg for path in prorl.runtime_host_paths for arg in ("--host-path", path)],
            detached=False,  # it ends with the worker that started it: with the run
        )
    except StackError as exc:
        raise ProrlVerlConfigError(f"{BLOCK}.launch={prorl.launch}: {exc}") from exc
    _stacks[namespace] = stack
    worker = context.get_actor_id() or str(os.getpid())
    url = stack.service_urls[zlib.crc32(worker.encode()) % len(stack.service_urls)]
    logger.info("rollout stack %s is up; this worker uses the replica %s", namespace, url)
    return dataclasses.replace(prorl, service_url=url, token=stack.token)


# The verl whose LLM server client this reads: `_load_balancer` is a private attribute, which another verl may
# rename or drop without notice.
VERL_READ = "0.9.1"


@functools.cache
def installed_verl() -> str:
    """verl's version from its package metadata, read once (a checkout on PYTHONPATH may have none)."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "(no package metadata)"


@functools.cache
def warn_untested_verl(version: str) -> None:
    """Once per process: the private attribute is read from a verl it was not checked against."""
    logger.warning(
        "verl %s: the replicas' addresses are read from its LLM server client's private `_load_balancer`, as in "
        "verl %s; if they are wrong, list them: +%s.llm_servers=[http://host:port,...]",
        version,
        VERL_READ,
        BLOCK,
    )


async def verl_server_urls(server_manager: Any, engine: str | None = None) -> list[str]:
    """The HTTP addresses of verl's LLM server replicas, from the registry of the client's load balancer
    (`ip:port` there). With verl's SGLang engine (`actor_rollout_ref.rollout.name=sglang`) they name SGLang's
    protocol, which the service's pool then speaks; else they are vLLM's OpenAI-compatible servers."""
    version = installed_verl()
    balancer = getattr(server_manager, "_load_balancer", None)
    if balancer is None:
        raise ProrlVerlConfigError(
            f"verl {version}'s LLM server client has no `_load_balancer` (a private attribute, read as verl "
            f"{VERL_READ} has it) to read the replicas' addresses from; list the servers instead: "
            f"+{BLOCK}.llm_servers=[http://host:port,...]"
        )
    if version != VERL_READ:
        warn_untested_verl(version)
    addresses = await balancer.get_all_servers.remote()
    if not addresses:
        raise ProrlVerlConfigError(f"verl has no LLM server replicas registered; or set +{BLOCK}.llm_servers=[...]")
    urls = [a if a.startswith(("http://", "https://")) else f"http://{a}" for a in addresses]
    return [f"sglang+{url}" for url in urls] if engine == "sglang" else urls


@register(AGENT_LOOP_NAME)
class ProrlAgentLoop(AgentLoopBase):
    """Asks the rollout driver for its one sample; see the module docstring."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prorl = await _with_service(_settings(self.config), self.config)
        session = _session(prorl)
        await session.check_sections(prorl)
        engine = getattr(self.rollout_config, "name", None)
        urls = prorl.llm_servers or await verl_server_urls(self.server_manager, engine)
        await session.register_llm_servers(list(urls))
        sample = VerlSample(row=kwargs, sampling_params=sampling_params, rollout=self.rollout_config)
        try:
            output = await session.call("running an episode", session.driver(prorl).generate(sample))
        except RolloutAPIError as exc:  # a 4xx: the request is wrong (unknown task, bad instance)
            task = row_task_and_instance(prorl, kwargs)[0]
            raise ProrlVerlConfigError(f"the rollout service refused the episode of task {task!r}: {exc}") from exc
        output.prompt_ids = self._cap_text_prompt_length(output.prompt_ids)
        return output
