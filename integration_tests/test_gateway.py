"""The LLM gateway with real parts: agent programs on the official `openai` client and on `litellm` run inside
bwrap sandboxes, reach the rollout service only through the runtime's forward, and are sampled by the real vLLM
(behind the SGLang stand-in of protocol_standins.py, which records exactly what vLLM sampled)."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import httpx
import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.models import Trajectory
from prorl_adapter.service.agent_program import program_timeout
from prorl_adapter.service.chat import tool_call_regex

from .conftest import start_rollout
from .protocol_standins import protocol_standin

AGENT_ENV = localstack.AGENT_ENV  # the `sandbox_server` fixture shows it to the sandboxes (--host-path)
pytestmark = pytest.mark.skipif(
    not (AGENT_ENV / ".agent-installed").exists(),
    reason=f"the agent programs' environment {AGENT_ENV} is missing: run scripts/agent-env.sh (make test does)",
)
HARNESS = Path(__file__).with_name("gateway_harness.py").read_text()
COMMANDS = ["echo hello > done.txt", "ls", "cat done.txt"]
SHELL_TASK = {"id": "hello", "goal": "Write hello into done.txt", "check": "grep -qx hello done.txt"}


def job(steps: int = 3, **harness_env: str) -> dict:
    """A shell episode run by the test harness: its calls are constrained to well-formed bash tool calls (the
    tiny model has random weights), the harness runs them and sends everything back."""
    return {
        "task": "shell",
        "instance": SHELL_TASK,
        "max_turns": 8,
        "sampling": {"max_tokens": 64, "regex": tool_call_regex("bash", "command", COMMANDS)},
        "agent": {
            "command": f"{AGENT_ENV}/bin/python /tmp/agent/harness.py",
            "files": {"/tmp/agent/harness.py": HARNESS},
            # The clients' caches stay out of the graded workspace (HOME is the workdir); litellm must not
            # fetch its price list (the sandbox has no network, and waiting for it costs seconds).
            "env": {
                "HARNESS_STEPS": str(steps),
                "XDG_CACHE_HOME": "/tmp/cache",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                **harness_env,
            },
        },
    }


async def run_job(http: httpx.AsyncClient, request: dict) -> Trajectory:
    submitted = (await http.post("/v1/jobs", json=request)).json()
    reply = await http.get(f"/v1/jobs/{submitted['job_id']}/result", params={"wait": 300})
    return Trajectory.model_validate_json(reply.content)


def harness_lines(trajectory: Trajectory) -> list[dict]:
    return [json.loads(line) for line in trajectory.artifacts["agent_output"].splitlines() if line.startswith("{")]


@pytest.fixture
async def gateway_stack(vllm, sandbox_server):
    """The SGLang stand-in in front of vLLM (recording what it sampled) and a rollout service using it."""
    async with protocol_standin("sglang", vllm.url) as standin:
        service = await asyncio.to_thread(start_rollout, [sandbox_server.url], [f"sglang+{standin.url}"])
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=600) as http:
                yield http, standin
        finally:
            service.stop()


def assert_ids_are_what_vllm_sampled(trajectory: Trajectory, sampled: list) -> None:
    """Every call's prompt is the segment's exact history up to it, and its ids and logprobs are vLLM's own."""
    segments = trajectory.all_segments()
    assert len(sampled) == trajectory.num_turns
    for (prompt, ids, logprobs), turn in zip(sampled, trajectory.turns, strict=True):
        seg = segments[turn.segment]
        span = slice(turn.response_start, turn.response_start + turn.response_tokens)
        assert prompt == seg.prompt_ids + seg.response_ids[: turn.response_start]
        assert (seg.response_ids[span], seg.response_logprobs[span]) == (ids, logprobs)
        assert set(seg.response_mask[span]) == {1}


async def test_an_openai_client_harness_runs_a_multi_turn_episode_in_token_space(gateway_stack, vllm):
    http, standin = gateway_stack
    request = job(steps=3, HARNESS_PROBE_PORT=str(vllm.url.rsplit(":", 1)[1]), HARNESS_PROBE_API="1")
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    assert trajectory.finish_reason == "agent_exit" and trajectory.artifacts["agent_exit_code"] == "0"
    lines = harness_lines(trajectory)
    # The sandbox reaches the gateway and nothing else: not vLLM, not the service's own (token-less) API.
    assert lines[0] == {"probe": "unreachable"}
    assert lines[1] == {"api": {"/v1/status": 404, "/v1/policy-version": 404, "/v1/batches": 404}}
    steps = [line for line in lines if "step" in line]
    assert len(steps) == 3 and all(s["tool_calls"] and s["finish_reason"] == "tool_calls" for s in steps)
    assert [t.tool_calls[0].name for t in trajectory.turns] == ["bash"] * 3
    # One harness that sends its history back unchanged: one segment, the tool results as context (mask 0).
    assert trajectory.segments == [] and trajectory.num_turns == 3
    assert 0 in trajectory.response_mask
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)
    assert trajectory.reward == trajectory.reward_components["outcome"]  # graded by the shell task as usual


async def test_vllm_scores_the_recorded_sequence_as_it_was_sampled(gateway_stack, vllm):
    """vLLM's logprobs of the whole recorded multi-turn sequence (prompt_logprobs) agree with the logprobs
    recorded at sampling time, token by token: the sequence is the one the policy produced. Free text (no
    structured output, whose logprobs are those of the constrained distribution): the harness says "Go on."."""
    http, standin = gateway_stack
    request = job(steps=3, HARNESS_CONTINUE="1")
    del request["sampling"]["regex"]
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    assert trajectory.num_turns == 3 and trajectory.segments == []
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)
    await assert_vllm_scores_the_sequence_alike(vllm.url, trajectory)


async def assert_vllm_scores_the_sequence_alike(vllm_url: str, trajectory: Trajectory) -> None:
    ids = trajectory.prompt_ids + trajectory.response_ids
    async with httpx.AsyncClient(timeout=120) as http:
        model = (await http.get(f"{vllm_url}/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        scored = (await http.post(f"{vllm_url}/v1/completions", json=body)).json()["choices"][0]["prompt_logprobs"]
    offset = len(trajectory.prompt_ids)
    for i, (mask, recorded) in enumerate(zip(trajectory.response_mask, trajectory.response_logprobs)):
        if mask:
            entry = scored[offset + i][str(ids[offset + i])]
            assert abs(entry["logprob"] - recorded) < 0.05, (i, entry, recorded)


@pytest.mark.parametrize(
    ("client", "stream"),
    [("openai", "1"), ("litellm", "0"), ("litellm", "1")],
    ids=["openai-stream", "litellm", "litellm-stream"],
)
async def test_other_clients_and_streaming_make_the_same_token_history(gateway_stack, client, stream):
    http, standin = gateway_stack
    trajectory = await run_job(http, job(steps=2, HARNESS_CLIENT=client, HARNESS_STREAM=stream))
    assert trajectory.error is None, trajectory.error
    steps = [line for line in harness_lines(trajectory) if "step" in line]
    assert len(steps) == 2 and all(s["tool_calls"][0]["function"]["name"] == "bash" for s in steps)
    assert trajectory.segments == [] and trajectory.num_turns == 2
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)


@pytest.mark.parametrize(
    ("protocol", "stream"),
    [("responses", "0"), ("responses", "1"), ("anthropic", "0"), ("anthropic", "1")],
    ids=["responses-history", "responses-stream-previous-id", "anthropic", "anthropic-stream"],
)
async def test_responses_and_anthropic_harnesses_make_the_same_token_history(gateway_stack, protocol, stream):
    """Harnesses on the official `openai` (Responses API) and `anthropic` clients, in the sandbox, knowing the
    gateway by the environment only: tool use over three turns is one segment of exactly what vLLM sampled."""
    http, standin = gateway_stack
    trajectory = await run_job(http, job(steps=3, HARNESS_PROTOCOL=protocol, HARNESS_STREAM=stream))
    assert trajectory.error is None, trajectory.error
    assert trajectory.artifacts["agent_exit_code"] == "0", trajectory.artifacts["agent_output"]
    steps = [line for line in harness_lines(trajectory) if "step" in line]
    assert len(steps) == 3 and all(s["tool_calls"][0]["function"]["name"] == "bash" for s in steps)
    assert {s["finish_reason"] for s in steps} == {"completed" if protocol == "responses" else "tool_use"}
    assert trajectory.segments == [] and trajectory.num_turns == 3
    assert [t.tool_calls[0].name for t in trajectory.turns] == ["bash"] * 3
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)


@pytest.mark.parametrize("protocol", ["responses", "anthropic"])
async def test_vllm_scores_a_responses_or_messages_sequence_as_it_was_sampled(gateway_stack, vllm, protocol):
    """As the chat harness's test above: free text over three turns ("Go on." after each), one sequence whose
    every sampled token vLLM scores as it was recorded."""
    http, standin = gateway_stack
    request = job(steps=3, HARNESS_PROTOCOL=protocol, HARNESS_CONTINUE="1")
    del request["sampling"]["regex"]
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    assert trajectory.num_turns == 3 and trajectory.segments == [], trajectory.artifacts["agent_output"]
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)
    await assert_vllm_scores_the_sequence_alike(vllm.url, trajectory)


async def test_a_history_sent_back_edited_starts_a_new_segment(gateway_stack):
    http, standin = gateway_stack
    trajectory = await run_job(http, job(steps=3, HARNESS_EDIT="1"))
    assert trajectory.error is None, trajectory.error
    # Call 1 stands alone; call 2 saw the edited answer (rendered whole: a new segment); call 3 extends call 2.
    assert [t.segment for t in trajectory.turns] == [0, 1, 1]
    assert len(trajectory.segments) == 1
    assert sum(trajectory.response_mask) == trajectory.turns[0].response_tokens
    assert_ids_are_what_vllm_sampled(trajectory, standin.sampled)


async def test_another_episodes_key_is_refused(gateway_stack):
    http, _ = gateway_stack
    # A key was its episode's credential while that episode ran; the next episode's harness tries it first.
    request = job(steps=1, HARNESS_FOREIGN_KEY=await key_of_a_finished_episode(http))
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    assert {"foreign": 404} in harness_lines(trajectory)
    assert trajectory.num_turns == 1  # its own call, under its own key, is recorded; the refused one nowhere
    # A key nobody was given, from outside the sandboxes, on the gateway's own port: the same answer.
    gateway = "http://" + (await http.get("/v1/status")).json()["gateway_address"]
    made_up = secrets.token_urlsafe(32)
    call = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as direct:
        assert (await direct.post(f"/gateway/{made_up}/v1/chat/completions", json=call)).status_code == 404
        assert (await direct.get(f"/gateway/{made_up}/v1/models")).status_code == 404


async def key_of_a_finished_episode(http: httpx.AsyncClient) -> str:
    """An episode whose program prints its own key and makes one call; once it is over, the key is stale."""
    request = job(steps=1)
    request["agent"]["command"] = f'echo "{{\\"key\\": \\"$OPENAI_API_KEY\\"}}"; {request["agent"]["command"]}'
    trajectory = await run_job(http, request)
    assert trajectory.error is None, trajectory.error
    return next(line["key"] for line in harness_lines(trajectory) if "key" in line)


async def test_a_program_that_makes_no_call_fails_the_run_with_its_output(gateway_stack, sandbox_server):
    http, _ = gateway_stack
    request = job()
    request["agent"]["command"] = "echo the harness cannot start >&2; exit 3"
    trajectory = await run_job(http, request)
    assert trajectory.error.error_class == "run" and trajectory.filter
    assert "exit code 3" in trajectory.error.message and "the harness cannot start" in trajectory.error.message
    async with sandbox_server.client() as sandboxes:
        assert [b for b in await sandboxes.list_sandboxes() if b.labels.get("job_id") == trajectory.job_id] == []


async def test_a_program_that_runs_out_the_clock_is_stopped_and_graded_not_filtered(gateway_stack):
    """A stall (a tool that never returns, a harness without timeouts) must not escape a bad score: the program
    is stopped with time left for eval, and the episode is graded like any other."""
    http, _ = gateway_stack
    request = job(steps=1)
    request["agent"]["command"] += "; sleep 1000"
    request["timeout_s"] = 30
    trajectory = await run_job(http, request)
    assert trajectory.error is None and not trajectory.filter, trajectory.error
    assert trajectory.finish_reason == "agent_timeout" and trajectory.num_turns == 1
    # its time: the budget left when it started (30 s less init's), less eval's reserve
    assert trajectory.cut.budget == "agent_timeout" and 0 < trajectory.cut.limit <= program_timeout(30)
    assert "outcome" in trajectory.reward_components
