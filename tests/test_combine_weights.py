import pytest

from prorl_adapter.hooks.specs import TrajectoryWeight


def test_no_opinion_is_weight_one():
    combined = TrajectoryWeight.combine([None, None], 3)
    assert combined.sample == 1.0 and combined.tokens is None and combined.reasons == []


def test_sample_weights_multiply_and_token_weights_multiply_elementwise():
    combined = TrajectoryWeight.combine(
        [
            TrajectoryWeight(sample=0.5, reasons=["staleness 1 of K=2"]),
            TrajectoryWeight(tokens=[1.0, 2.0, 0.5]),
            None,
            TrajectoryWeight(sample=0.5, tokens=[2.0, 2.0, 2.0], reasons=["other"]),
        ],
        3,
    )
    assert combined.sample == 0.25
    assert combined.tokens == [2.0, 4.0, 1.0]
    assert combined.reasons == ["staleness 1 of K=2", "other"]


def test_a_zero_drops_whatever_else_says():
    assert TrajectoryWeight.combine([TrajectoryWeight(sample=3.0), TrajectoryWeight(sample=0.0)], 1).sample == 0.0


def test_token_weights_of_the_wrong_length_are_an_error():
    with pytest.raises(ValueError, match="2 token weights for 3 tokens"):
        TrajectoryWeight.combine([TrajectoryWeight(tokens=[1.0, 1.0])], 3)
