"""What every training backend derives alike from a weighed trajectory (`BatchItem`): loss weights, per-token
versions from each turn's span, truncation, the GRPO group; and the trainer-side helpers beside it."""

from prorl_adapter.models import BatchItem, JobRequest, Resumption, Trajectory, TrajectoryWeight, Turn
from prorl_adapter.trainer.samples import group_neutral_rewards, job_request, trajectory_from_tensors


def item(trajectory, weight=None):
    return BatchItem(id=trajectory.job_id, trajectory=trajectory, weight=weight or TrajectoryWeight())


def two_turn_trajectory(versions=(3, 4)):
    # policy [5, 6], tool [7], policy [8], tool [9]
    trajectory = trajectory_from_tensors(
        prompt_ids=[1, 2],
        response_ids=[5, 6, 7, 8, 9],
        response_mask=[1, 1, 0, 1, 0],
        response_logprobs=[-0.5, -0.25, 0.0, -1.0, 0.0],
        policy_version_min=min(versions),
        policy_version_max=max(versions),
        reward=0.75,
    )
    turns = [
        Turn(
            index=i,
            policy_version=v,
            llm_server="s",
            response_start=start,
            response_tokens=n,
            finish_reason="stop",
            text="",
        )
        for i, (v, start, n) in enumerate(zip(versions, (0, 3), (2, 1)))
    ]
    return trajectory.model_copy(update={"turns": turns, "num_turns": 2})


def test_token_versions_follow_the_turn_spans():
    sample = item(two_turn_trajectory((3, 4)))
    assert sample.token_versions() == [3, 3, None, 4, None]


def test_token_versions_without_turns_fall_back_to_the_oldest_version():
    # a trajectory rebuilt from a trainer's tensors (verl's sampler) has no turns
    sample = item(two_turn_trajectory((3, 4)).model_copy(update={"turns": []}))
    assert sample.token_versions() == [3, 3, None, 3, None]


def test_loss_weights_are_sample_times_token_weight():
    weight = TrajectoryWeight(sample=0.5, tokens=[1.0, 2.0, 1.0, 0.5, 1.0])
    sample = item(two_turn_trajectory(), weight)
    assert sample.loss_weights() == [0.5, 1.0, 0.5, 0.25, 0.5]
    assert item(two_turn_trajectory()).loss_weights() == [1.0] * 5


def test_truncation_cuts_every_aligned_list_and_keeps_the_reward():
    weight = TrajectoryWeight(sample=0.5, tokens=[1.0, 2.0, 1.0, 0.5, 1.0])
    sample = item(two_turn_trajectory(), weight).truncated(3)
    t = sample.trajectory
    assert t.response_ids == [5, 6, 7] and t.response_mask == [1, 1, 0]
    assert t.response_logprobs == [-0.5, -0.25, 0.0] and sample.weight.tokens == [1.0, 2.0, 1.0]
    assert t.reward == 0.75 and sample.weight.sample == 0.5
    assert sample.token_versions() == [3, 3, None]  # the second turn's span lies past the cut


def test_group_is_the_one_a_backend_set_else_the_instance():
    request = job_request("relay", {"word": "red"}, group="prompt-7", sampling={"max_tokens": 8})
    assert request.group == "prompt-7" and request.sampling.max_tokens == 8
    trajectory = two_turn_trajectory().model_copy(update={"group": "prompt-7"})
    assert item(trajectory).group == "prompt-7"
    unlabelled = two_turn_trajectory().model_copy(update={"instance_id": "i-1", "task": "relay"})
    assert item(unlabelled).group == "relay:i-1"
    # A label is the client's own: one named `group` groups nothing, there and back through JSON (Redis).
    own = unlabelled.model_copy(update={"labels": {"group": "mine"}})
    assert item(Trajectory.model_validate_json(own.model_dump_json())).group == "relay:i-1"


def test_what_an_earlier_version_wrote_is_read_with_its_group_and_run():
    """Redis outlives an upgrade: a trajectory or prompt written when the group and a retried prompt's run were
    labels is read back with the typed fields."""
    earlier = two_turn_trajectory().model_dump(exclude={"group", "attempt", "retry_of"})
    earlier["labels"] = {"group": "prompt-7", "prorl_prompt": "p0", "prorl_attempt": "2"}
    trajectory = Trajectory.model_validate(earlier)
    assert (item(trajectory).group, trajectory.attempt, trajectory.retry_of) == ("prompt-7", 2, "p0")
    prompt = JobRequest.model_validate({"task": "t", "labels": {"prorl_prompt": "p0", "prorl_attempt": "3"}})
    assert (prompt.attempt, prompt.retry_of, prompt.group) == (3, "p0", None)


def test_untrainable_samples_get_their_groups_trainable_mean():
    def sample(reward, group, weight=1.0, failed=False):
        trajectory = two_turn_trajectory().model_copy(update={"reward": reward, "group": group, "filter": failed})
        return item(trajectory, TrajectoryWeight(sample=weight))

    samples = [sample(1.0, "a"), sample(0.0, "a"), sample(1.0, "a", weight=0.0), sample(0.0, "a", failed=True)]
    samples.append(sample(1.0, "b", weight=0.0))  # a group with nothing trainable
    assert group_neutral_rewards(samples) == [1.0, 0.0, 0.5, 0.5, 0.0]


def two_segment_trajectory():
    """Turn 0 in the trajectory's own fields; turn 1 in a second sequence (a harness rewrote its history)."""
    from prorl_adapter.models import Segment

    t = two_turn_trajectory((3, 4))
    second = t.turns[1].model_copy(update={"segment": 1, "response_start": 0, "response_tokens": 2})
    segment = Segment(prompt_ids=[1, 7], response_ids=[11, 12], response_mask=[1, 1], response_logprobs=[-0.1, -0.2])
    return t.model_copy(update={"turns": [t.turns[0], second], "segments": [segment]})


def test_segment_items_are_one_per_sequence_with_the_episodes_reward_and_their_own_turns():
    weight = TrajectoryWeight(sample=0.5, tokens=[1.0, 2.0, 1.0, 0.5, 1.0])
    first, second = item(two_segment_trajectory(), weight).segment_items()
    assert (first.trajectory.prompt_ids, first.trajectory.response_ids) == ([1, 2], [5, 6, 7, 8, 9])
    assert (second.trajectory.prompt_ids, second.trajectory.response_ids) == ([1, 7], [11, 12])
    assert second.trajectory.segments == [] and [t.segment for t in second.trajectory.turns] == [0]
    assert second.token_versions() == [4, 4]  # its own turn's span, now in its own fields
    assert {first.trajectory.reward, second.trajectory.reward} == {0.75} and first.group == second.group
    # The token weights are aligned with the first sequence; the second keeps the sample weight only.
    assert first.loss_weights() == [0.5, 1.0, 0.5, 0.25, 0.5] and second.loss_weights() == [0.5, 0.5]
    assert item(two_turn_trajectory()).segment_items()[0].trajectory == two_turn_trajectory()


def test_token_versions_of_a_resumed_turn_change_where_it_was_resumed():
    trajectory = two_turn_trajectory((3, 5))
    first = trajectory.turns[0].model_copy(update={"resumptions": [Resumption(offset=1, policy_version=4)]})
    resumed = trajectory.model_copy(update={"turns": [first, trajectory.turns[1]]})
    assert item(resumed).token_versions() == [3, 4, None, 5, None]
    assert first.versions() == [3, 4]
