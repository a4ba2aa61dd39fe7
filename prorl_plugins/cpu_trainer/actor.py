"""The CPU trainer's actor: the same tiny model the vLLM server serves, in torch, updated with verl's own
GRPO advantage and clipped policy loss (`verl.trainer.ppo.core_algos`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from .batch import PaddedBatch


@dataclass
class UpdateStats:
    pg_loss: float
    clip_fraction: float
    ppo_kl: float
    grad_norm: float
    advantage_abs_mean: float
    importance_weight_mean: float  # mean behaviour importance weight on policy tokens (1.0 under the behaviour anchor)


def episode_advantages(batch: PaddedBatch, epsilon: float) -> torch.Tensor:
    """GRPO advantages, one per episode, on every policy token of each of its rows: computed by verl's estimator
    over the episodes' last rows (an all-ones mask makes it return the scalar at every position), then given to
    each row of the episode (SkyRL's step-wise rule), so an episode of several sequences counts once in its
    group's statistics. With one row per episode it is verl's GRPO advantage exactly."""
    last = batch.last_step
    per_episode, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=batch.token_level_rewards[last],
        response_mask=torch.ones_like(batch.response_mask[last]),
        index=batch.groups[last.numpy()],
        epsilon=epsilon,
    )
    episode_of_row = torch.cat([torch.tensor([0]), last[:-1].long()]).cumsum(0)
    return per_episode[episode_of_row] * batch.response_mask


ANCHORS = ("proximal", "behaviour")


def behaviour_importance(batch: PaddedBatch, proximal: torch.Tensor, cap: float) -> torch.Tensor:
    """[B, R] the behaviour importance weights of the decoupled PPO objective (AReaL, Fu et al. 2025):
    min(cap, pi_proximal / pi_behaviour) on the policy's tokens, 1.0 elsewhere. The objective clips around the
    proximal policy (the weights this step starts from) and corrects with these weights for the policy that
    sampled each token, as verl does with a recomputed `old_log_prob` and its `rollout_is` weights. The
    truncation is the staleness plugin's `importance` rule, on tensors here because the trainer has its
    logprobs only once it holds the batch.

    Why not clip around the behaviour policy: a token sampled K versions ago, by a policy the trainer has since
    moved away from, starts the step with a ratio already away from 1. The clip then spends its room on the
    distance already travelled and zeroes the gradient of tokens that moved the advantage's way, so each step
    learns less the staler its batch. At staleness 0 the two anchors differ only by the trainer's and the
    server's disagreement on a token (`logprob_gap`, at most 3e-5 in bench_training's coupled runs), so a coupled
    run trains the same under either."""
    ratio = torch.exp(proximal - batch.behaviour_logprobs).clamp(max=cap)
    return torch.where(batch.response_mask.bool(), ratio, torch.ones_like(ratio))


def ratio_anchor(
    batch: PaddedBatch, proximal: torch.Tensor, anchor: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the PPO ratio's denominator, the per-token importance weights) under `anchor` (`ANCHORS`)."""
    if anchor == "proximal":
        return proximal, behaviour_importance(batch, proximal, cap)
    return batch.behaviour_logprobs, torch.ones_like(proximal)


def loss_config(clip_ratio: float) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,  # unused by the loss; verl validates it
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio,
        clip_ratio_high=clip_ratio,
    )


def policy_loss(
    batch: PaddedBatch,
    logprobs: torch.Tensor,
    anchor: tuple[torch.Tensor, torch.Tensor],
    advantages: torch.Tensor,
    config: ActorConfig,
) -> tuple[torch.Tensor, dict]:
    """verl's clipped policy loss against `anchor` (`ratio_anchor`), the staleness plugin's weights times the
    importance weights as its per-token `rollout_is_weights`."""
    old_log_prob, importance = anchor
    return core_algos.compute_policy_loss_vanilla(
        old_log_prob=old_log_prob,
        log_prob=logprobs,
        advantages=advantages,
        response_mask=batch.response_mask,
        loss_agg_mode="token-mean",
        config=config,
        rollout_is_weights=batch.loss_weights * importance,
    )


class TorchActor:
    def __init__(
        self,
        model_dir: Path,
        learning_rate: float,
        clip_ratio: float = 0.2,
        seed: int = 0,
        anchor: str = "proximal",
        importance_cap: float = 2.0,
    ) -> None:
        if anchor not in ANCHORS:
            raise ValueError(f"anchor {anchor!r}: one of {', '.join(ANCHORS)}")
        self.anchor, self.importance_cap = anchor, importance_cap
        torch.manual_seed(seed)
        transformers_logging.disable_progress_bar()  # a bar per weight save would bury the training's own
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0)
        self.loss_config = loss_config(clip_ratio)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def logprobs(self, batch: PaddedBatch, constrained: bool = True) -> torch.Tensor:
        """[B, R] logprobs of the response tokens; under the grammar's mask where the batch has one (the policy
        the server sampled from). Zero on non-policy tokens."""
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        # The logits at position p predict the token at p + 1.
        index = (batch.response_positions - 1).clamp(min=0)
        logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        if constrained and batch.allowed is not None:
            allowed = batch.allowed | _one_hot(batch.response_ids, logits.shape[-1])  # never -inf on a sampled token
            logits = logits.masked_fill(~allowed, float("-inf"))
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        return logprobs * batch.response_mask

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Unconstrained logprobs of tokens 1..n of one sequence (the weight-sync probe)."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([token_ids])).logits[0, :-1]
        return (
            torch.log_softmax(logits.float(), -1)
            .gather(-1, torch.tensor(token_ids[1:]).unsqueeze(-1))
            .squeeze(-1)
            .tolist()
        )

    def update(self, batch: PaddedBatch, epochs: int = 1, epsilon: float = 1e-6) -> tuple[UpdateStats, torch.Tensor]:
        """One GRPO step (`epochs` optimizer steps on the batch); also returns the logprobs before it, under the
        weights the server has now. The PPO ratio's denominator is the anchor's: the proximal policy (these
        weights, with behaviour importance weights: `behaviour_importance`) or the behaviour logprobs the server
        reported (`ratio_anchor`, `policy_loss`)."""
        advantages = episode_advantages(batch, epsilon)
        before = anchor = None
        for _ in range(epochs):  # PPO epochs: the clipped ratio keeps repeated steps on one batch safe
            self.optimizer.zero_grad()
            logprobs = self.logprobs(batch)
            if before is None:  # the first epoch's forward pass is the proximal policy's: no extra pass
                before = logprobs.detach()
                anchor = ratio_anchor(batch, before, self.anchor, self.importance_cap)
            loss, metrics = policy_loss(batch, logprobs, anchor, advantages, self.loss_config)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        policy = batch.response_mask.bool()
        stats = UpdateStats(
            pg_loss=float(loss.detach()),
            clip_fraction=metrics["actor/pg_clipfrac"],
            ppo_kl=metrics["actor/ppo_kl"],
            grad_norm=float(grad_norm),
            advantage_abs_mean=float(advantages[policy].abs().mean()) if policy.any() else 0.0,
            importance_weight_mean=float(anchor[1][policy].mean()) if policy.any() else 1.0,
        )
        return stats, before

    def save(self, directory: Path) -> Path:
        self.model.save_pretrained(directory, safe_serialization=True)
        return directory


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).bool()
