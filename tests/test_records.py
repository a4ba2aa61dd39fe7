"""Durable trajectory records (`--record DIR`, prorl_adapter/service/records.py): what a service delivered is what
its records hold, shards rotate and close, and a killed writer loses at most its open shard."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prorl_adapter.models import (
    BudgetCut,
    JobError,
    JobRequest,
    JobState,
    Resumption,
    Segment,
    StageTimings,
    ToolCall,
    Trajectory,
    Turn,
)
from prorl_adapter.service.records import (
    RECORD_SCHEMA,
    TRAJECTORY_SCHEMA,
    Records,
    read_rows,
    read_trajectories,
    trajectory_row,
)
from prorl_adapter.service.server import PIPELINE

from .fakes.llm import bash_call
from .fakes.rigs import rollout_stack, shell_job
from .fakes.standin import Hang


def trajectory(job_id: str, reward: float = 1.0, error: JobError | None = None) -> Trajectory:
    """An agent program's trajectory with everything a record must keep: two segments, a resumed turn, labels."""
    turns = [
        Turn(
            index=0,
            segment=0,
            policy_version=3,
            resumptions=[Resumption(offset=2, policy_version=4)],
            llm_server="http://llm",
            response_start=0,
            response_tokens=4,
            finish_reason="stop",
            text='<script>alert("x")</script>',
            tool_calls=[ToolCall(name="bash", arguments={"command": "ls"})],
        ),
        Turn(
            index=1,
            segment=1,
            policy_version=4,
            llm_server="http://llm",
            response_start=1,
            response_tokens=1,
            finish_reason="stop",
            text="ok",
        ),
    ]
    return Trajectory(
        job_id=job_id,
        task="shell",
        instance_id="i-1",
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 13, 7, 14],
        response_mask=[1, 1, 1, 1, 0, 1],
        response_logprobs=[-0.1, -0.25, -1e-9, -3.5, 0.0, -0.123456789012345],
        turns=turns,
        num_turns=2,
        finish_reason="agent_exit" if error is None else "error",
        reward=reward,
        reward_components={"outcome": reward, "step_cost": -0.02},
        policy_version_min=3,
        policy_version_max=4,
        timings=StageTimings(queued_s=0.5, init_s=1.25, run_s=3.0, eval_s=0.75, generate_s=2.0, tools_s=0.5),
        error=error,
        filter=error is not None,
        labels={"run": "r1", "split": "train"},
        group="g-1",
        attempt=2,
        retry_of="j-0",
        artifacts={"agent_exit_code": "0"},
        segments=[Segment(prompt_ids=[1, 9], response_ids=[20], response_mask=[1], response_logprobs=[-0.5])],
    )


def test_a_recorded_trajectory_reads_back_as_it_was_delivered(tmp_path):
    outage = JobError(error_class="timeout", message="time budget of 30 s spent in running", outage=True)
    cut = trajectory("c", 0.0, outage).model_copy(
        update={"cut": BudgetCut(budget="run_timeout", setting="timeout_s", limit=30, used=30.002)}
    )
    failed = trajectory("b", 0.0, JobError(error_class="eval", message="the check timed out"))
    delivered = [trajectory("a"), failed, cut]
    records = Records(tmp_path, "replica-1")
    records.prorl_job_finished(delivered[0], JobState.done)
    records.prorl_job_finished(delivered[1], JobState.failed)
    records.prorl_job_finished(delivered[2], JobState.failed)
    records.close()
    assert list(read_trajectories(tmp_path)) == delivered
    rows = list(read_rows(tmp_path))
    assert [r["state"] for r in rows] == ["done", "failed", "failed"] and rows[1]["error_class"] == "eval"
    assert rows[0]["schema_version"] == RECORD_SCHEMA and rows[0]["replica"] == "replica-1"
    assert rows[0]["token_versions"] == [3, 3, 4, 4, None, 3]  # a resumed turn's rest at its version
    assert rows[0]["timings"]["eval_s"] == 0.75 and dict(rows[0]["labels"]) == {"run": "r1", "split": "train"}


def test_shards_rotate_by_size_and_every_closed_one_is_plain_parquet(tmp_path):
    records = Records(tmp_path, "r", shard_bytes=1, flush_rows=1)
    for n in range(5):
        records.prorl_job_finished(trajectory(f"j{n}", reward=n), JobState.done)
    records.close()
    shards = sorted((tmp_path / "trajectories").iterdir())
    assert len(shards) == 5 and all(p.suffix == ".parquet" for p in shards)
    table = pq.read_table(tmp_path / "trajectories", columns=["job_id", "reward"])  # any Parquet reader, filtered
    assert table.to_pydict() == {"job_id": [f"j{n}" for n in range(5)], "reward": [0.0, 1.0, 2.0, 3.0, 4.0]}


def test_a_killed_writer_loses_at_most_its_open_shard(tmp_path, caplog):
    """A process killed mid-run (SIGKILL: no close, no flush): its closed shards read whole, the one it was writing
    is left `.open`, skipped by the reader with a warning, and nothing else is damaged."""
    script = textwrap.dedent(
        f"""
        import os, pathlib, signal, time
        from prorl_adapter.models import JobState
        from prorl_adapter.service.records import Records
        from tests.test_records import trajectory
        records = Records(pathlib.Path({str(tmp_path)!r}), "r", shard_bytes=1, flush_rows=1)
        writer = records.trajectories
        for n in range(3):
            records.prorl_job_finished(trajectory(f"closed{{n}}"), JobState.done)
        while writer.recorded < 3:
            time.sleep(0.01)  # polling: the writer's thread counts the rows it wrote
        writer.shard_bytes = 1 << 40  # the next shard stays open
        records.prorl_job_finished(trajectory("open"), JobState.done)
        while writer.recorded < 4:
            time.sleep(0.01)  # polling, as above
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=".", timeout=120)
    assert done.returncode == -signal.SIGKILL
    names = sorted(p.name for p in (tmp_path / "trajectories").iterdir())
    assert len(names) == 4 and names[0].startswith(".") and names[0].endswith(".parquet.open")
    assert pq.read_table(tmp_path / "trajectories").num_rows == 3  # a plain Parquet reader skips the open shard
    with caplog.at_level(logging.WARNING):
        assert [t.job_id for t in read_trajectories(tmp_path)] == ["closed0", "closed1", "closed2"]
    assert "not closed" in caplog.text


async def test_the_service_records_every_finished_job_failures_included(tmp_path):
    async with rollout_stack(script=[bash_call("echo hi > done.txt"), "finished"], record_dir=tmp_path) as stack:
        done = await stack.client.run(shell_job(max_turns=2, labels={"split": "eval"}), wait=60)
        failed = await stack.client.run(shell_job(max_context_tokens=2), wait=60)
    records = {t.job_id: t for t in read_trajectories(tmp_path)}  # the service closed its shard as it stopped
    assert records == {done.job_id: done, failed.job_id: failed}
    assert failed.error is not None and records[failed.job_id].error == failed.error
    assert json.loads(json.dumps(records[done.job_id].labels)) == {"split": "eval"}
    assert records[done.job_id].timings.eval_s > 0  # counted before the job was delivered, not after


async def test_every_gateway_call_is_recorded_also_one_answered_after_its_episode_ended(tmp_path):
    async with rollout_stack(script=[bash_call("ls")], record_dir=tmp_path) as stack:
        gateway = stack.app[PIPELINE].gateway
        episode = gateway.open("job-1", JobRequest(task="shell"))
        call = {"model": "m", "messages": [{"role": "user", "content": "go"}]}
        first = await (await stack.gateway.post(f"/gateway/{episode.key}/v1/chat/completions", json=call)).json()
        stack.llm.cue(Hang("late"))
        late = asyncio.ensure_future(  # answered only after the episode has ended
            stack.gateway.post(f"/gateway/{episode.key}/v1/messages", json={**call, "max_tokens": 9})
        )
        await stack.llm.until(lambda: stack.llm.held == 1)
        gateway.close(episode)
        stack.llm.release()
        assert (await late).status == 404
    rows = list(read_rows(tmp_path, "gateway_calls"))
    assert [(r["job_id"], r["protocol"], r["call"], r["in_episode_log"]) for r in rows] == [
        ("job-1", "chat", 0, True),
        ("job-1", "messages", None, False),
    ]
    assert rows[0]["episode"] == rows[1]["episode"] == episode.run_id != episode.key  # never the credential
    assert (
        rows[0]["prompt_ids"] == first["prompt_token_ids"]
        and rows[0]["response_ids"] == first["choices"][0]["token_ids"]
    )
    assert json.loads(rows[0]["tool_calls_json"]) == [{"name": "bash", "arguments": {"command": "ls"}}]
    assert rows[0]["token_versions"] == [0] * len(rows[0]["response_ids"])


def test_a_record_path_that_is_a_file_is_refused_at_start_in_one_line(tmp_path, capsys):
    from prorl_adapter.service.cli import main

    taken = tmp_path / "records"
    taken.write_text("not a directory")
    argv = ["serve", "--sandbox-url", "http://s", "--llm-url", "http://l", "--tokenizer", "t", "--record", str(taken)]
    assert main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"--record {taken}: it is a file" in line


def test_rows_of_the_earlier_schema_read_with_what_they_lack_as_null_and_a_later_one_is_refused(tmp_path):
    """Schema 1 had no conversation columns: its rows read back as trajectories without prompt messages."""
    delivered = trajectory("old")
    row = trajectory_row(delivered, JobState.done, "r", 0.0)
    new = ("prompt_messages_json", "prompt_tools_json")
    old_schema = pa.schema([field for field in TRAJECTORY_SCHEMA if field.name not in new])
    shards = tmp_path / "trajectories"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist([{**row, "schema_version": 1}], schema=old_schema), shards / "a.parquet")
    [read] = read_trajectories(tmp_path)
    assert read == delivered and read.prompt_messages == [] and read.prompt_tools is None
    later = pa.Table.from_pylist([{**row, "schema_version": RECORD_SCHEMA + 1}], schema=TRAJECTORY_SCHEMA)
    pq.write_table(later, shards / "b.parquet")
    with pytest.raises(ValueError, match="newer than"):
        list(read_trajectories(tmp_path))
