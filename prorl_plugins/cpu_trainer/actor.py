"""The CPU trainer's actor: the same tiny model the vLLM server serves, in torch, updated with verl's own
GRPO advantage and clipped policy loss (`verl.trainer.ppo.core_algos`)."""

from __future__ import annotations

import copy
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


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TorchActor:
    """The policy in torch. Full fine-tuning, or LoRA adapters of rank `lora_rank` on every attention and MLP
    projection (peft); either way `save` writes the plain model's full weights (LoRA merged into a copy), which
    is what vLLM serves and reloads. `micro_batch_rows` bounds the rows of one forward/backward pass."""

    def __init__(
        self,
        model_dir: Path,
        learning_rate: float,
        clip_ratio: float = 0.2,
        seed: int = 0,
        anchor: str = "proximal",
        importance_cap: float = 2.0,
        micro_batch_rows: int | None = None,
        lora_rank: int = 0,
        lora_alpha: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        if anchor not in ANCHORS:
            raise ValueError(f"anchor {anchor!r}: one of {', '.join(ANCHORS)}")
        if micro_batch_rows is not None and micro_batch_rows < 1:
            raise ValueError(f"micro_batch_rows must be >= 1 (or None for the whole batch): {micro_batch_rows}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the policy is softmax(logits / temperature)): {temperature}")
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning): {lora_rank}")
        self.anchor, self.importance_cap = anchor, importance_cap
        self.micro_batch_rows = micro_batch_rows
        self.lora_rank = lora_rank
        self.temperature = temperature
        torch.manual_seed(seed)
        transformers_logging.disable_progress_bar()  # a bar per weight save would bury the training's own
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
            )
            self.model = get_peft_model(self.model, lora)
        self.model.train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0)
        self.loss_config = loss_config(clip_ratio)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def logprobs(self, batch: PaddedBatch, constrained: bool = True) -> torch.Tensor:
        """[B, R] logprobs of the response tokens under the policy the server sampled from: softmax(logits / T),
        under the grammar's mask where the batch has one. Zero on
        non-policy tokens. Logits are made only from the first response token on (`logits_to_keep`): over a
        49,152-token vocabulary the prompt's would be most of the memory."""
        first = int(batch.response_positions[:, 0].min()) if batch.response_positions.numel() else 1
        first = max(first, 1)
        keep = torch.arange(first - 1, batch.input_ids.shape[1] - 1)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep).logits
        # The logits at position p predict the token at p + 1; kept position k is position first - 1 + k.
        index = (batch.response_positions - first).clamp(min=0)
        logits = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        if self.temperature != 1.0:
            logits = logits / self.temperature
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

    def micro_batches(self, batch: PaddedBatch) -> list[list[int]]:
        """The rows of each forward/backward pass: the whole batch, or `micro_batch_rows` rows at a time, rows of
        like length together (less padding)."""
        rows = len(batch)
        if self.micro_batch_rows is None or self.micro_batch_rows >= rows:
            return [list(range(rows))]
        order = batch.attention_mask.sum(1).argsort(stable=True).tolist()
        return [order[i : i + self.micro_batch_rows] for i in range(0, rows, self.micro_batch_rows)]

    def update(self, batch: PaddedBatch, epochs: int = 1, epsilon: float = 1e-6) -> tuple[UpdateStats, torch.Tensor]:
        """One GRPO step (`epochs` optimizer steps on the batch); also returns the logprobs before it, under the
        weights the server has now. The PPO ratio's denominator is the anchor's: the proximal policy (these
        weights, with behaviour importance weights: `behaviour_importance`) or the behaviour logprobs the server
        reported (`ratio_anchor`, `policy_loss`).

        Advantages come from the whole batch (GRPO's groups span micro-batches); each micro-batch's token-mean
        loss is weighted by its share of the batch's policy tokens, so the accumulated gradient is the whole
        batch's token-mean gradient."""
        advantages = episode_advantages(batch, epsilon)
        groups = self.micro_batches(batch)
        parts = [(rows, batch.select(rows) if len(groups) > 1 else batch) for rows in groups]
        total_tokens = max(batch.policy_tokens, 1)
        before = torch.zeros_like(batch.behaviour_logprobs)
        importance = torch.ones_like(batch.behaviour_logprobs)
        anchors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        for epoch in range(epochs):  # PPO epochs: the clipped ratio keeps repeated steps on one batch safe
            self.optimizer.zero_grad()
            loss_sum, metric_sums = 0.0, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0}
            for k, (rows, part) in enumerate(parts):
                share = part.policy_tokens / total_tokens
                logprobs = self.logprobs(part)
                if epoch == 0:  # the first epoch's forward pass is the proximal policy's: no extra pass
                    anchors[k] = ratio_anchor(part, logprobs.detach(), self.anchor, self.importance_cap)
                    width = logprobs.shape[1]
                    before[rows, :width] = logprobs.detach()
                    importance[rows, :width] = anchors[k][1]
                width = logprobs.shape[1]
                loss, metrics = policy_loss(part, logprobs, anchors[k], advantages[rows, :width], self.loss_config)
                (loss * share).backward()
                loss_sum += float(loss.detach()) * share
                for name in metric_sums:
                    metric_sums[name] += metrics[name] * share
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            self.optimizer.step()
        policy = batch.response_mask.bool()
        stats = UpdateStats(
            pg_loss=loss_sum,
            clip_fraction=metric_sums["actor/pg_clipfrac"],
            ppo_kl=metric_sums["actor/ppo_kl"],
            grad_norm=float(grad_norm),
            advantage_abs_mean=float(advantages[policy].abs().mean()) if policy.any() else 0.0,
            importance_weight_mean=float(importance[policy].mean()) if policy.any() else 1.0,
        )
        return stats, before

    def save(self, directory: Path) -> Path:
        """The full weights of the plain model (what vLLM serves): LoRA adapters merged into a copy, so the
        adapters go on training separately."""
        model = self.model
        if self.lora_rank:
            model = copy.deepcopy(self.model).merge_and_unload()
        model.save_pretrained(directory, safe_serialization=True)
        return directory


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).bool()
