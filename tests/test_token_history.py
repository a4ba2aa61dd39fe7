"""The token-history rule of the LLM gateway (service/token_history.py), on the character tokenizer stand-in."""

from __future__ import annotations

from prorl_adapter.service.token_history import CallLog, ChatKey, Sampled, canonical, tools_key

from .fakes.chat import END, CharChat

chat = CharChat()
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def answered(log: CallLog, messages, tools, sampled: str, reply: dict, closed: bool = True) -> Sampled:
    """Record a call of `messages` whose sampled ids decode to `sampled` (+ the eos where `closed`)."""
    prompt, digest = log.chat_prompt(chat, messages, tools)
    ids = chat.encode(sampled) + ([chat.eos_id] if closed else [])
    call = Sampled(prompt, ids, [-0.5] * len(ids), 3, "http://llm", "stop", sampled, 0.1)
    log.record(call, ChatKey(digest, len(messages), tools_key(tools), canonical(reply)))
    return call


def history(call: Sampled) -> list[int]:
    return call.prompt_ids + call.response_ids


FIRST = [{"role": "system", "content": "s"}, {"role": "user", "content": "list the files"}]
# The policy sampled the call in its own spacing; the harness sends it back the OpenAI way (arguments as a
# JSON string, an id of its own): the same message, so the sampled ids are kept.
SAMPLED = '<tool_call>{"name":"bash","arguments":{"command":"ls"}}</tool_call>'
REPLY = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
}
SENT_BACK = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_9", "content": "a.txt"}


def test_a_history_sent_back_unchanged_extends_the_sampled_ids():
    log = CallLog()
    first = answered(log, FIRST, TOOLS, SAMPLED, REPLY)
    prompt = log.chat_prompt(chat, [*FIRST, SENT_BACK, TOOL_RESULT], TOOLS)[0]
    # The exact history, then only the new message's template text: the sampled ids are never re-encoded.
    assert prompt[: len(history(first))] == history(first)
    assert chat.decode(prompt[len(history(first)) :]) == f"\n<|im_start|>tool\na.txt{END}\n<|im_start|>assistant\n"


def test_a_turn_cut_by_its_token_limit_gets_the_eos_as_context():
    log = CallLog()
    first = answered(log, FIRST, TOOLS, SAMPLED, REPLY, closed=False)
    prompt = log.chat_prompt(chat, [*FIRST, SENT_BACK, TOOL_RESULT], TOOLS)[0]
    assert prompt[len(history(first))] == chat.eos_id


def test_calls_that_extend_each_other_make_one_segment_with_masks():
    log = CallLog()
    first = answered(log, FIRST, TOOLS, SAMPLED, REPLY)
    second = answered(log, [*FIRST, SENT_BACK, TOOL_RESULT], TOOLS, "done", {"role": "assistant", "content": "done"})
    segments, turns = log.segments()
    assert len(segments) == 1
    seg = segments[0]
    assert seg.prompt_ids == first.prompt_ids
    assert seg.prompt_ids + seg.response_ids == history(second)
    context = len(second.prompt_ids) - len(history(first))
    assert seg.response_mask == [1] * len(first.response_ids) + [0] * context + [1] * len(second.response_ids)
    assert [t.segment for t in turns] == [0, 0]
    assert turns[1].response_start == len(first.response_ids) + context
    policy = [lp for lp, m in zip(seg.response_logprobs, seg.response_mask) if m]
    assert policy == first.response_logprobs + second.response_logprobs
    assert all(lp == 0.0 for lp, m in zip(seg.response_logprobs, seg.response_mask) if not m)


def test_an_edited_answer_starts_a_new_segment():
    log = CallLog()
    answered(log, FIRST, TOOLS, SAMPLED, REPLY)
    edited = {**SENT_BACK, "tool_calls": [{"function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}]}
    second = answered(log, [*FIRST, edited, TOOL_RESULT], TOOLS, "done", {"role": "assistant", "content": "done"})
    segments, turns = log.segments()
    assert len(segments) == 2 and [t.segment for t in turns] == [0, 1]
    assert segments[1].prompt_ids == second.prompt_ids  # rendered whole: the edit is context, not the policy's
    assert segments[1].response_mask == [1] * len(second.response_ids)


def test_a_summarised_history_and_other_tools_start_new_segments():
    log = CallLog()
    answered(log, FIRST, TOOLS, SAMPLED, REPLY)
    summary = [{"role": "system", "content": "s"}, {"role": "user", "content": "summary: listed files"}]
    answered(log, summary, TOOLS, "ok", {"role": "assistant", "content": "ok"})
    answered(log, [*FIRST, SENT_BACK, TOOL_RESULT], None, "x", {"role": "assistant", "content": "x"})
    segments, _ = log.segments()
    assert len(segments) == 3


def test_every_sampled_token_is_in_exactly_one_segment_when_a_call_branches():
    """Two calls extend the same first call (a harness retrying a step): the second branch cannot continue the
    segment the first branch took, so it starts its own, and no sampled token is counted twice."""
    log = CallLog()
    answered(log, FIRST, TOOLS, SAMPLED, REPLY)
    history = [*FIRST, SENT_BACK, TOOL_RESULT]
    a = answered(log, history, TOOLS, "one", {"role": "assistant", "content": "one"})
    b = answered(log, history, TOOLS, "two", {"role": "assistant", "content": "two"})
    segments, _ = log.segments()
    assert len(segments) == 2
    sampled = sum(sum(s.response_mask) for s in segments)
    assert sampled == sum(len(c.sampled.response_ids) for c in log.calls)
    assert segments[1].prompt_ids == b.prompt_ids and a.prompt_ids == b.prompt_ids
