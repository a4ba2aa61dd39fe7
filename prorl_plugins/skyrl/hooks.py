"""The SkyRL backend hook implementation: SkyRL's `GeneratorInput` in, rollout jobs out; finished trajectories
in, SkyRL's `GeneratorOutput` out, called by the driver (`prorl_adapter.trainer.RolloutDriver`). Everything a
trainer does the same (weighing, the loss weights, the GRPO group) is the driver's and `BatchItem`'s; what is
here is only SkyRL's vocabulary.

How a SkyRL row becomes an episode:
- `env_classes[i]` (the dataset's `env_class` column, else `environment.env_class`) names the rollout task
  (`shell`, `python_math`, `swe`, or a plugin's);
- `env_extras[i]["instance"]` (the dataset's `instance` column: a mapping, or a JSON object as a string) is the
  task instance; SkyRL's `prompt` column is not sent: the task builds the prompt, and `prompt_token_ids` in the
  output are the ids the policy actually saw;
- `trajectory_ids[i].instance_id` (SkyRL's uid of the row) is the GRPO group, as SkyRL groups by it too;
- `sampling_params` (vLLM names, from `generator.sampling_params`, `additional_kwargs` included) become the
  job's sampling settings; a setting the service cannot honour (e.g. `top_k=50`) is an error, not a silent drop;
- `batch_metadata.global_step` - 1 is the policy version (`prorl_backend_policy_version`): SkyRL's step g
  (from 1) generates with the weights after g - 1 updates, as verl's does, so both backends count alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from skyrl.train.generators.base import GeneratorInput, GeneratorOutput

from prorl_adapter.hooks import hookimpl
from prorl_adapter.models import BatchItem, JobRequest, TrajectoryWeight
from prorl_adapter.trainer.samples import group_neutral_rewards, job_request

from . import compat  # noqa: F401  (before the first skyrl import)

INSTANCE_COLUMN = "instance"
TRAJECTORY_LABEL = "skyrl_trajectory_id"  # JobRequest.labels: SkyRL's TrajectoryID, for logs and lookups
STEP_LABEL = "skyrl_global_step"

# The service's own sampling fields, under the name SkyRL's vLLM params use for them.
_SERVICE_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_tokens", "seed": "seed"}
_SERVICE_SAMPLING.update({"stop": "stop", "regex": "regex"})
# vLLM settings SkyRL sends with every batch (skyrl...engine_utils.get_vllm_sampling_params) and the values at
# which they change nothing the service does. Another value cannot be honoured, so it is an error.
_NEUTRAL_SAMPLING: Mapping[str, tuple[Any, ...]] = {
    "top_k": (-1, 0, None),
    "min_p": (0.0, None),
    "min_tokens": (0, 1, None),  # every turn samples at least one token anyway
    "repetition_penalty": (1.0, None),
    "logprobs": (0, 1, None),  # the service always asks for the sampled token's logprob
    # Text-side flags: the service works on token ids and decodes turns itself.
    "skip_special_tokens": (True, False, None),
    "include_stop_str_in_output": (True, False, None),
}
# The agent loop's finish reason in SkyRL's words: "stop" ended by itself, "length" cut by a budget.
log = logging.getLogger(__name__)
STOP_REASONS: Mapping[str, str] = {
    "finish": "stop",
    "no_tool_call": "stop",
    "max_turns": "length",
    "max_context": "length",
    "error": "error",
    "agent_exit": "stop",
    "agent_timeout": "length",
}
_REQUEST_KEYS = ("max_turns", "max_context_tokens", "timeout_s")


def sampling_settings(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """SkyRL's per-batch vLLM sampling params as the service's `SamplingParams` fields."""
    settings: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if key in _SERVICE_SAMPLING:
            if value is not None:
                settings[_SERVICE_SAMPLING[key]] = list(value) if key == "stop" else value
        elif key in _NEUTRAL_SAMPLING and value in _NEUTRAL_SAMPLING[key]:
            continue
        else:
            raise ValueError(
                f"SkyRL sampling parameter {key}={value!r} cannot be honoured by the rollout service "
                f"(it honours {', '.join(_SERVICE_SAMPLING)}; {', '.join(_NEUTRAL_SAMPLING)} only at their "
                "neutral values): remove it from generator.sampling_params"
            )
    return settings


def instance_of(extras: Mapping[str, Any] | None, row: int) -> dict[str, Any]:
    """The task instance a SkyRL row carries in its `instance` column (a mapping, or JSON text)."""
    instance = (extras or {}).get(INSTANCE_COLUMN)
    if isinstance(instance, str):
        try:
            instance = json.loads(instance)
        except ValueError as exc:
            raise ValueError(f"row {row}: the {INSTANCE_COLUMN!r} column is not valid JSON: {exc}") from None
    if not isinstance(instance, Mapping):
        present = ", ".join(sorted(extras or {})) or "none"
        raise ValueError(
            f"row {row}: a SkyRL dataset row for the rollout service needs an {INSTANCE_COLUMN!r} column holding "
            f"the task instance (a mapping or a JSON object); its extra columns are: {present}"
        )
    return dict(instance)


def request_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The generator's per-job settings: `max_turns`, `max_context_tokens`, `timeout_s` (each optional)."""
    unknown = sorted(set(config) - set(_REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown SkyRL backend setting(s) {', '.join(unknown)}; known: {', '.join(_REQUEST_KEYS)}")
    return {key: config[key] for key in _REQUEST_KEYS if config.get(key) is not None}


def _filled(item: BatchItem, filler_token_id: int | None) -> BatchItem:
    """SkyRL puts the reward on a response's last token, so a response cannot be empty; an episode that failed
    before the policy spoke gets one filler token (mask 0: never trained on)."""
    t = item.trajectory
    if t.response_ids:
        return item
    if filler_token_id is None:
        raise ValueError(
            f"episode {item.id} has an empty response and no filler token id was given (SkyRLBackend's "
            "filler_token_id, the tokenizer's eos token)"
        )
    filled = t.model_copy(update={"response_ids": [filler_token_id], "response_mask": [0], "response_logprobs": [0.0]})
    weight = TrajectoryWeight(item.weight.sample, None, list(item.weight.reasons))
    return item.model_copy(update={"trajectory": filled, "weight": weight})


def generator_output(
    items: Sequence[BatchItem], batch: Mapping[str, Any], filler_token_id: int | None = None, step_wise: bool = False
) -> GeneratorOutput:
    """Weighed items, in the order of the `GeneratorInput` rows they answer, in SkyRL's terms.

    Weights: SkyRL has no per-sample loss weight, but its `loss_mask` is a float tensor that multiplies each
    token's loss, so the weights ride in it (`BatchItem.weighted_mask`): a dropped sample keeps its row with
    an all-zero mask (SkyRL needs one row per prompt) and its group's mean reward, so that SkyRL's GRPO
    baseline, computed over every row, is not pulled by it; a linear staleness weight w scales its policy
    tokens to w.
    """
    rewards = group_neutral_rewards(items)
    metrics = rollout_metrics(items)
    times = [i.trajectory.timings.init_s + i.trajectory.timings.run_s + i.trajectory.timings.eval_s for i in items]
    trajectory_ids = batch.get("trajectory_ids")
    if step_wise:  # one row per token sequence, an episode's rows together, the last one marked
        episodes = [item.segment_items() for item in items]
        is_last_step = [k == len(rows) - 1 for rows in episodes for k in range(len(rows))]
        rewards = [reward for reward, rows in zip(rewards, episodes) for _ in rows]
        times = [seconds for seconds, rows in zip(times, episodes) for _ in rows]  # per row, as SkyRL's own
        if trajectory_ids is not None:
            trajectory_ids = [tid for tid, rows in zip(trajectory_ids, episodes) for _ in rows]
        items = [row for rows in episodes for row in rows]
    else:
        is_last_step = None
        dropped = [item.dropped_policy_tokens for item in items]
        if any(dropped):
            log.warning(
                "%d episodes rewrote their history: %d policy tokens of their other sequences are not trained on "
                "(set generator.step_wise_trajectories=true to train on every sequence)",
                sum(d > 0 for d in dropped),
                sum(dropped),
            )
        metrics["prorl/dropped_policy_tokens"] = float(sum(dropped))
        items = [item.one_sequence() for item in items]
    items = [_filled(i, filler_token_id) for i in items]
    masks = []
    for item in items:
        mask = item.weighted_mask()
        # Plain 0/1 ints where no weight is in play, as SkyRL's own generators emit.
        masks.append([int(m) for m in mask] if all(m in (0.0, 1.0) for m in mask) else mask)
    trajectories = [i.trajectory for i in items]
    return GeneratorOutput(
        prompt_token_ids=[t.prompt_ids for t in trajectories],
        response_ids=[t.response_ids for t in trajectories],
        rewards=rewards,
        loss_masks=masks,
        stop_reasons=[STOP_REASONS[t.finish_reason] for t in trajectories],
        rollout_metrics=metrics,
        rollout_logprobs=[t.response_logprobs for t in trajectories],
        trajectory_ids=trajectory_ids,
        trajectory_generation_times=times,
        rollout_expert_indices=None,
        is_last_step=is_last_step,
        env_metrics=None,
        pixel_values=None,
        image_grid_thw=None,
    )


def rollout_metrics(items: Sequence[BatchItem]) -> dict[str, float]:
    n = max(1, len(items))
    return {
        "prorl/num_turns": sum(i.trajectory.num_turns for i in items) / n,
        "prorl/sample_weight": sum(i.weight.sample for i in items) / n,
        "prorl/untrainable": float(sum(not i.trainable for i in items)),
        "prorl/infra_failures": float(sum(i.trajectory.filter for i in items)),
    }


def global_step(batch: GeneratorInput) -> int | None:
    metadata = batch.get("batch_metadata")
    return None if metadata is None else int(metadata.global_step)


class SkyRLBackend:
    """The hook implementations: SkyRL's `GeneratorInput` in, SkyRL's `GeneratorOutput` out."""

    def __init__(self, filler_token_id: int | None = None, step_wise: bool = False) -> None:
        """`step_wise`: SkyRL's `generator.step_wise_trajectories`, under which an episode of several token
        sequences (an agent program that rewrote its history) is one row per sequence."""
        self.filler_token_id = filler_token_id
        self.step_wise = step_wise

    @hookimpl
    def prorl_backend_policy_version(self, batch: GeneratorInput) -> int | None:
        step = global_step(batch)
        return None if step is None else max(0, step - 1)

    @hookimpl
    def prorl_backend_requests(self, batch: GeneratorInput, config: dict[str, Any]) -> list[JobRequest]:
        settings = request_settings(config)
        step = global_step(batch)
        n = len(batch["prompts"])
        extras = batch.get("env_extras") or [None] * n
        ids = batch.get("trajectory_ids") or [None] * n
        if not len(batch["env_classes"]) == len(extras) == len(ids) == n:
            raise ValueError(
                f"GeneratorInput lists differ in length: {n} prompts, {len(batch['env_classes'])} env_classes, "
                f"{len(extras)} env_extras, {len(ids)} trajectory_ids"
            )
        sampling = sampling_settings(batch.get("sampling_params"))
        requests = []
        for i, (task, extra, tid) in enumerate(zip(batch["env_classes"], extras, ids)):
            labels = {STEP_LABEL: str(step)} if step is not None else {}
            if tid is not None:
                labels[TRAJECTORY_LABEL] = tid.to_string()
            group = tid.instance_id if tid is not None else f"row-{i}"
            requests.append(job_request(task, instance_of(extra, i), group, sampling, labels=labels, **settings))
        return requests

    @hookimpl
    def prorl_backend_batch(self, items: list[BatchItem], batch: GeneratorInput) -> GeneratorOutput:
        if len(items) != len(batch["prompts"]):
            raise ValueError(f"{len(items)} trajectories for {len(batch['prompts'])} prompts")
        return generator_output(items, batch, self.filler_token_id, self.step_wise)
