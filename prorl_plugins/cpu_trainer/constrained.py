"""The policy that structured outputs actually sample from, rebuilt on the trainer's side.

vLLM applies the grammar's token mask to the logits before it computes logprobs, so the behaviour logprobs it
returns are those of the constrained policy (a forced token has logprob 0.0). A trainer that scored the same
tokens with the unconstrained softmax would see a ratio far from 1 on every token, and a logprob gap that
says nothing about whether its weights reached the server. For a finite action set (every turn is exactly
one of a few strings, as `relay_regex` makes it) the mask is simple to rebuild: after a turn's text so far,
a token is allowed iff appending its text still leads to one of the strings, and the end-of-turn token iff
the text is one of them. Rebuilt here rather than taken from a grammar library because the finite case is a
few lines, and it must agree with vLLM's grammar backend token for token (the logprob gap checks that).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch


class FiniteActionMask:
    """Allowed next tokens of a turn whose text must be exactly one of `actions`."""

    def __init__(self, actions: Sequence[str], token_texts: Sequence[str | None], stop_token_ids: Sequence[int]):
        # token_texts[i]: the text token i adds, or None for special tokens (never allowed by a grammar)
        self.actions = tuple(actions)
        self.stop_token_ids = tuple(stop_token_ids)
        self.vocab_size = len(token_texts)
        self.token_texts = list(token_texts)
        self._texts = [(i, text) for i, text in enumerate(token_texts) if text]
        self.allowed_after = lru_cache(maxsize=4096)(self._allowed_after)

    @classmethod
    def for_tokenizer(cls, actions: Sequence[str], tokenizer, vocab_size: int) -> FiniteActionMask:
        special = set(tokenizer.all_special_ids)
        texts: list[str | None] = [None] * vocab_size
        for token_id in range(min(vocab_size, len(tokenizer))):
            if token_id not in special:
                texts[token_id] = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        return cls(actions, texts, [tokenizer.eos_token_id])

    def _allowed_after(self, prefix: str) -> torch.Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        open_actions = [a for a in self.actions if a.startswith(prefix)]
        for token_id, text in self._texts:
            candidate = prefix + text
            if any(action.startswith(candidate) for action in open_actions):
                allowed[token_id] = True
        if prefix in self.actions:
            allowed[list(self.stop_token_ids)] = True
        return allowed

    def turn_masks(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[len(turn), vocab] masks for one sampled turn: before each token, what the text so far allows."""
        masks, prefix = [], ""
        for token_id in token_ids:
            masks.append(self.allowed_after(prefix))
            prefix += self.token_texts[token_id] or ""
        return torch.stack(masks) if masks else torch.zeros(0, self.vocab_size, dtype=torch.bool)
