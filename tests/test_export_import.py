"""Training data from the records and trajectories put back (`prorl-rollout export` and `import`,
`POST /v1/trajectories`): an exported conversation renders back to the tokens the episode sampled and loads in
verl's and SkyRL's datasets; filters pick what they say; an import is all or nothing, refuses each bad field by
name, and its trajectories come out of the buffer weighed by their versions like the service's own."""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.models import JobError, JobState
from prorl_adapter.service.cli import main
from prorl_adapter.service.records import Records

from .fakes.llm import bash_call
from .fakes.rigs import rollout_stack, shell_job
from .test_records import trajectory

TOKENIZER_SKIP = (
    None
    if (localstack.TINY_MODEL / "tokenizer_config.json").exists()
    else f"needs the tiny model's tokenizer at {localstack.TINY_MODEL} (make llm)"
)


@pytest.fixture(scope="module")
def qwen_chat():
    """A real tokenizer and chat template (Qwen2's, which lays tools out itself), for the service and the LLM
    stand-in alike."""
    if TOKENIZER_SKIP:
        pytest.skip(TOKENIZER_SKIP)
    from prorl_adapter.service.chat import ChatTokenizer

    return ChatTokenizer(str(localstack.TINY_MODEL))


def export(*argv: str) -> int:
    return main(["export", *argv])


def fenced(command: str) -> str:
    return f"I run it.\n```bash\n{command}\n```"


async def recorded_loop_episode(tmp_path, chat, action_format: str = "hermes"):
    """One episode of the built-in agent loop on the real template, recorded: two tool turns, then an answer.
    `hermes`: the template lays the tools out; `fenced`: the system prompt describes them (no template tools)."""
    call = bash_call if action_format == "hermes" else fenced
    script = [call("echo hi > done.txt"), call("cat done.txt"), "All done."]
    async with rollout_stack(script=script, record_dir=tmp_path / "records", chat=chat) as stack:
        delivered = await stack.client.run(shell_job(max_turns=3, action_format=action_format), wait=60)
    assert delivered.error is None and delivered.num_turns == 3
    return delivered, tmp_path / "records"


@pytest.mark.parametrize("action_format", ["hermes", "fenced"])
async def test_an_exported_conversation_renders_back_to_the_sampled_tokens(tmp_path, qwen_chat, action_format):
    delivered, records = await recorded_loop_episode(tmp_path, qwen_chat, action_format)
    assert export(str(records), "--to", "sft", "--out", str(tmp_path / "sft.parquet")) == 0
    [example] = pq.read_table(tmp_path / "sft.parquet").to_pylist()
    messages = [{k: v for k, v in m.items() if v is not None} for m in example["messages"]]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[3]["content"] == delivered.turns[0].tool_results[0]
    tools = json.loads(example["tools"]) if example.get("tools") else None  # a column only where there are tools
    assert (tools[0]["function"]["name"] == "bash") if action_format == "hermes" else tools is None
    rendered = qwen_chat.render(messages, tools, add_generation_prompt=False)
    sampled = qwen_chat.decode(delivered.prompt_ids + delivered.response_ids)
    assert rendered == sampled + qwen_chat.after_eos  # the text every sampled token spells, and the template's end
    # JSON Lines: the same conversation in TRL's conversational format
    assert export(str(records), "--to", "sft", "--out", str(tmp_path / "sft.jsonl")) == 0
    [line] = (tmp_path / "sft.jsonl").read_text().splitlines()
    assert json.loads(line)["messages"] == messages and json.loads(line)["tools"] == tools


async def test_verl_and_skyrl_datasets_read_the_exports(tmp_path, qwen_chat):
    verl_sft = pytest.importorskip("verl.utils.dataset.multiturn_sft_dataset", reason="verl is not installed")
    verl_rl = pytest.importorskip("verl.utils.dataset.rl_dataset")
    skyrl = pytest.importorskip("skyrl.train.dataset.dataset", reason="skyrl is not installed")
    delivered, records = await recorded_loop_episode(tmp_path, qwen_chat, "fenced")  # verl takes tools as objects
    sft, rl = str(tmp_path / "sft.parquet"), str(tmp_path / "rl.parquet")
    assert export(str(records), "--to", "sft", "--out", sft) == 0
    assert export(str(records), "--to", "rl", "--out", rl) == 0
    config = {"max_length": 4096, "pad_mode": "no_padding", "truncation": "error", "ignore_input_ids_mismatch": True}
    item = verl_sft.MultiTurnSFTDataset(sft, tokenizer=qwen_chat.tokenizer, config=config)[0]
    trained = qwen_chat.decode(item["input_ids"][item["loss_mask"].bool()].tolist())
    assert all(turn.text in trained for turn in delivered.turns)  # the assistant turns are what SFT trains on
    assert delivered.turns[0].tool_results[0] not in trained  # and not the tool's output
    from omegaconf import OmegaConf

    rl_config = OmegaConf.create(
        {"max_prompt_length": 4096, "filter_overlong_prompts": False, "cache_dir": str(tmp_path)}
    )
    row = verl_rl.RLHFDataset([rl], tokenizer=qwen_chat.tokenizer, config=rl_config)[0]
    assert list(row["response_ids"]) == delivered.response_ids and row["data_source"] == "shell"
    assert row["raw_prompt"][1]["role"] == "user"
    prompts = skyrl.PromptDataset(rl, tokenizer=qwen_chat.tokenizer, max_prompt_length=4096, num_workers=1)
    messages, _, extra, _ = prompts[0]
    assert messages[0]["role"] == "system" and list(extra["prompt_ids"]) == delivered.prompt_ids


def test_rl_rows_are_one_per_sequence_with_their_versions_and_filters_pick(tmp_path):
    records = Records(tmp_path, "r")
    records.prorl_job_finished(trajectory("good", reward=1.0), JobState.done)
    records.prorl_job_finished(trajectory("poor", reward=0.0), JobState.done)
    failed = trajectory("broken", reward=0.0, error=JobError(error_class="init", message="gone"))
    records.prorl_job_finished(failed, JobState.failed)
    records.close()
    out = tmp_path / "rl.parquet"
    assert export(str(tmp_path), "--to", "rl", "--out", str(out)) == 0
    rows = pq.read_table(out).to_pylist()
    assert [(r["job_id"], r["sequence"]) for r in rows] == [("good", 0), ("good", 1), ("poor", 0), ("poor", 1)]
    good, second = rows[0], rows[1]
    assert good["token_versions"] == [3, 3, 4, 4, None, 3] and good["response_mask"] == [1, 1, 1, 1, 0, 1]
    assert second["prompt_ids"] == [1, 9] and second["reward"] == 1.0 and second["group"] == "g-1"
    picked = {
        ("--min-reward", "0.5"): ["good"],
        ("--include-filtered", "--error-class", "init"): ["broken"],
        ("--include-filtered", "--error-class", "none", "--max-reward", "0.5"): ["poor"],
        ("--label", "split=train", "--task", "shell", "--min-version", "3", "--max-version", "4"): ["good", "poor"],
        (
            "--min-version",
            "4",
        ): [],
        ("--until", "2000-01-01"): [],
        ("--since", "2000-01-01T00:00:00+00:00", "--state", "done"): ["good", "poor"],
    }
    for argv, jobs in picked.items():
        assert export(str(tmp_path), "--to", "rl", "--out", str(out), *argv) == 0
        assert sorted({r["job_id"] for r in pq.read_table(out).to_pylist()}) == sorted(jobs), argv


def test_export_refuses_what_it_cannot_write_in_one_line(tmp_path, capsys):
    Records(tmp_path, "r").close()
    assert export(str(tmp_path), "--to", "rl", "--out", str(tmp_path / "rl.jsonl")) == 2
    assert export(str(tmp_path / "nowhere"), "--to", "sft", "--out", str(tmp_path / "a.jsonl")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "write rl data to a .parquet file" in lines[0] and "not a --record directory" in lines[1]
    assert not (tmp_path / "rl.jsonl").exists()


def item(name: str, version: int = 0, **fields):
    return {
        "job_id": name,
        "prompt_ids": [40, 41],
        "response_ids": [50, 51, 52],
        "response_mask": [1, 0, 1],
        "response_logprobs": [-0.5, 0.0, -0.25],
        "token_versions": [version, None, version],
        "reward": 1.0,
        "group": "g",
        **fields,
    }


async def test_imported_trajectories_are_taken_like_the_services_own():
    """Weighed by the staleness plugin by their oldest token, as the service's own: at version 4 with K=3, one
    sampled from version 2 on is kept, one from version 0 on is removed as too stale before the take."""
    async with rollout_stack(plugin_config={"staleness": {"mode": "drop", "max_staleness": 3}}) as stack:
        await stack.client.set_policy_version(4)
        resumed = item("a", token_versions=[2, None, 3])  # a turn begun by version 2, resumed by 3
        imported = await stack.client.import_trajectories([resumed, item("b", version=0)], {"g": 2})
        assert imported.imported == 2 and imported.job_ids == ["a", "b"]
        batch = await stack.client.take_batch(2, timeout=0)  # what there is now
        [kept] = batch.items
        assert kept.trajectory.job_id == "a" and kept.token_versions() == [2, None, 3] and kept.group == "g"
        assert kept.trajectory.policy_version_min == 2 and kept.trajectory.policy_version_max == 3
        status = await stack.client.buffer()
        assert status.imported == 2 and status.buffer_expired == 1


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"response_mask": [1, 0]}, "trajectories[1].response_mask: 2 entries for 3 response_ids"),
        ({"response_ids": [50, 51, 1 << 40]}, "trajectories[1].response_ids[2]"),
        ({"group": "other"}, "trajectories[1].group: 'other' is not one of group_sizes"),
        ({"token_versions": None}, "trajectories[1].policy_version"),
        ({"token_versions": [0, None, None]}, "trajectories[1].token_versions[2]"),
        ({"token_versions": [0, None, 1]}, "trajectories[1].token_versions[2]: a policy token needs a version from 0"),
        ({"token_versions": None, "policy_version": 7}, "trajectories[1].policy_version: 7 is newer than the"),
        ({"prompt_ids": [-1, 2]}, "trajectories[1].prompt_ids[0]"),
        ({"reward": float("nan")}, "trajectories[1].reward: nan is not a finite number"),
        ({"response_logprobs": [-0.5, 0.0, 5.0]}, "trajectories[1].response_logprobs[2]: 5.0 is not a logprob"),
        ({"job_id": "a"}, "trajectories[1].job_id: 'a' is given to an earlier trajectory too"),
        ({"response_mask": [0, 0, 0]}, "trajectories[1].response_mask: no token of the policy's"),
    ],
)
async def test_a_bad_import_is_a_400_naming_the_field_and_puts_nothing(bad, named):
    async with rollout_stack() as stack:
        response = await stack.http.post(
            "/v1/trajectories", json={"trajectories": [item("a"), item("b", **bad)], "group_sizes": {"g": 2}}
        )
        assert response.status == 400 and named in (await response.json())["error"]
        status = await stack.client.buffer()
        assert status.ready == 0 and status.imported == 0


async def test_a_group_that_comes_short_is_refused():
    async with rollout_stack() as stack:
        response = await stack.http.post(
            "/v1/trajectories", json={"trajectories": [item("a")], "group_sizes": {"g": 2}}
        )
        assert response.status == 400 and "group_sizes.g: 2 declared, 1 given" in (await response.json())["error"]


async def test_import_replays_a_record_directory(tmp_path):
    records = Records(tmp_path, "r")
    for job in ("x", "y"):
        records.prorl_job_finished(trajectory(job), JobState.done)
    failed = trajectory("z", error=JobError(error_class="init", message="gone"))
    records.prorl_job_finished(failed, JobState.failed)
    records.close()
    async with rollout_stack() as stack:
        await stack.client.set_policy_version(4)  # the run's versions were 3 and 4
        argv = ["import", str(tmp_path), "--url", stack.url, "--group-whole"]
        assert await asyncio.to_thread(main, argv) == 0
        batch = await stack.client.take_batch(5, timeout=0)
    # Each sequence of an episode (its segments too), and not the infrastructure failure.
    replayed = {entry.trajectory.job_id: entry for entry in batch.items}
    assert sorted(replayed) == ["x", "x.1", "y", "y.1"]
    original = trajectory("x")
    assert replayed["x"].token_versions() == original.token_versions()
    assert replayed["x"].trajectory.response_ids == original.response_ids
    assert replayed["x.1"].trajectory.prompt_ids == original.segments[0].prompt_ids
    assert {entry.group for entry in replayed.values()} == {original.group}


async def test_an_agent_programs_conversation_is_its_last_call_and_the_answer(tmp_path):
    """Through the gateway, a harness's conversation as it sent it (its tool calls and results in OpenAI's
    shape), ended by the answer to its last call; the texts of the calls pick the run the trajectory holds."""
    from prorl_adapter.models import StageTimings, Trajectory
    from prorl_adapter.service.server import PIPELINE

    async with rollout_stack(script=[bash_call("ls"), "It is empty."], record_dir=tmp_path) as stack:
        gateway = stack.app[PIPELINE].gateway
        episode = gateway.open("job-1", shell_job())
        url = f"/gateway/{episode.key}/v1/chat/completions"
        tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
        messages = [{"role": "system", "content": "Work."}, {"role": "user", "content": "What is here?"}]
        first = await (await stack.gateway.post(url, json={"messages": messages, "tools": tools})).json()
        answer = first["choices"][0]["message"]
        call_id = answer["tool_calls"][0]["id"]
        messages += [answer, {"role": "tool", "tool_call_id": call_id, "content": "(nothing)"}]
        second = await (await stack.gateway.post(url, json={"messages": messages, "tools": tools})).json()
        segments, turns = episode.log.segments()
        gateway.close(episode)
        trajectory = Trajectory(
            job_id="job-1",
            task="shell",
            prompt_ids=segments[0].prompt_ids,
            response_ids=segments[0].response_ids,
            response_mask=segments[0].response_mask,
            response_logprobs=segments[0].response_logprobs,
            turns=turns,
            num_turns=len(turns),
            finish_reason="agent_exit",
            reward=1.0,
            policy_version_min=0,
            policy_version_max=0,
            timings=StageTimings(),
        )
        stack.app[PIPELINE].plugins.notify("prorl_job_finished", trajectory=trajectory, state=JobState.done)
    out = tmp_path / "sft.jsonl"
    assert export(str(tmp_path), "--to", "sft", "--out", str(out)) == 0
    [example] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in example["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert example["messages"][2]["tool_calls"][0]["function"] == {"name": "bash", "arguments": {"command": "ls"}}
    assert example["messages"][3] == {"role": "tool", "tool_call_id": call_id, "content": "(nothing)"}
    assert example["messages"][4]["content"] == second["choices"][0]["message"]["content"] == "It is empty."
    assert example["tools"] == tools and example["job_id"] == "job-1"


async def test_an_import_past_max_buffered_is_a_409_and_puts_nothing():
    async with rollout_stack(decoupled={"max_buffered": 2}) as stack:
        body = {"trajectories": [item("a"), item("b"), item("c")]}
        response = await stack.http.post("/v1/trajectories", json=body)
        assert response.status == 409 and "max_buffered=2" in (await response.json())["error"]
        assert (await stack.client.buffer()).ready == 0
        assert (await stack.client.import_trajectories([item("a"), item("b")])).imported == 2


def test_import_requests_stay_under_the_body_limit_and_keep_groups_whole():
    from prorl_adapter.service.records_cli import chunks

    items = [item(f"j{n}", group=f"g{n // 3}", response_logprobs=[-0.123456789] * 3) for n in range(9)]
    one = len(json.dumps(items[0]))
    by_bytes = list(chunks(iter(items), size=100, whole_groups=False, max_bytes=one * 2))
    assert [len(chunk) for chunk in by_bytes] == [2, 2, 2, 2, 1]
    whole = list(chunks(iter(items), size=4, whole_groups=True))
    assert [[i["group"] for i in chunk] for chunk in whole] == [["g0"] * 3, ["g1"] * 3, ["g2"] * 3]
