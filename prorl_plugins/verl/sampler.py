"""Staleness control on verl's V1 replay buffer, decided by the shared staleness plugin.

    trainer.v1.sampler.custom_sampler.path=pkg://prorl_plugins.verl.sampler
    trainer.v1.sampler.custom_sampler.name=StalenessReplayBuffer

The staleness section is the block's, `prorl.staleness`, stated nowhere else: verl hands a custom sampler only
`trainer.v1.sampler.sampler_kwargs`, but as a node of the whole composed config, whose root holds the block.
The sampler checks the whole recipe there (`check_verl_config`), when verl's trainer starts.

verl stores each finished trajectory in TransferQueue with tags `min_global_steps`/`max_global_steps` (our agent
loop fills them with the service's policy versions) and groups them by prompt uid. When the trainer samples a
batch for step g, the policy being trained is the one published after step g-1, so a trajectory whose oldest
turn ran at version v has staleness s = (g - 1) - v, the same count verl's `trajectory_staleness` metric uses.
Per mode of `prorl.staleness`:

- `drop`, `importance`: a group with any trajectory the plugin weighs 0 (s > K) is evicted before selection,
  and verl refills it with a new prompt (verl's own eviction path, so its metrics count it). `importance`'s
  per-token weights are verl's rollout correction (`algorithm.rollout_correction.rollout_is=token`): at sampling
  time the trainer's logprobs do not exist yet, and verl computes exactly the truncated ratio there.
- `linear`: groups at weight 0 (s >= K) are evicted as above; every other selected trajectory gets its weight
  1 - s/K on each response token, written to TransferQueue as `rollout_is_weights`, the per-token factor verl's
  policy losses multiply into the loss.
- `pace`: dropless, verl's `wait` strategy: sampling blocks while an in-flight prompt would otherwise be
  consumed with s > K, so slow episodes are waited for rather than dropped.
- `off` (or no section): verl's built-in threshold rule, unchanged.

verl's own `max_off_policy_threshold` counts prompt steps, not the versions an episode really ran with; in
`drop`/`linear`/`importance` the plugin's rule replaces it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from prorl_adapter.models import TrajectoryWeight
from prorl_adapter.trainer.samples import trajectory_from_tensors

from .config import BLOCK, SAMPLER_NAME, ProrlVerlConfig, ProrlVerlConfigError, check_verl_config, plugin_set

logger = logging.getLogger(__name__)

WEIGHTS_FIELD = "rollout_is_weights"  # the per-token loss factor verl's policy losses apply
_PLUGIN_MODES = ("drop", "linear", "importance")


def recipe_block(sampler_kwargs: Any) -> ProrlVerlConfig:
    """The checked `prorl` block of the verl config that `sampler_kwargs` (verl's
    `trainer.v1.sampler.sampler_kwargs`) belongs to."""
    if not isinstance(sampler_kwargs, DictConfig):
        raise ProrlVerlConfigError(
            f"{SAMPLER_NAME} reads {BLOCK}.staleness from the verl config it is built from, and got sampler_kwargs "
            f"{sampler_kwargs!r} outside of one; let verl build it (trainer.v1.sampler.custom_sampler.*), or pass "
            "the composed config's trainer.v1.sampler.sampler_kwargs"
        )
    # verl hands the node `trainer.v1.sampler.sampler_kwargs` of the composed config; OmegaConf's relative select
    # climbs one level per dot after the first, so five dots reach the root, where the `prorl` block is.
    root = OmegaConf.select(sampler_kwargs, "." * 5)
    if not isinstance(root, DictConfig) or OmegaConf.select(root, "trainer.v1.sampler.sampler_kwargs") is None:
        raise ProrlVerlConfigError(f"{SAMPLER_NAME} must be built by verl from trainer.v1.sampler.custom_sampler.*")
    return check_verl_config(root)


class StalenessReplayBuffer(ReplayBufferAsync):
    """verl's replay buffer (the async one, whose eviction and refill serve every trainer mode), with the
    shared staleness plugin deciding which groups are stale and how much each sample weighs."""

    def __init__(self, *args: Any, sampler_kwargs: Any = None, **kwargs: Any) -> None:
        prorl = recipe_block(sampler_kwargs)
        self.plugins = plugin_set({"staleness": prorl.staleness} if prorl.staleness is not None else {})
        self.mode, k = prorl.staleness_config.mode, prorl.staleness_config.max_staleness
        if self.mode in _PLUGIN_MODES:
            kwargs["max_off_policy_threshold"] = None  # the plugin's rule replaces verl's prompt-step rule
        elif self.mode == "pace":
            # verl counts spans g - prompt_step + 1 = s + 1, and `wait` lets a prompt reach the threshold
            kwargs["max_off_policy_threshold"] = k + 1
            kwargs["max_off_policy_strategy"] = "wait"
        super().__init__(*args, sampler_kwargs=sampler_kwargs, **kwargs)
        self.last_weights: dict[str, float] = {}  # the weights of the last sampled batch, by trajectory key

    # -- the verdicts -------------------------------------------------------------------------------------
    def weigh_tag(self, tag: dict[str, Any], global_steps: int) -> TrajectoryWeight | None:
        """The plugin's verdict on one stored trajectory, from its version tags; None without tags (a row
        from another agent loop), which keeps it."""
        oldest, newest = tag.get("min_global_steps"), tag.get("max_global_steps")
        if oldest is None:
            return None
        current = max(global_steps - 1, int(oldest))  # never "newer than the policy": tags are lower bounds
        stub = trajectory_from_tensors([], [], [], [], int(oldest), int(newest if newest is not None else oldest))
        return self.plugins.weigh(stub, current)

    def _group_tags(self, partition_id: str) -> dict[str, list[dict[str, Any]]]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for key, tag in self.partitions[partition_id].items():
            groups.setdefault(key.split("_")[0], []).append(tag)
        return groups

    def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
        if self.mode not in _PLUGIN_MODES:
            return super()._stale_terminal_keys(global_steps, partition_id)
        if partition_id == "val":
            return set()
        groups = self._group_tags(partition_id)
        stale = set()
        for uid in self.finished_keys[partition_id]:
            verdicts = [self.weigh_tag(tag, global_steps) for tag in groups.get(uid, [])]
            if any(v is not None and v.sample == 0.0 for v in verdicts):  # GRPO compares whole groups
                stale.add(uid)
        return stale

    # -- sampling -----------------------------------------------------------------------------------------
    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        self.last_weights = {}
        if self.mode != "linear" or partition_id == "val" or not batch.keys:
            return batch, metrics
        weights = []
        for key, tag in zip(batch.keys, batch.tags):
            verdict = self.weigh_tag(tag, global_steps)
            weight = verdict.sample if verdict is not None else 1.0
            self.last_weights[key] = weight
            weights.append(torch.full((int(tag["response_len"]),), weight, dtype=torch.float32))
        nested = torch.nested.as_nested_tensor(weights, layout=torch.jagged)
        tq.kv_batch_put(
            keys=batch.keys,
            partition_id=partition_id,
            fields=TensorDict({WEIGHTS_FIELD: nested}, batch_size=len(batch.keys)),
        )
        values = list(self.last_weights.values())
        metrics["training/prorl_staleness/linear_weight/mean"] = sum(values) / len(values)
        metrics["training/prorl_staleness/linear_weight/min"] = min(values)
        return batch, metrics
