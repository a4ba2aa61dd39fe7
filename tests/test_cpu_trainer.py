"""The CPU trainer's pieces that need no server: the grammar mask it rebuilds and the padded batch."""

import pytest
import torch

pytest.importorskip("verl", reason="the CPU trainer uses verl's core_algos: install the project's [train] extra")

from prorl_adapter.models import TrajectoryWeight
from prorl_plugins.cpu_trainer.batch import pad_items
from prorl_plugins.cpu_trainer.constrained import FiniteActionMask
from tests.test_batch_item import item, two_turn_trajectory

# token id -> text; 0 is a special token (None), 1 is the stop token
TEXTS = [None, None, "a", "b", "ab", "c", "abc"]
STOP = 1


def allowed_ids(mask: torch.Tensor) -> set[int]:
    return {int(i) for i in mask.nonzero().flatten()}


def test_a_token_is_allowed_iff_it_keeps_the_text_on_an_action():
    mask = FiniteActionMask(["ab", "abc"], TEXTS, [STOP])
    assert allowed_ids(mask.allowed_after("")) == {2, 4, 6}  # "a", "ab", "abc"; not "b" or "c"
    assert allowed_ids(mask.allowed_after("a")) == {3}  # only "b" continues an action
    assert allowed_ids(mask.allowed_after("ab")) == {5, STOP}  # "ab" is complete: stop, or go on to "abc"
    assert allowed_ids(mask.allowed_after("abc")) == {STOP}


def test_special_tokens_are_never_allowed_and_turn_masks_follow_the_prefix():
    mask = FiniteActionMask(["ab"], TEXTS, [STOP])
    turn = mask.turn_masks([2, 3, STOP])  # the sampled turn: "a", "b", then the stop token
    assert [allowed_ids(m) for m in turn] == [{2, 4}, {3}, {STOP}]
    assert not turn[:, 0].any()


def test_padded_batch_puts_the_reward_on_the_last_token_and_tags_versions():
    heavy = item(two_turn_trajectory((3, 4)), TrajectoryWeight(sample=0.5))
    short = item(two_turn_trajectory((4, 4))).truncated(2)
    batch = pad_items([heavy, short], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 5, 6, 7, 8, 9], [1, 2, 5, 6, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    assert batch.response_positions[0].tolist() == [2, 3, 4, 5, 6]
    assert batch.token_level_rewards.tolist() == [[0, 0, 0, 0, 0.75], [0, 0.75, 0, 0, 0]]
    assert batch.token_versions.tolist() == [[3, 3, -1, 4, -1], [4, 4, -1, -1, -1]]
    assert batch.loss_weights.tolist() == [[0.5] * 5, [1, 1, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]]
