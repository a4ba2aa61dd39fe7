"""What every training-backend hook implementation shares: verl's, SkyRL's and the CPU trainer's.

A backend plugin does two trainer-specific things: it turns its trainer's generation request into rollout
jobs, and it turns finished trajectories into its trainer's batch type. Everything in between is the same
for every trainer and lives here, so that a third backend is one more small plugin:

- `TrainingSample`: one trajectory as a trainer consumes it: ids, mask, behaviour logprobs, shaped reward,
  version tags, GRPO group, and its loss weights (the staleness verdict, per token).
- `TrainerPlugins`: the shared plugins (staleness control, reward shaping) loaded in the trainer's process
  from the same configuration the service reads, and asked exactly as the service asks them.
- `job_request`: one dataset row's task, instance and sampling settings as a `JobRequest`.
- `group_key`: which samples GRPO compares with each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import fmean
from typing import Any

import pluggy

from ..hooks.manager import configure_plugins, make_plugin_manager
from ..hooks.rewards import shape_reward
from ..hooks.specs import TrajectoryWeight
from ..models import BatchItem, FinishReason, JobRequest, SamplingParams, StageTimings, Trajectory

GROUP_LABEL = "group"  # JobRequest.labels[GROUP_LABEL]: the samples of one prompt, compared by GRPO


@dataclass
class TrainingSample:
    """One trajectory, ready for a trainer. Lists are aligned with `response_ids`."""

    id: str  # the buffer entry id (decoupled mode) or the job id
    group: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 = the policy sampled this token
    response_logprobs: list[float]  # behaviour logprobs; 0.0 where the mask is 0
    reward: float
    reward_components: dict[str, float]
    num_turns: int
    policy_version_min: int
    policy_version_max: int
    weight: TrajectoryWeight = field(default_factory=TrajectoryWeight)
    trajectory: Trajectory | None = None

    @classmethod
    def from_trajectory(
        cls, trajectory: Trajectory, weight: TrajectoryWeight | None = None, id: str | None = None
    ) -> TrainingSample:
        return cls(
            id=id or trajectory.job_id,
            group=group_key(trajectory),
            prompt_ids=list(trajectory.prompt_ids),
            response_ids=list(trajectory.response_ids),
            response_mask=list(trajectory.response_mask),
            response_logprobs=list(trajectory.response_logprobs),
            reward=trajectory.reward,
            reward_components=dict(trajectory.reward_components),
            num_turns=trajectory.num_turns,
            policy_version_min=trajectory.policy_version_min,
            policy_version_max=trajectory.policy_version_max,
            weight=weight or TrajectoryWeight(),
            trajectory=trajectory,
        )

    @classmethod
    def from_batch_item(cls, item: BatchItem) -> TrainingSample:
        """A trajectory taken from the service's buffer, weighed there by the same shared plugins."""
        return cls.from_trajectory(item.trajectory, item.weight, item.id)

    def loss_weights(self) -> list[float]:
        """Per response token: the sample weight times the token weight (tool and template tokens included;
        the response mask, not this, keeps them out of the loss)."""
        tokens = self.weight.tokens or [1.0] * len(self.response_ids)
        return [self.weight.sample * w for w in tokens]

    @property
    def trainable(self) -> bool:
        """False when no trainer may learn from this sample: a plugin weighed it 0 (e.g. too stale) or the
        service flagged the episode as an infrastructure failure (`Trajectory.filter`). Trainers that need a
        fixed batch size keep such a sample with an all-zero mask instead of dropping it."""
        return self.weight.sample != 0.0 and not (self.trajectory is not None and self.trajectory.filter)

    def weighted_mask(self) -> list[float]:
        """The response mask times the loss weights, all zeros unless `trainable`: for a trainer whose loss
        multiplies each token's loss by a float mask (SkyRL's `loss_mask`), this carries the staleness and
        importance weights with no field of their own. Shared so that every such backend weighs alike."""
        if not self.trainable:
            return [0.0] * len(self.response_ids)
        return [m * w for m, w in zip(self.response_mask, self.loss_weights())]

    def token_versions(self) -> list[int | None]:
        """The policy version that sampled each response token (None on tool and template tokens): the k-th
        run of policy tokens is turn k. Needs the trajectory's turns; without them every policy token gets
        `policy_version_min`, the conservative answer."""
        turns = self.trajectory.turns if self.trajectory is not None else []
        versions: list[int | None] = []
        turn = -1
        for i, policy in enumerate(self.response_mask):
            if not policy:
                versions.append(None)
                continue
            if i == 0 or not self.response_mask[i - 1]:
                turn += 1
            versions.append(turns[turn].policy_version if turn < len(turns) else self.policy_version_min)
        return versions

    def truncated(self, max_response_tokens: int) -> TrainingSample:
        """The sample cut to a trainer's fixed response length. The reward stays on the (new) last token:
        an episode longer than the trainer's window is still scored as a whole."""
        if len(self.response_ids) <= max_response_tokens:
            return self
        n = max_response_tokens
        tokens = self.weight.tokens[:n] if self.weight.tokens is not None else None
        return replace(
            self,
            response_ids=self.response_ids[:n],
            response_mask=self.response_mask[:n],
            response_logprobs=self.response_logprobs[:n],
            weight=TrajectoryWeight(self.weight.sample, tokens, list(self.weight.reasons)),
        )


def group_neutral_rewards(samples: Sequence[TrainingSample]) -> list[float]:
    """Each sample's reward, except that an untrainable one (dropped, failed) gets the mean reward of the
    trainable samples of its group (0.0 if none is): a trainer that must keep its row (a fixed batch size)
    and computes GRPO advantages over the whole group then gives it no pull on its siblings' baseline."""
    trainable: dict[str, list[float]] = {}
    for sample in samples:
        if sample.trainable:
            trainable.setdefault(sample.group, []).append(sample.reward)
    return [s.reward if s.trainable else (fmean(trainable[s.group]) if s.group in trainable else 0.0) for s in samples]


def group_key(trajectory: Trajectory) -> str:
    """GRPO compares the samples of one prompt: the `group` label a backend set, else the task instance."""
    return trajectory.labels.get(GROUP_LABEL) or f"{trajectory.task}:{trajectory.instance_id or trajectory.job_id}"


def job_request(
    task: str,
    instance: Mapping[str, Any],
    group: str,
    sampling: SamplingParams | Mapping[str, Any] | None = None,
    max_turns: int = 8,
    max_context_tokens: int = 4096,
    timeout_s: float | None = None,
    labels: Mapping[str, str] | None = None,
) -> JobRequest:
    """A dataset row's episode as a job; `group` ties the row's GRPO samples together."""
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams.model_validate(dict(sampling or {}))
    return JobRequest(
        task=task,
        instance=dict(instance),
        sampling=sampling,
        max_turns=max_turns,
        max_context_tokens=max_context_tokens,
        timeout_s=timeout_s,
        labels={**(labels or {}), GROUP_LABEL: group},
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


class TrainerPlugins:
    """The shared plugins in the trainer's process, configured from the same sections the service reads
    (`{"staleness": {...}, "reward": {...}}`); a section that no loaded plugin reads is an error."""

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        import_paths: Iterable[str] = (),
        objects: Iterable[object] = (),
        load_entry_points: bool = True,
    ) -> None:
        self.manager: pluggy.PluginManager = make_plugin_manager(
            import_paths, objects, load_entry_points=load_entry_points
        )
        self.config = dict(config or {})
        configure_plugins(self.manager, self.config)

    @property
    def hooks(self) -> Any:
        return self.manager.hook

    def weigh(
        self, trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None = None
    ) -> TrajectoryWeight:
        """Every plugin's verdict on consuming `trajectory` at `current_version`, combined."""
        verdicts = self.hooks.prorl_trajectory_weight(
            trajectory=trajectory, current_version=current_version, current_logprobs=current_logprobs
        )
        return TrajectoryWeight.combine(verdicts, len(trajectory.response_ids))

    def shaped_reward(self, trajectory: Trajectory, instance: Mapping[str, Any]) -> tuple[dict[str, float], float]:
        """The components and shaped reward of a finished trajectory, asked of the reward plugins in the
        trainer's process exactly as the service's eval stage asks them (a trainer that scores on its side,
        e.g. verl's custom_reward_function, must get the service's number)."""
        return shape_reward(self.hooks, trajectory, instance, trajectory.reward_components, replace_recorded=True)

    def samples(self, trajectories: Iterable[Trajectory], current_version: int) -> list[TrainingSample]:
        """Trajectories weighed at `current_version`, in order; weight-0 samples are kept (the caller
        decides whether to drop or mask them, since some trainers need a fixed batch size)."""
        return [TrainingSample.from_trajectory(t, self.weigh(t, current_version)) for t in trajectories]
