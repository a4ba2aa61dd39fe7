"""What every training backend shares on the trainer's side, besides the driver: one dataset row's episode as
a `JobRequest` (`job_request`, with its GRPO group), GRPO's treatment of untrainable samples
(`group_neutral_rewards`), and a trajectory rebuilt from what a trainer's batch keeps
(`trajectory_from_tensors`). What a trainer derives from one weighed trajectory is `BatchItem`'s
(prorl_adapter.models)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Any

from ..models import (
    AgentProgram,
    BatchItem,
    FinishReason,
    JobRequest,
    SamplingParams,
    StageTimings,
    Trajectory,
)


def group_neutral_rewards(items: Sequence[BatchItem]) -> list[float]:
    """Each item's reward, except that an untrainable one (dropped, failed) gets the mean reward of the
    trainable items of its group (0.0 if none is): a trainer that must keep its row (a fixed batch size)
    and computes GRPO advantages over the whole group then gives it no pull on its siblings' baseline."""
    trainable: dict[str, list[float]] = {}
    for item in items:
        if item.trainable:
            trainable.setdefault(item.group, []).append(item.trajectory.reward)
    return [
        i.trajectory.reward if i.trainable else (fmean(trainable[i.group]) if i.group in trainable else 0.0)
        for i in items
    ]


def job_request(
    task: str,
    instance: Mapping[str, Any],
    group: str,
    sampling: SamplingParams | Mapping[str, Any] | None = None,
    max_turns: int = 8,
    max_context_tokens: int = 4096,
    timeout_s: float | None = None,
    labels: Mapping[str, str] | None = None,
    agent: AgentProgram | None = None,
) -> JobRequest:
    """A dataset row's episode as a job; `group` ties the row's GRPO samples together; `agent`, an agent program
    of the user's own, runs it instead of the built-in agent loop."""
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams.model_validate(dict(sampling or {}))
    return JobRequest(
        task=task,
        instance=dict(instance),
        sampling=sampling,
        max_turns=max_turns,
        max_context_tokens=max_context_tokens,
        timeout_s=timeout_s,
        labels=dict(labels or {}),
        group=group,
        agent=agent,
    )


def trajectory_from_tensors(
    prompt_ids: list[int],
    response_ids: list[int],
    response_mask: list[int],
    response_logprobs: list[float],
    policy_version_min: int,
    policy_version_max: int,
    reward: float = 0.0,
    job_id: str = "sample",
    task: str = "unknown",
    finish_reason: FinishReason = "finish",
) -> Trajectory:
    """A trajectory rebuilt from what a trainer's batch keeps (ids, mask, logprobs, version tags), so that a
    trainer-side component that holds only tensors (verl's replay-buffer sampler) asks the same plugins.
    It has no turns: plugins that read turns (reward shaping) must run on the service's trajectory."""
    return Trajectory(
        job_id=job_id,
        task=task,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=response_mask,
        response_logprobs=response_logprobs,
        turns=[],
        num_turns=0,
        finish_reason=finish_reason,
        reward=reward,
        policy_version_min=policy_version_min,
        policy_version_max=policy_version_max,
        timings=StageTimings(),
    )
