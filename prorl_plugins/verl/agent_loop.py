"""`prorl_agent`: verl's agent loop for one dataset row, run as an episode by the rollout service.

verl calls `run()` once per sample (GRPO: n times per row). The loop submits the row's episode to the rollout
service, waits for the trajectory and hands verl its `AgentLoopOutput`: the service's token ids, response mask
and behaviour logprobs as they are (nothing re-tokenized), the shaped reward on the last token (unless verl is
to score it, `prorl.reward_source=verl`), its components as `reward_extra_info` columns, the number of policy
turns, and the policy versions of its oldest and newest turn in verl's `min_global_steps`/`max_global_steps`,
which verl's replay buffer and our staleness sampler read.

Two things reach the service from verl on the way:
- verl's vLLM replicas (their HTTP addresses, from the LLM server client's load balancer) become the service's
  LLM servers, so the service generates with the weights verl keeps in sync;
- the trainer's step becomes the service's policy version: a row sampled at verl step g is generated with the
  weights published after step g-1 (verl's sync trainer updates the replicas at the end of each step, and
  verl's own `trajectory_staleness` metric counts from g-1), so each worker raises the service's version to g-1.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from prorl_adapter.models import SamplingParams, Trajectory
from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient
from prorl_adapter.trainer.samples import TrainingSample, job_request

from .config import AGENT_LOOP_NAME, BLOCK, ProrlVerlConfig, ProrlVerlConfigError, check_verl_config
from .reward import INSTANCE_FIELD, REWARD_SECTION_FIELD, TRAJECTORY_FIELD, component_columns

logger = logging.getLogger(__name__)

INSTANCE_KEY = "instance"  # the task instance: a dataset column, or extra_info["instance"]
TASK_KEY = "task"  # optional per-row task name in extra_info, overriding prorl.task


class EpisodeFailed(RuntimeError):
    """The service gave up on an episode for an infrastructure reason (the trajectory's `filter` flag). verl's
    V1 trainer marks the row's group as failed and, in the async modes, evicts it and samples a new row."""


# -- per-process state: one client per service and event loop; what was registered there ---------------------
class _ServiceSession:
    def __init__(self, prorl: ProrlVerlConfig) -> None:
        self.url = prorl.service_url
        self.client = RolloutClient(prorl.service_url, token=prorl.token)
        self.registered: set[str] = set()
        self.published_version = -1
        self.answered = False  # whether the service has answered this process yet
        self.lock = asyncio.Lock()

    async def _call(self, what: str, coroutine):
        try:
            result = await coroutine
        except httpx.TransportError as exc:
            if self.answered:  # it worked before: a failure of the service, not of the config
                raise EpisodeFailed(
                    f"the rollout service at {self.url} stopped answering ({what}): {type(exc).__name__}: {exc}"
                ) from exc
            raise ProrlVerlConfigError(
                f"the rollout service at {self.url} ({BLOCK}.service_url) does not answer ({what}): "
                f"{type(exc).__name__}: {exc}; start it (`prorl-rollout --sandbox-url ...`) or fix the URL"
            ) from exc
        self.answered = True
        return result

    async def register_llm_servers(self, urls: list[str]) -> None:
        """Make verl's replicas the service's only LLM servers: any other one (the `--llm-url` the service
        was started with) serves weights verl never updates, and its turns would be tagged as current."""
        async with self.lock:
            if set(urls) <= self.registered:
                return
            # One idempotent call: workers of one trainer each set the same set, in any order, without a race.
            await self._call("setting the LLM servers", self.client.set_llm_servers(urls))
            logger.info("the LLM servers of the rollout service %s are now verl's: %s", self.url, ", ".join(urls))
            self.registered.update(urls)

    async def publish_version(self, version: int) -> None:
        """Raise the service's policy version (never lower it: workers see the steps in order)."""
        async with self.lock:
            if version > self.published_version:
                await self._call("setting the policy version", self.client.set_policy_version(version, raise_only=True))
                self.published_version = version


_sessions: dict[tuple[str, int], _ServiceSession] = {}
_checked: dict[int, ProrlVerlConfig] = {}


def _session(prorl: ProrlVerlConfig) -> _ServiceSession:
    key = (prorl.service_url, id(asyncio.get_running_loop()))
    if key not in _sessions:
        _sessions[key] = _ServiceSession(prorl)
    return _sessions[key]


def _settings(config) -> ProrlVerlConfig:
    """The validated block, checked once per process and config object (every sample builds a new loop)."""
    key = id(config)
    if key not in _checked:
        _checked[key] = check_verl_config(config)
    return _checked[key]


async def verl_server_urls(server_manager: Any) -> list[str]:
    """The HTTP addresses of verl's LLM server replicas, from the registry of the client's load balancer
    (`ip:port` there; the OpenAI-compatible API of each replica's vLLM server)."""
    balancer = getattr(server_manager, "_load_balancer", None)
    if balancer is None:
        raise ProrlVerlConfigError(
            f"verl's LLM server client has no load balancer to read the replicas' addresses from; list the "
            f"servers instead: +{BLOCK}.llm_servers=[http://host:port,...]"
        )
    addresses = await balancer.get_all_servers.remote()
    if not addresses:
        raise ProrlVerlConfigError(f"verl has no LLM server replicas registered; or set +{BLOCK}.llm_servers=[...]")
    return [a if a.startswith(("http://", "https://")) else f"http://{a}" for a in addresses]


def _plain(value: Any) -> Any:
    """A dataset cell as plain JSON types (parquet hands numpy scalars and arrays)."""

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return obj.tolist()
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} {obj!r} is not JSON")

    return json.loads(json.dumps(value, default=default))


def row_task_and_instance(prorl: ProrlVerlConfig, row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    extra_info = row.get("extra_info") or {}
    instance = row.get(INSTANCE_KEY)
    if instance is None and isinstance(extra_info, dict):
        instance = extra_info.get(INSTANCE_KEY)
    if not isinstance(instance, dict):
        raise ProrlVerlConfigError(
            f"dataset row {row.get('index', '?')} has no task instance: put what the {prorl.task!r} task reads "
            f"(e.g. {{'question': ..., 'answer': ...}} for python_math) in the row's extra_info.{INSTANCE_KEY} "
            f"(examples/verl/make_dataset.py writes such rows); got {instance!r}"
        )
    task = extra_info.get(TASK_KEY) if isinstance(extra_info, dict) else None
    return str(task or prorl.task), _plain(instance)


def output_extra_fields(prorl: ProrlVerlConfig, trajectory: Trajectory, instance: dict) -> dict[str, Any]:
    """`AgentLoopOutput.extra_fields`: the version tags verl's replay buffer reads, the reward components as
    `reward_extra_info` columns, and, when verl scores the episode, what its reward function needs."""
    fields: dict[str, Any] = {
        "min_global_steps": trajectory.policy_version_min,
        "max_global_steps": trajectory.policy_version_max,
        "reward_extra_info": component_columns(trajectory.reward_components),
        "prorl_job_id": trajectory.job_id,
    }
    if prorl.reward_source == "verl":  # what the custom_reward_function needs to give the same number
        fields[TRAJECTORY_FIELD] = trajectory.model_dump_json()
        fields[INSTANCE_FIELD] = json.dumps(instance)
        fields[REWARD_SECTION_FIELD] = json.dumps(prorl.reward)
    return fields


@register(AGENT_LOOP_NAME)
class ProrlAgentLoop(AgentLoopBase):
    """Runs each sample's episode on the rollout service; see the module docstring."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prorl = _settings(self.config)
        session = _session(prorl)
        await session.register_llm_servers(list(prorl.llm_servers or await verl_server_urls(self.server_manager)))
        if kwargs.get("global_steps") is not None:  # verl's V1 trainer tags each row with its step
            await session.publish_version(max(0, int(kwargs["global_steps"]) - 1))

        task, instance = row_task_and_instance(prorl, kwargs)
        request = self._job_request(prorl, task, instance, sampling_params, kwargs)
        wait = 2 * prorl.timeout_s if prorl.timeout_s else 3600.0
        try:
            trajectory = await session._call("running an episode", session.client.run(request, wait=wait))
        except RolloutAPIError as exc:  # a 4xx: the request is wrong (unknown task, bad instance)
            raise ProrlVerlConfigError(f"the rollout service refused the episode of task {task!r}: {exc}") from exc
        if trajectory.filter:
            error = trajectory.error
            raise EpisodeFailed(
                f"episode {trajectory.job_id} (row uid {kwargs.get('uid')}) failed in the rollout service: "
                f"{error.error_class if error else '?'}: {error.message if error else 'no message'}"
            )
        return self._output(prorl, trajectory, instance)

    def _job_request(self, prorl: ProrlVerlConfig, task: str, instance: dict, sampling_params: dict, row: dict):
        rollout = self.rollout_config
        sampling = dict(prorl.sampling)
        sampling.setdefault("max_tokens", min(SamplingParams().max_tokens, rollout.response_length))
        sampling["temperature"] = float(sampling_params.get("temperature", rollout.temperature))
        sampling["top_p"] = float(sampling_params.get("top_p", rollout.top_p))
        group = str(row.get("uid", row.get("index", "")))
        labels = {"verl_uid": group}
        if row.get("session_id") is not None:
            labels["verl_session"] = str(row["session_id"])
        return job_request(
            task,
            instance,
            group=group,
            sampling=sampling,
            max_turns=prorl.max_turns,
            max_context_tokens=prorl.max_context_tokens or rollout.prompt_length + rollout.response_length,
            timeout_s=prorl.timeout_s,
            labels=labels,
        )

    def _output(self, prorl: ProrlVerlConfig, trajectory: Trajectory, instance: dict) -> AgentLoopOutput:
        # verl pads to fixed widths: the response is cut to response_length (the reward stays on the new last
        # token), the prompt left-truncated to prompt_length as verl's own loops do (with a warning).
        sample = TrainingSample.from_trajectory(trajectory).truncated(self.rollout_config.response_length)
        return AgentLoopOutput(
            prompt_ids=self._cap_text_prompt_length(sample.prompt_ids),
            response_ids=sample.response_ids,
            response_mask=sample.response_mask,
            response_logprobs=sample.response_logprobs,
            reward_score=trajectory.reward if prorl.reward_source == "service" else None,
            num_turns=trajectory.num_turns,
            metrics=AgentLoopMetrics(
                generate_sequences=trajectory.timings.generate_s, tool_calls=trajectory.timings.tools_s
            ),
            extra_fields=output_extra_fields(prorl, trajectory, instance),
        )
