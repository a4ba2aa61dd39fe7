"""Training samples as the padded tensors the CPU trainer's actor and verl's `core_algos` consume.

This is the CPU backend's `prorl_backend_batch`: verl's and SkyRL's backends build their own batch types from
the same `BatchItem`s. An episode of several token sequences (an agent program that rewrote its history,
`BatchItem.segment_items`) is one row per sequence, its rows next to each other with `last_step` on the last,
as SkyRL lays out step-wise trajectories: the episode's advantage is computed once and given to all its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prorl_adapter.models import BatchItem

from .constrained import FiniteActionMask


@dataclass
class PaddedBatch:
    """Prompt and response of each sample laid out in one right-padded row (so position ids are plain
    0..n-1 and match the server's); response tensors are [batch, max response length]."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_positions: torch.Tensor  # [B, R]: where each response token sits in input_ids (0 on padding)
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] float: 1 = policy token
    behaviour_logprobs: torch.Tensor  # [B, R]: what the server reported when it sampled
    loss_weights: torch.Tensor  # [B, R]: the staleness verdict (sample x token weights)
    token_level_rewards: torch.Tensor  # [B, R]: the shaped reward on each sample's last response token
    token_versions: torch.Tensor  # [B, R]: the policy version that sampled each token, -1 elsewhere
    groups: np.ndarray  # [B] GRPO group of each sample
    last_step: torch.Tensor  # [B] bool: the row is its episode's last sequence (one row per episode: all True)
    # [B, R, V]: the grammar's allowed tokens at each policy position; None: no grammar, the plain softmax
    allowed: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def policy_tokens(self) -> int:
        return int(self.response_mask.sum())

    def select(self, rows: Sequence[int]) -> PaddedBatch:
        """The batch of `rows` only, its padding cut to the longest of them (a micro-batch: the same tensors of
        those rows, so the loss of the micro-batches, each weighted by its share of policy tokens, is the
        batch's)."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        length = max(int(self.attention_mask[index].sum(1).max()), 1)
        width = max(int((self.response_positions[index] > 0).sum(1).max()), 1)
        return PaddedBatch(
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            response_positions=self.response_positions[index, :width],
            response_ids=self.response_ids[index, :width],
            response_mask=self.response_mask[index, :width],
            behaviour_logprobs=self.behaviour_logprobs[index, :width],
            loss_weights=self.loss_weights[index, :width],
            token_level_rewards=self.token_level_rewards[index, :width],
            token_versions=self.token_versions[index, :width],
            groups=self.groups[index.numpy()],
            last_step=self.last_step[index],
            allowed=None if self.allowed is None else self.allowed[index, :width],
        )


def pad_items(
    items: Sequence[BatchItem],
    pad_token_id: int,
    action_mask: FiniteActionMask | None = None,
) -> PaddedBatch:
    if not items:
        raise ValueError("no samples to pad")
    episodes = [item.segment_items() for item in items]
    last_step = torch.tensor([k == len(rows) - 1 for rows in episodes for k in range(len(rows))])
    items = [row for rows in episodes for row in rows]
    trajectories = [i.trajectory for i in items]
    batch, length = len(items), max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    width = max(len(t.response_ids) for t in trajectories)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    positions = torch.zeros((batch, width), dtype=torch.long)
    response_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    floats = {name: torch.zeros((batch, width)) for name in ("mask", "logprobs", "weights", "rewards")}
    versions = torch.full((batch, width), -1, dtype=torch.long)
    allowed = None
    if action_mask is not None:
        allowed = torch.ones((batch, width, action_mask.vocab_size), dtype=torch.bool)
    for row, (item, t) in enumerate(zip(items, trajectories)):
        prompt, response = len(t.prompt_ids), len(t.response_ids)
        input_ids[row, : prompt + response] = torch.tensor(t.prompt_ids + t.response_ids)
        attention_mask[row, : prompt + response] = 1
        positions[row, :response] = torch.arange(prompt, prompt + response)
        response_ids[row, :response] = torch.tensor(t.response_ids)
        floats["mask"][row, :response] = torch.tensor(t.response_mask, dtype=torch.float32)
        floats["logprobs"][row, :response] = torch.tensor(t.response_logprobs)
        floats["weights"][row, :response] = torch.tensor(item.loss_weights())
        if response:
            floats["rewards"][row, response - 1] = t.reward
        versions[row, :response] = torch.tensor([-1 if v is None else v for v in item.token_versions()])
        if action_mask is not None:
            for turn in t.turns:  # each turn's grammar, over the tokens the policy sampled in it
                start, end = turn.response_start, min(turn.response_start + turn.response_tokens, response)
                allowed[row, start:end] = action_mask.turn_masks(t.response_ids[start:end])
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_positions=positions,
        response_ids=response_ids,
        response_mask=floats["mask"],
        behaviour_logprobs=floats["logprobs"],
        loss_weights=floats["weights"],
        token_level_rewards=floats["rewards"],
        token_versions=versions,
        groups=np.array([i.group for i in items], dtype=object),
        last_step=last_step,
        allowed=allowed,
    )
