"""`PluginSet.weigh`: every plugin's `prorl_trajectory_weight` verdict on one trajectory, combined (sample weights
multiply, token weights multiply element-wise, reasons are kept in the order the plugins answer)."""

from __future__ import annotations

import pytest

from prorl_adapter.hooks import PluginSet, hookimpl
from prorl_adapter.models import Trajectory, TrajectoryWeight
from prorl_adapter.trainer.samples import trajectory_from_tensors


class Verdict:
    """Answers `prorl_trajectory_weight` with a fixed weight (None: no opinion), and records what it was asked."""

    def __init__(self, weight: TrajectoryWeight | None) -> None:
        self.weight = weight
        self.asked: list[tuple[int, list[float] | None]] = []

    @hookimpl
    def prorl_trajectory_weight(
        self, trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None
    ) -> TrajectoryWeight | None:
        self.asked.append((current_version, current_logprobs))
        return self.weight


def weigh(*weights: TrajectoryWeight | None, tokens: int = 3) -> TrajectoryWeight:
    """The combined verdict of one plugin per weight; pluggy asks the plugin registered last first, so the
    plugins are registered in reverse and answer in the order given."""
    plugins = PluginSet.load(objects=[Verdict(w) for w in reversed(weights)], entry_points=False)
    trajectory = trajectory_from_tensors([1], list(range(tokens)), [1] * tokens, [0.0] * tokens, 0, 0)
    return plugins.weigh(trajectory, current_version=0)


def test_no_opinion_is_weight_one():
    for combined in (weigh(None, None), weigh()):
        assert combined.sample == 1.0 and combined.tokens is None and combined.reasons == []


def test_sample_weights_multiply_and_token_weights_multiply_elementwise():
    combined = weigh(
        TrajectoryWeight(sample=0.5, reasons=["staleness 1 of K=2"]),
        TrajectoryWeight(tokens=[1.0, 2.0, 0.5]),
        None,
        TrajectoryWeight(sample=0.5, tokens=[2.0, 2.0, 2.0], reasons=["other"]),
    )
    assert combined.sample == 0.25
    assert combined.tokens == [2.0, 4.0, 1.0]
    assert combined.reasons == ["staleness 1 of K=2", "other"]


def test_a_zero_drops_whatever_else_says():
    assert weigh(TrajectoryWeight(sample=3.0), TrajectoryWeight(sample=0.0), tokens=1).sample == 0.0


def test_token_weights_of_the_wrong_length_are_an_error():
    with pytest.raises(ValueError, match="2 token weights for 3 tokens"):
        weigh(TrajectoryWeight(tokens=[1.0, 1.0]))


def test_every_plugin_is_asked_with_the_version_and_the_trainers_logprobs():
    first, second = Verdict(None), Verdict(TrajectoryWeight(sample=0.5))
    plugins = PluginSet.load(objects=[first, second], entry_points=False)
    trajectory = trajectory_from_tensors([1], [2, 3], [1, 1], [-1.0, -1.0], 4, 4)
    assert plugins.weigh(trajectory, 6, [-0.5, -2.0]).sample == 0.5
    assert plugins.weigh(trajectory, 7).sample == 0.5  # without logprobs: the plugins get None
    assert first.asked == second.asked == [(6, [-0.5, -2.0]), (7, None)]
