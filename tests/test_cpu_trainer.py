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


def test_an_episode_of_two_sequences_is_two_rows_with_one_advantage():
    """GRPO over episodes, not rows: a two-sequence episode counts once in its group's mean and std, and both
    its rows get its advantage; with one row per episode it is verl's own GRPO advantage."""
    from verl.trainer.ppo import core_algos

    from prorl_plugins.cpu_trainer.actor import episode_advantages
    from tests.test_batch_item import two_segment_trajectory

    def in_group(trajectory, **update):
        return item(trajectory.model_copy(update={"group": "g", **update}))

    split = in_group(two_segment_trajectory())  # reward 0.75
    plain = in_group(two_turn_trajectory(), reward=0.25, job_id="other")
    batch = pad_items([split, plain], pad_token_id=0)
    assert batch.last_step.tolist() == [False, True, True] and list(batch.groups) == ["g", "g", "g"]
    advantages = episode_advantages(batch, epsilon=1e-6)
    # Two episodes, rewards 0.75 and 0.25: mean 0.5, (unbiased) std 0.3536, so +-0.7071; the split episode's
    # second row does not make it count twice.
    for row, value in ((0, 0.7071), (1, 0.7071), (2, -0.7071)):
        policy = batch.response_mask[row].bool()
        assert torch.allclose(advantages[row][policy], torch.full((int(policy.sum()),), value), atol=1e-3)
        assert (advantages[row][~policy] == 0).all()
    one_row_each = pad_items([plain, in_group(two_turn_trajectory(), job_id="third")], pad_token_id=0)
    verl_own, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=one_row_each.token_level_rewards,
        response_mask=one_row_each.response_mask,
        index=one_row_each.groups,
        epsilon=1e-6,
    )
    assert torch.allclose(episode_advantages(one_row_each, epsilon=1e-6), verl_own)


def test_behaviour_importance_is_truncated_and_one_off_the_policy_tokens():
    from prorl_plugins.cpu_trainer.actor import behaviour_importance

    batch = pad_items([item(two_turn_trajectory((3, 4)))], pad_token_id=0)
    policy = batch.response_mask.bool()
    proximal = batch.behaviour_logprobs + torch.tensor([[0.1, 2.0, 5.0, -0.5, 5.0]])
    weights = behaviour_importance(batch, proximal, cap=2.0)
    expected = torch.tensor([[torch.e**0.1, 2.0, 1.0, torch.e**-0.5, 1.0]])  # tokens 2 and 4 are the tool's
    assert torch.allclose(weights, expected) and (weights[~policy] == 1).all()


def test_the_proximal_anchor_still_learns_from_a_token_the_behaviour_clip_has_spent():
    """A stale token whose probability has already risen past the clip since it was sampled: clipping around
    the behaviour policy gives it no gradient at all; the decoupled objective clips around the step's starting
    weights, so it learns from it, weighted by the (capped) importance ratio."""
    from prorl_plugins.cpu_trainer.actor import loss_config, policy_loss, ratio_anchor

    batch = pad_items([item(two_turn_trajectory((3, 4)))], pad_token_id=0)
    advantages = batch.response_mask.clone()  # a good episode: push every policy token up

    def gradient(anchor: str) -> torch.Tensor:
        logprobs = (batch.behaviour_logprobs + 0.5).requires_grad_()  # ratio e^0.5 = 1.65 against behaviour
        against = ratio_anchor(batch, logprobs.detach(), anchor, cap=2.0)
        loss, _ = policy_loss(batch, logprobs, against, advantages, loss_config(clip_ratio=0.2))
        loss.backward()
        return logprobs.grad[batch.response_mask.bool()]

    assert (gradient("behaviour") == 0).all()
    assert (gradient("proximal") < 0).all()  # descending the loss raises each token's logprob


def test_a_trainer_that_cannot_start_says_why_in_one_line_naming_the_log_it_kept(tmp_path):
    """The real failure path: the vLLM script finds no vLLM environment (VLLM_VENV names none), so vLLM exits at
    once; the trainer says which server, its status and the log, which is kept under --out."""
    import os
    import subprocess
    import sys

    from prorl_adapter.dev import localstack

    if not localstack.VLLM_PYTHON.exists() or not (localstack.TINY_MODEL / "config.json").exists():
        pytest.skip("needs the vLLM environment and the tiny model (make llm): the model is built before vLLM starts")
    out = tmp_path / "run"
    env = {**os.environ, "VLLM_VENV": str(tmp_path / "no-venv")}
    argv = [sys.executable, "-m", "prorl_plugins.cpu_trainer.cli", "--steps", "1", "--out", str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    log = out / "logs" / "vllm.log"
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"prorl-train-cpu: cannot start: vLLM exited with status 1 (log: {log}; its last line:")
    assert "no vLLM venv at" in line and "no vLLM venv at" in log.read_text()

    wrong = subprocess.run([*argv[:3], "--steps", "many"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and len(wrong.stderr.splitlines()) == 1 and "--steps" in wrong.stderr
