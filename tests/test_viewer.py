"""The rollout viewer's endpoints (docs/viewer.md): `GET /v1/jobs` and `GET /v1/jobs/{id}/tokens` of the live
service (create_app on the stand-ins), the same shapes from `prorl-rollout view DIR` over a records directory
written by `Records`, the page and its assets served without the token while the data needs it, bad queries as
400s, and token pieces that concatenate to the decoded text. The page in a real browser:
integration_tests/test_viewer_browser.py."""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from prorl_adapter.models import JobError, JobState
from prorl_adapter.service import viewer
from prorl_adapter.service.records import Records
from prorl_adapter.service.records_viewer import create_view_app, run_view
from tests.fakes import HANG, bash_call, finish_call, on_virtual_time, rollout_stack, shell_job
from tests.fakes.chat import CharChat

from .test_records import trajectory

REPO = Path(__file__).resolve().parent.parent
SCRIPT = [bash_call("echo hi"), finish_call("42")]
TINY_TOKENIZER = REPO / "models" / "tiny-qwen2"  # make llm


# -- the live service ---------------------------------------------------------------------------------------
@on_virtual_time
async def test_jobs_lists_this_replicas_jobs_newest_first_with_reward_turns_versions_and_staleness():
    async with rollout_stack(script=SCRIPT) as stack:
        first = await stack.client.run(shell_job(labels={"run": "a"}), wait=60)
        await stack.client.set_policy_version(3)
        stack.llm.cue(HANG)
        held = await stack.client.submit(shell_job())
        await stack.llm.until(lambda: stack.llm.held == 1)
        listed = await (await stack.http.get("/v1/jobs")).json()
        done = await (await stack.http.get("/v1/jobs?state=done&task=shell&limit=1")).json()
        none = await (await stack.http.get("/v1/jobs?task=other")).json()
        await stack.client.cancel(held.job_id)
    assert listed["source"] == "live" and listed["policy_version"] == 3 and listed["matched"] == 2
    running, finished = listed["jobs"]  # newest first
    assert running["job_id"] == held.job_id and running["state"] == "running" and running["reward"] is None
    assert running["staleness"] is None and running["num_turns"] is None
    assert finished["job_id"] == first.job_id and finished["state"] == "done"
    assert finished["reward"] == first.reward == 1.0 and finished["num_turns"] == first.num_turns == 2
    assert finished["policy_version_min"] == 0 and finished["staleness"] == 3  # 3 versions behind
    assert finished["labels"] == {"run": "a"} and finished["error_class"] is None and finished["submitted_at"] > 0
    assert finished["timings"]["run_s"] == first.timings.run_s
    assert [j["job_id"] for j in done["jobs"]] == [first.job_id] and done["matched"] == 1
    assert none == {"jobs": [], "matched": 0, "policy_version": 3, "source": "live"}


@on_virtual_time
async def test_jobs_refuses_a_bad_query_with_a_400_naming_it():
    async with rollout_stack() as stack:
        for query in ("state=finished", "limit=0", "limit=10001", "limit=x", "colour=red", "state=done&state=failed"):
            response = await stack.http.get(f"/v1/jobs?{query}")
            body = await response.json()
            assert response.status == 400 and body["status"] == 400, query
            assert query.split("=")[0] in body["error"], (query, body)


@on_virtual_time
async def test_tokens_gives_each_ids_piece_and_each_response_tokens_version():
    async with rollout_stack(script=SCRIPT) as stack:
        result = await stack.client.run(shell_job(), wait=60)
        response = await stack.http.get(f"/v1/jobs/{result.job_id}/tokens")
        tokens = await response.json()
        unknown = await stack.http.get("/v1/jobs/nope/tokens")
        unknown_error = (await unknown.json())["error"]
    assert response.status == 200 and tokens["tokenizer"] == "char-chat" and tokens["job_id"] == result.job_id
    [own] = tokens["sequences"]
    chat = CharChat()
    assert "".join(own["prompt"]) == chat.decode(result.prompt_ids) and len(own["prompt"]) == len(result.prompt_ids)
    assert "".join(own["response"]) == chat.decode(result.response_ids)
    assert own["versions"] == result.token_versions()
    assert unknown.status == 404 and unknown_error == "no job 'nope'"


@on_virtual_time
async def test_tokens_of_an_unfinished_job_is_a_202_with_its_state():
    async with rollout_stack(script=SCRIPT) as stack:
        stack.llm.cue(HANG)
        job = await stack.client.submit(shell_job())
        await stack.llm.until(lambda: stack.llm.held == 1)
        response = await stack.http.get(f"/v1/jobs/{job.job_id}/tokens")
        body = await response.json()
        await stack.client.cancel(job.job_id)
    assert response.status == 202 and body["state"] == "running" and body["job_id"] == job.job_id


@on_virtual_time
async def test_the_page_is_public_and_locked_down_while_the_data_needs_the_token():
    async with rollout_stack(token="s3cret") as stack:
        page = await stack.http.get("/viewer")
        html = await page.text()
        script = await stack.http.get("/viewer/viewer.js")
        style = await stack.http.get("/viewer/viewer.css")
        other = await stack.http.get("/viewer/index.html")
        refused = [(await stack.http.get(path)).status for path in ("/v1/jobs", "/v1/jobs/x/tokens", "/v1/status")]
        allowed = await stack.http.get("/v1/jobs", headers={"Authorization": "Bearer s3cret"})
    assert page.status == 200 and page.content_type == "text/html" and 'src="viewer/viewer.js"' in html
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert script.status == 200 and script.content_type == "text/javascript"
    assert style.status == 200 and style.content_type == "text/css" and other.status == 401  # nothing else is open
    assert "<script>" not in html.replace('<script src="viewer/viewer.js" defer></script>', "")  # no inline script
    assert refused == [401, 401, 401] and allowed.status == 200


@on_virtual_time
async def test_the_page_and_the_data_ops_are_in_the_openapi_document():
    async with rollout_stack() as stack:
        document = await (await stack.http.get("/openapi.json")).json()
    paths = document["paths"]
    assert all(paths[path]["get"]["security"] == [] for path in ("/viewer", "/viewer/viewer.js", "/viewer/viewer.css"))
    assert "security" not in paths["/v1/jobs"]["get"] and "security" not in paths["/v1/jobs/{id}/tokens"]["get"]
    assert {p["name"] for p in paths["/v1/jobs"]["get"]["parameters"]} == {"state", "task", "limit"}


# -- prorl-rollout view DIR -----------------------------------------------------------------------------------
def recorded(directory: Path, *trajectories_and_states) -> None:
    records = Records(directory, "replica-1")
    for t, state in trajectories_and_states:
        records.prorl_job_finished(t, state)
    records.close()


async def test_view_serves_the_records_in_the_live_endpoints_shapes(tmp_path):
    done = trajectory("job-a", reward=1.0)
    failed = trajectory("job-b", reward=0.0, error=JobError(error_class="eval", message="<b>the check</b>"))
    recorded(tmp_path, (done, JobState.done), (failed, JobState.failed))
    async with TestClient(TestServer(create_view_app(tmp_path))) as http:
        status = await (await http.get("/v1/status")).json()
        listed = await (await http.get("/v1/jobs")).json()
        only_failed = await (await http.get("/v1/jobs?state=failed")).json()
        result = await http.get("/v1/jobs/job-b/result")
        with_wait = await http.get("/v1/jobs/job-b/result?wait=5")
        tokens = await (await http.get("/v1/jobs/job-a/tokens")).json()
        unknown = await http.get("/v1/jobs/nope/result")
        unknown_error = (await unknown.json())["error"]
        failed_read = await result.json()
        bad = await http.get("/v1/jobs?limit=-1")
        page = await http.get("/viewer")
    assert status["source"] == f"records of {tmp_path}" and status["trajectories"] == 2 and status["shards"] == 1
    assert status["policy_version"] == 4 and status["tokenizer"] is None and status["open_shards"] == 0
    assert [j["job_id"] for j in listed["jobs"]] == ["job-b", "job-a"] and listed["matched"] == 2  # newest first
    assert listed["source"] == status["source"] and listed["policy_version"] == 4
    b = listed["jobs"][0]
    assert b["state"] == "failed" and b["error_class"] == "eval" and b["error"] == "<b>the check</b>"
    assert b["reward_components"] == {"outcome": 0.0, "step_cost": -0.02} and b["staleness"] == 1
    assert b["timings"]["eval_s"] == 0.75 and b["recorded_at"] > 0 and b["submitted_at"] is None
    assert [j["job_id"] for j in only_failed["jobs"]] == ["job-b"]
    assert result.status == 200 and failed_read == failed.model_dump(mode="json")
    assert with_wait.status == 200
    assert tokens["tokenizer"] is None and [s["prompt"] for s in tokens["sequences"]] == [None, None]
    assert [s["versions"] for s in tokens["sequences"]] == [[3, 3, 4, 4, None, 3], [3]]  # each sequence's own
    assert unknown.status == 404 and "nope" in unknown_error
    assert bad.status == 400 and page.status == 200


async def test_view_decodes_with_a_tokenizer_and_reads_shards_closed_after_it_started(tmp_path):
    recorded(tmp_path, (trajectory("first"), JobState.done))
    (tmp_path / "trajectories" / ".later.parquet.open").write_bytes(b"PAR1 being written")
    async with TestClient(TestServer(create_view_app(tmp_path, tokenizer=CharChat()))) as http:
        before = await (await http.get("/v1/status")).json()
        recorded(tmp_path, (trajectory("second"), JobState.cancelled))  # a new shard, closed
        listed = await (await http.get("/v1/jobs")).json()
        tokens = await (await http.get("/v1/jobs/second/tokens")).json()
    assert before["trajectories"] == 1 and before["open_shards"] == 1 and before["tokenizer"] == "char-chat"
    assert [j["job_id"] for j in listed["jobs"]] == ["second", "first"] and listed["jobs"][0]["state"] == "cancelled"
    t = trajectory("second")
    assert "".join(tokens["sequences"][0]["prompt"]) == CharChat().decode(t.prompt_ids)
    assert len(tokens["sequences"][1]["response"]) == 1


async def test_view_with_a_token_keeps_the_data_behind_it_and_the_page_public(tmp_path):
    recorded(tmp_path, (trajectory("a"), JobState.done))
    async with TestClient(TestServer(create_view_app(tmp_path, token="t0k"))) as http:
        refused = [
            (await http.get(p)).status for p in ("/v1/status", "/v1/jobs", "/v1/jobs/a/result", "/v1/jobs/a/tokens")
        ]
        page = (await http.get("/viewer")).status, (await http.get("/viewer/viewer.js")).status
        allowed = (await http.get("/v1/jobs/a/result", headers={"Authorization": "Bearer t0k"})).status
    assert refused == [401, 401, 401, 401] and page == (200, 200) and allowed == 200


def view_args(directory: Path, **more) -> argparse.Namespace:
    defaults = {"host": "127.0.0.1", "port": 0, "tokenizer": None, "token": None, "log_level": "WARNING"}
    return argparse.Namespace(directory=directory, **{**defaults, **more})


def test_view_refuses_to_listen_beyond_loopback_without_a_token_and_a_folder_without_records(tmp_path, capsys):
    recorded(tmp_path, (trajectory("a"), JobState.done))
    assert run_view(view_args(tmp_path, host="0.0.0.0")) == 2
    assert "refusing to listen on '0.0.0.0' without a token" in capsys.readouterr().err
    assert run_view(view_args(tmp_path / "trajectories")) == 2
    assert "holds no trajectories/ folder" in capsys.readouterr().err


# -- token pieces -----------------------------------------------------------------------------------------------
def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer's decode: one token per UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_token_pieces_put_a_character_split_across_tokens_on_its_last_token():
    text = "héllo 🙂 <b>"
    ids = list(text.encode())
    pieces = viewer.token_pieces(ids, byte_decode)
    assert "".join(pieces) == text and len(pieces) == len(ids)
    assert pieces[1:3] == ["", "é"] and pieces[7:11] == ["", "", "", "🙂"]
    assert viewer.token_pieces([0x41, 0xFF], byte_decode) == ["A", "\ufffd"]  # a byte that is no character, kept
    assert (
        "".join(viewer.token_pieces([0xFF, 0x41, 0xFF, 0xFF, 0xFF, 0xFF, 0x42], byte_decode))
        == "\ufffdA\ufffd\ufffd\ufffd\ufffdB"
    )
    assert viewer.token_pieces([], byte_decode) == []


def test_token_pieces_keep_what_a_token_owes_its_neighbours_such_as_a_sentencepiece_words_space():
    vocab = {1: "\u2581hello", 2: "\u2581world", 3: "!"}

    def decode(ids: list[int]) -> str:  # SentencePiece's: a word's marker is a space, but not at the start
        return "".join(vocab[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    assert [decode([i]) for i in (1, 2, 3)] == ["hello", "world", "!"]  # alone, the space is lost
    assert viewer.token_pieces([1, 2, 3], decode) == ["hello", " world", "!"]


@pytest.mark.skipif(not TINY_TOKENIZER.is_dir(), reason="the tiny model's tokenizer is built by make llm")
def test_token_pieces_of_a_real_tokenizer_concatenate_to_its_decoded_text():
    from prorl_adapter.service.chat import ChatTokenizer

    chat = ChatTokenizer(str(TINY_TOKENIZER))
    text = "Grüße, 世界! 🙂 <script>alert(1)</script>\n\tdone"
    ids = chat.encode(text)
    for pieces in (viewer.token_pieces(ids, chat.decode, chat.token_texts(ids)), viewer.windowed(ids, chat.decode)):
        assert "".join(pieces) == chat.decode(ids) == text and len(pieces) == len(ids)


def test_the_viewer_files_are_package_data_of_the_wheel():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "prorl_adapter.service.viewer" in config["packages"]
    patterns = config["package-data"]["prorl_adapter.service.viewer"]
    files = [p for p in os.listdir(viewer.STATIC) if not p.endswith((".py", ".pyc")) and p != "__pycache__"]
    assert sorted(files) == sorted(["index.html", *viewer.ASSETS])
    assert all(any(Path(name).match(pattern) for pattern in patterns) for name in files)
