"""The agent loop (`run_episode`) turn by turn: when an episode ends (finish, no tool call, max turns, a full
context), what it makes of tool calls it cannot run, and how the policy's tokens and the tools' tokens are laid
out. A real LLMPool and a real sandbox Environment talk to the in-process stand-ins (tests/fakes); the task is a
minimal handler written here."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_adapter.models import JobRequest, SamplingParams
from prorl_adapter.service.agent import MAX_OBSERVATION_CHARS, PromptTooLong
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.service.weight_barrier import WeightBarrier
from prorl_adapter.tasks import EpisodeState, TaskHandler
from tests.fakes import EpisodeRig, Reply, ScriptedLLM, bash_call, episode_rig, finish_call, on_virtual_time, tool_call


class _VersionPerRequest(MemoryCoordination):
    """A policy version that moves on with every request the LLM stand-in has seen."""

    def __init__(self, llm: ScriptedLLM) -> None:
        super().__init__("test")
        self._llm = llm

    @property
    def version(self) -> int:
        return 10 + len(self._llm.requests)


class Goal(TaskHandler):
    """The default tools (bash, finish), a short prompt, and an eval that is never called here."""

    name = "goal"

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "You are tested."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return "Reach the goal."

    async def evaluate(self, env: Any, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        raise AssertionError("the agent loop never evaluates")


def request(**fields: Any) -> JobRequest:
    return JobRequest(task="goal", **fields)


def policy_spans(episode: Any) -> list[list[int]]:
    """The response split into runs of equal mask: [policy ids, tool ids, policy ids, ...]."""
    spans: list[list[int]] = []
    for index, (token, mask) in enumerate(zip(episode.response_ids, episode.response_mask)):
        if index == 0 or mask != episode.response_mask[index - 1]:
            spans.append([])
        spans[-1].append(token)
    return spans


async def prompt_length(rig: EpisodeRig) -> int:
    """How long the episode's prompt is (the stand-in's first request carries it)."""
    rig.llm.cue("no tool call")
    episode = await rig.run(request(max_turns=1), Goal())
    return len(episode.prompt_ids)


@on_virtual_time
async def test_an_episode_ends_at_max_turns_after_the_last_turns_tool_results():
    async with episode_rig([bash_call(f"echo {i}") for i in range(5)]) as rig:
        episode = await rig.run(request(max_turns=3), Goal())
    assert (episode.finish_reason, len(episode.turns)) == ("max_turns", 3)
    assert episode.state.commands == ["echo 0", "echo 1", "echo 2"]
    assert [turn.observation for turn in episode.turns] == [f"{i}\n[exit code 0]" for i in range(3)]
    assert [op for op in rig.sandbox.ops() if op == "exec"] == ["exec"] * 3
    # The last turn's tools ran (eval sees what they did), but no turn reads their results: not appended.
    assert episode.response_mask[-1] == 1 and episode.turns[-1].observation_tokens == 0


@on_virtual_time
async def test_a_turn_without_a_tool_call_ends_the_episode():
    async with episode_rig(["The answer is 4.", bash_call("echo never")]) as rig:
        episode = await rig.run(request(), Goal())
    assert (episode.finish_reason, len(episode.turns)) == ("no_tool_call", 1)
    assert episode.turns[0].text == "The answer is 4."
    assert set(episode.response_mask) == {1} and "exec" not in rig.sandbox.ops()


@on_virtual_time
async def test_finish_ends_the_episode_with_its_answer_and_the_calls_after_it_never_run():
    async with episode_rig([bash_call("echo a") + finish_call("42") + bash_call("echo never")]) as rig:
        episode = await rig.run(request(), Goal())
    assert (episode.finish_reason, episode.state.answer) == ("finish", "42")
    assert episode.state.commands == ["echo a"]
    assert episode.response_ids == rig.llm.sampled[0].token_ids and set(episode.response_mask) == {1}


@on_virtual_time
async def test_an_answer_that_is_not_a_string_is_kept_as_json():
    async with episode_rig([tool_call("finish", answer={"x": [1, 2]})]) as rig:
        episode = await rig.run(request(), Goal())
    assert episode.state.answer == '{"x": [1, 2]}'


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json</tool_call>", "error: tool call 1 is not valid JSON"),
        ('<tool_call>{"name": "bash"', "error: a <tool_call> was opened but never closed"),
        ('<tool_call>{"name": "bash", "arguments": "ls"}</tool_call>', "error: tool call 1: arguments of 'bash'"),
    ],
)
@on_virtual_time
async def test_a_malformed_tool_call_is_counted_and_the_agent_is_told_why_in_its_context(text, error):
    async with episode_rig([text, finish_call()]) as rig:
        episode = await rig.run(request(), Goal())
    first = episode.turns[0]
    assert first.tool_calls == [] and first.observation.startswith(error)
    assert first.tool_call_errors and error.removeprefix("error: ") in first.tool_call_errors[0]
    assert episode.state.malformed_calls == 1 and "exec" not in rig.sandbox.ops()
    assert error in rig.chat.decode(policy_spans(episode)[1])  # the agent sees it, as tool tokens
    assert episode.finish_reason == "finish"  # the episode goes on


@on_virtual_time
async def test_an_unknown_tool_is_answered_with_the_tools_there_are():
    async with episode_rig([tool_call("rm", path="/"), finish_call()]) as rig:
        episode = await rig.run(request(), Goal())
    assert episode.turns[0].observation == "error: unknown tool 'rm'; available: bash, finish"
    assert episode.state.malformed_calls == 0


@on_virtual_time
async def test_tool_results_follow_each_turn_as_template_tokens_with_mask_0_and_logprob_0():
    async with episode_rig([bash_call("echo one"), bash_call("echo two"), finish_call()]) as rig:
        episode = await rig.run(request(), Goal())
    sampled = rig.llm.sampled
    observations = [
        rig.chat.tool_turn_ids([{"role": "tool", "content": f"{word}\n[exit code 0]"}], closed_by_eos=True)
        for word in ("one", "two")
    ]
    assert policy_spans(episode) == [
        sampled[0].token_ids,
        observations[0],
        sampled[1].token_ids,
        observations[1],
        sampled[2].token_ids,
    ]
    expected_logprobs = [*sampled[0].logprobs, *[0.0] * len(observations[0]), *sampled[1].logprobs]
    assert episode.response_logprobs[: len(expected_logprobs)] == expected_logprobs
    for turn, sample in zip(episode.turns, sampled):
        start, length = turn.response_start, turn.response_tokens
        assert episode.response_ids[start : start + length] == sample.token_ids
    assert [turn.observation_tokens for turn in episode.turns] == [len(ids) for ids in observations] + [0]
    # each turn is sampled from the whole context so far, as ids
    assert sampled[2].prompt_ids == episode.prompt_ids + episode.response_ids[: -len(sampled[2].token_ids)]


@on_virtual_time
async def test_a_turn_cut_by_max_tokens_is_closed_by_a_template_eos_the_policy_did_not_sample():
    call = bash_call("echo hi")
    async with episode_rig([Reply(call + " and then some more words"), finish_call()]) as rig:
        cut_at = len(rig.chat.encode(call))
        episode = await rig.run(request(sampling=SamplingParams(max_tokens=cut_at)), Goal())
    first = episode.turns[0]
    assert (first.finish_reason, first.tool_calls[0].arguments) == ("length", {"command": "echo hi"})
    assert rig.llm.requests[0]["max_tokens"] == cut_at
    assert episode.response_ids[cut_at] == rig.chat.eos_id and episode.response_mask[cut_at] == 0


@on_virtual_time
async def test_a_turn_ended_by_a_stop_string_is_read_from_its_ids_which_hold_it():
    """An OpenAI server trims the stop string from its text but not from the ids: a closing fence as the stop
    must leave the block closed, so the turn's action is its first block and the rest was never sampled."""
    first, second = "```bash\necho one\n```\n", "\nmore\n```bash\necho two\n```\n"
    async with episode_rig([Reply(first + second), finish_call()]) as rig:
        sampling = SamplingParams(max_tokens=200, stop=["\n```\n"])
        episode = await rig.run(request(action_format="fenced", sampling=sampling, max_turns=1), Goal())
    assert rig.llm.sampled[0].text == "```bash\necho one"  # what the server's text says
    turn = episode.turns[0]
    assert turn.text == first and turn.finish_reason == "stop"
    assert episode.state.commands == ["echo one"]
    assert episode.response_ids == rig.llm.sampled[0].token_ids == rig.chat.encode(first)


@on_virtual_time
async def test_a_prompt_longer_than_the_context_is_refused_before_any_sampling():
    async with episode_rig() as rig:
        length = await prompt_length(rig)
        with pytest.raises(PromptTooLong, match=f"the prompt is {length} tokens"):
            await rig.run(request(max_context_tokens=length), Goal())
    assert len(rig.llm.requests) == 1  # only prompt_length's own


@on_virtual_time
async def test_the_room_left_in_the_context_caps_a_turn_and_a_cut_turn_ends_the_episode():
    async with episode_rig([bash_call("echo " + "x" * 200)]) as rig:
        length = await prompt_length(rig)
        episode = await rig.run(request(max_context_tokens=length + 40), Goal())
    assert rig.llm.requests[-1]["max_tokens"] == 40  # not the 256 of the sampling settings
    assert episode.turns[0].finish_reason == "length" and len(episode.response_ids) == 40
    assert episode.finish_reason == "max_context" and episode.context_length == length + 40
    assert episode.state.malformed_calls == 1  # the cut call never closed


@on_virtual_time
async def test_tool_results_that_would_overflow_the_context_end_the_episode_without_them():
    async with episode_rig([bash_call("echo hi"), finish_call()]) as rig:
        rig.sandbox.outputs["echo hi"] = "y" * 500
        length = await prompt_length(rig)
        turn_length = len(rig.chat.encode(bash_call("echo hi"))) + 1
        episode = await rig.run(request(max_context_tokens=length + turn_length + 100), Goal())
    assert episode.finish_reason == "max_context"
    assert episode.state.commands == ["echo hi"]  # the tool ran; its result did not fit
    assert set(episode.response_mask) == {1} and len(episode.response_ids) == turn_length


@on_virtual_time
async def test_long_tool_output_is_clipped_in_the_middle():
    async with episode_rig([bash_call("cat big"), finish_call()]) as rig:
        rig.sandbox.outputs["cat big"] = "a" * 10_000 + "b" * 10_000
        episode = await rig.run(request(max_context_tokens=100_000), Goal())
    observation = episode.turns[0].observation
    assert observation.startswith("aaa") and observation.endswith("[exit code 0]")
    assert "characters omitted" in observation and len(observation) < MAX_OBSERVATION_CHARS + 100


@on_virtual_time
async def test_each_turn_is_tagged_with_the_policy_version_when_it_is_sampled():
    async with episode_rig([bash_call("echo 1"), bash_call("echo 2"), finish_call()]) as rig:
        barrier = WeightBarrier(_VersionPerRequest(rig.llm), rig.pool)
        episode = await rig.run(request(), Goal(), barrier)
    assert [turn.policy_version for turn in episode.turns] == [10, 11, 12]
    assert {turn.llm_server for turn in episode.turns} == {rig.llm.url}
