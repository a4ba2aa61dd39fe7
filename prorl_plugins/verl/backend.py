"""The verl backend hook implementation: one verl sample in, one rollout job out; its trajectory in, verl's
`AgentLoopOutput` out. `RolloutDriver` calls these hooks for the `prorl_agent` loop (agent_loop.py), which
asks the driver for its one sample.

- `prorl_backend_policy_version`: verl's V1 trainer tags each row with its step g; the row is generated with
  the weights published after step g-1 (verl's sync trainer updates the replicas at the end of each step, and
  verl's own `trajectory_staleness` metric counts from g-1), so the version is g-1. Several workers publish
  the steps in no fixed order: the driver publishes with `raise_only`.
- `prorl_backend_requests`: the row's task (`extra_info.task`, else `prorl.task`) and instance (the
  `instance` column, or `extra_info.instance`), verl's temperature and top_p, the block's other per-turn
  settings, and verl's lengths; the GRPO group is verl's `uid`.
- `prorl_backend_batch`: `EpisodeFailed` for an episode the service gave up on (infrastructure); else the
  service's token ids, response mask and behaviour logprobs as they are (nothing
  re-tokenized), cut to verl's response_length; the shaped reward on the last token (unless verl is to score
  it, `prorl.reward_source=verl`); its components as `reward_extra_info` columns; the policy versions of the
  oldest and newest turn in `min_global_steps`/`max_global_steps`, which verl's replay buffer and the
  staleness sampler read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

from prorl_adapter.hooks import hookimpl
from prorl_adapter.models import BatchItem, JobRequest, SamplingParams, Trajectory
from prorl_adapter.trainer.samples import job_request
from server_kit.errors import ProrlError

from .config import ProrlVerlConfig, ProrlVerlConfigError
from .reward import INSTANCE_FIELD, REWARD_SECTION_FIELD, TRAJECTORY_FIELD, component_columns

INSTANCE_KEY = "instance"  # the task instance: a dataset column, or extra_info["instance"]
TASK_KEY = "task"  # optional per-row task name in extra_info, overriding prorl.task


@dataclass(frozen=True)
class VerlSample:
    """One verl sample, as `AgentLoopBase.run` gets it: the dataset row's fields (`kwargs`), verl's sampling
    params, and the rollout config (lengths, temperature, top_p)."""

    row: dict[str, Any]
    sampling_params: dict[str, Any]
    rollout: Any  # verl's RolloutConfig


class EpisodeFailed(ProrlError, RuntimeError):
    """The service gave up on an episode for an infrastructure reason (the trajectory's `filter` flag). verl's
    V1 trainer marks the row's group as failed and, in the async modes, evicts it and samples a new row."""


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


log = logging.getLogger(__name__)


class VerlBackend:
    """The backend hooks for `VerlSample`s, configured by the validated `prorl` block."""

    def __init__(self, prorl: ProrlVerlConfig) -> None:
        self.prorl = prorl

    @hookimpl
    def prorl_backend_policy_version(self, batch: VerlSample) -> int | None:
        step = batch.row.get("global_steps")  # verl's V1 trainer tags each row with its step
        return None if step is None else max(0, int(step) - 1)

    @hookimpl
    def prorl_backend_requests(self, batch: VerlSample) -> list[JobRequest]:
        prorl, rollout, row = self.prorl, batch.rollout, batch.row
        task, instance = row_task_and_instance(prorl, row)
        sampling = dict(prorl.sampling)
        sampling.setdefault("max_tokens", min(SamplingParams().max_tokens, rollout.response_length))
        sampling["temperature"] = float(batch.sampling_params.get("temperature", rollout.temperature))
        sampling["top_p"] = float(batch.sampling_params.get("top_p", rollout.top_p))
        group = str(row.get("uid", row.get("index", "")))
        labels = {"verl_uid": group}
        if row.get("session_id") is not None:
            labels["verl_session"] = str(row["session_id"])
        request = job_request(
            task,
            instance,
            group=group,
            sampling=sampling,
            max_turns=prorl.max_turns,
            max_context_tokens=prorl.max_context_tokens or rollout.prompt_length + rollout.response_length,
            timeout_s=prorl.timeout_s,
            labels=labels,
            agent=prorl.agent,
        )
        return [request]

    @hookimpl
    def prorl_backend_batch(self, items: list[BatchItem], batch: VerlSample) -> AgentLoopOutput:
        (item,) = items
        if item.trajectory.filter:
            error = item.trajectory.error
            raise EpisodeFailed(
                f"episode {item.trajectory.job_id} (row uid {batch.row.get('uid')}) failed in the rollout service: "
                f"{error.error_class if error else '?'}: {error.message if error else 'no message'}"
            )
        # verl's agent loop gives one sequence per sample: of an episode whose harness rewrote its history, the
        # sequence with the most policy tokens (docs/gateway.md); the others' tokens are counted, not trained on.
        dropped = item.dropped_policy_tokens
        if dropped:
            log.warning("episode %s: %d policy tokens of its other sequences are not trained on", item.id, dropped)
        # verl pads to fixed widths: the response is cut to response_length (the reward stays on the new last
        # token); the loop left-truncates the prompt to prompt_length as verl's own loops do.
        t = item.one_sequence().truncated(batch.rollout.response_length).trajectory
        output = AgentLoopOutput(
            prompt_ids=list(t.prompt_ids),
            response_ids=list(t.response_ids),
            response_mask=list(t.response_mask),
            response_logprobs=list(t.response_logprobs),
            reward_score=t.reward if self.prorl.reward_source == "service" else None,
            num_turns=t.num_turns,
            metrics=AgentLoopMetrics(generate_sequences=t.timings.generate_s, tool_calls=t.timings.tools_s),
            extra_fields=output_extra_fields(
                self.prorl, item.trajectory, row_task_and_instance(self.prorl, batch.row)[1]
            ),
        )
        return output
