"""A newcomer's first hour with the rollout service and the trainer-side commands (issue 46): start-up failures
of the real `prorl-rollout` are one line naming the flag that fixes them, the LLM pool's log says each health
transition once, the verl pre-flight's --help and its errors, and the quickstart's documented command line."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_adapter.service.cli import TINY_TOKENIZER, tokenizer_problem
from tests.fakes import llm_pool, on_virtual_time, scripted_llms

REPO = Path(__file__).resolve().parent.parent
ROLLOUT = Path(sys.executable).parent / "prorl-rollout"  # the installed command, as a user runs it


def run(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The command, with a Hugging Face home of its own (an empty cache) and none of the caller's PRORL_* or HF_*
    settings, unless given."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PRORL_", "HF_", "TRANSFORMERS_"))}
    clean.update(HF_HOME=str(tmp_path / "hf"), **env)
    return subprocess.run(argv, capture_output=True, text=True, env=clean, cwd=REPO, timeout=120)


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A port that refuses connections for as long as the test runs: bound here, never listening (a port closed
    and given back could be taken by another process before the test connects to it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A directory that passes the start-up check (the check looks for a tokenizer's files, it loads none)."""
    path = tmp_path / "tok"
    path.mkdir()
    (path / "tokenizer.json").write_text("{}")
    return path


def assert_one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("prorl-rollout")
    for fragment in fragments:
        assert fragment in line
    return line


# -- prorl-rollout serve: start-up failures ---------------------------------------------------------------------
def test_a_port_in_use_is_one_line_naming_the_port_flag(tmp_path, tokenizer_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run([str(ROLLOUT), "serve", "--tokenizer", str(tokenizer_dir), "--port", str(port)], tmp_path)
        debug = run(
            [str(ROLLOUT), "serve", "--tokenizer", str(tokenizer_dir), "--port", str(port), "--debug"], tmp_path
        )
    assert result.returncode == 1
    assert_one_line(result, f"cannot listen on 127.0.0.1:{port}", "Address already in use", "--port")
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # asked for: the traceback


def test_a_hub_tokenizer_not_cached_fails_at_once_offline_naming_the_flag_and_the_tiny_models_path(tmp_path):
    result = run([str(ROLLOUT), "serve", "--tokenizer", "no-such-org/no-such-model"], tmp_path, HF_HUB_OFFLINE="1")
    assert_one_line(result, "--tokenizer no-such-org/no-such-model", "HF_HUB_OFFLINE", TINY_TOKENIZER)


def test_a_hub_tokenizer_not_cached_with_the_hub_unreachable_fails_after_one_attempt(tmp_path, refusing_port):
    endpoint = f"http://127.0.0.1:{refusing_port}"
    result = run([str(ROLLOUT), "serve", "--tokenizer", "org/model"], tmp_path, HF_ENDPOINT=endpoint)
    assert_one_line(result, "--tokenizer org/model", f"{endpoint} cannot be reached", TINY_TOKENIZER)


def test_a_bad_flag_value_is_one_line_naming_the_flag(tmp_path):
    result = run([str(ROLLOUT), "serve", "--tokenizer", "t", "--log-level", "LOUD"], tmp_path)
    assert result.returncode == 2
    assert_one_line(result, "--log-level", "'LOUD' is not a log level: one of DEBUG, INFO", "--help")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--max-init-workers", "0", "0 must be >= 1"), ("--timeout", "-5", "-5 must be > 0"), ("--timeout", "x", "'x'")],
)
def test_bad_numbers_are_refused_by_the_parser_naming_the_flag(flag, value, says, capsys):
    from prorl_adapter.service.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--tokenizer", "t", flag, value])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"argument {flag}: {says}" in line


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis//mypassword@host:6379", "no scheme"),  # the colon forgotten: no part of it is a scheme
        ("redis//:mypassword@host:6379/0", "no scheme"),
        ("redis:mypassword@host:6379", "no scheme"),
        ("reddis://:mypassword@host:6379/0", "scheme reddis:"),
    ],
)
def test_a_buffer_url_of_no_known_scheme_is_refused_naming_the_flag_and_not_its_password(
    url, named, capsys, monkeypatch
):
    from prorl_adapter.service.cli import main

    monkeypatch.delenv("PRORL_BUFFER_URL", raising=False)
    assert main(["serve", "--tokenizer", "t", "--buffer", url]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("prorl-rollout: --buffer (or PRORL_BUFFER_URL) names no buffer")
    assert named in line and "mypassword" not in line


def test_tokenizer_directories_are_checked_for_a_tokenizer(tmp_path, tokenizer_dir):
    assert tokenizer_problem(str(tokenizer_dir)) is None
    (tmp_path / "empty").mkdir()
    assert "holds no tokenizer" in tokenizer_problem(str(tmp_path / "empty"))
    assert "no such directory" in tokenizer_problem(str(tmp_path / "absent"))
    assert "is a file" in tokenizer_problem(str(tokenizer_dir / "tokenizer.json"))
    assert "neither a directory nor a Hub name" in tokenizer_problem("bad name with spaces")


@pytest.mark.parametrize("files", [("vocab.json", "merges.txt"), ("tokenizer.model",), ("tokenizer_config.json",)])
def test_a_directory_with_any_tokenizers_files_passes(tmp_path, files):
    for name in files:
        (tmp_path / name).write_text("{}")
    assert tokenizer_problem(str(tmp_path)) is None
    if len(files) > 1:  # half a BPE tokenizer is none
        (tmp_path / files[1]).unlink()
        assert "holds no tokenizer" in tokenizer_problem(str(tmp_path))


@pytest.mark.parametrize("where", ["outside the clone", "models/ but no model yet"])
def test_the_tiny_models_path_not_there_says_where_it_was_looked_for_not_hf_download(where, tmp_path, monkeypatch):
    if where != "outside the clone":
        (tmp_path / "models").mkdir()  # the clone before `make llm`
    monkeypatch.chdir(tmp_path)
    problem = tokenizer_problem(TINY_TOKENIZER)
    assert f"no such directory (relative to {tmp_path})" in problem
    assert "run from the clone's root after `make llm`" in problem and "hf download" not in problem


def test_a_path_under_an_existing_directory_is_a_path_not_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.chdir(tmp_path)
    problem = tokenizer_problem("checkpoints/step-100")
    assert "no such directory" in problem and "hf download" not in problem


def test_a_home_relative_tokenizer_is_given_to_the_loader_expanded(tmp_path, monkeypatch, tokenizer_dir):
    from prorl_adapter.service.cli import tokenizer_argument

    monkeypatch.setenv("HOME", str(tmp_path))
    assert tokenizer_problem("~/tok") is None
    assert tokenizer_argument("~/tok") == str(tokenizer_dir)
    assert tokenizer_argument("org/model") == "org/model"


def test_a_hub_name_in_the_local_cache_passes_offline(tmp_path):
    """A Hub tokenizer downloaded before (the cache's layout: refs/main names the snapshot that holds its files)
    passes with HF_HUB_OFFLINE set; run in a process of its own, as huggingface_hub reads HF_HOME on import."""
    commit = "0" * 40
    repo = tmp_path / "hf" / "hub" / "models--org--tok"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "tokenizer.json").write_text("{}")
    check = "from prorl_adapter.service.cli import tokenizer_problem as p; print(p('org/tok'), p('org/other'))"
    result = run([sys.executable, "-c", check], tmp_path, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr
    cached, absent = result.stdout.strip().split(" ", 1)
    assert cached == "None"
    assert "HF_HUB_OFFLINE" in absent  # the same cache, another name: refused, so the cache is what was read


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"]])
def test_help_prints_the_usage(argv, tmp_path):
    result = run([str(ROLLOUT), *argv], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: prorl-rollout") and result.stderr == ""
    if argv[0] == "serve":
        assert "--tokenizer" in result.stdout and TINY_TOKENIZER in result.stdout


@pytest.mark.parametrize(("answer", "problem"), [(200, None), (404, "has no such model")])
def test_a_hub_name_not_cached_is_asked_of_the_hub_once(answer, problem, monkeypatch):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from huggingface_hub import constants

    asked = []

    class Hub(BaseHTTPRequestHandler):
        def do_HEAD(self):
            asked.append(self.path)
            self.send_response(answer)
            self.end_headers()

        def log_message(self, *args):
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Hub) as hub:
        threading.Thread(target=hub.serve_forever, daemon=True).start()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{hub.server_address[1]}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        found = tokenizer_problem("no-such-org/not-cached-model")
        hub.shutdown()
    assert asked == ["/api/models/no-such-org/not-cached-model"]
    assert found is None if problem is None else problem in found and TINY_TOKENIZER in found


# -- the LLM pool's health log: one line per transition ---------------------------------------------------------
POOL_LOG = "prorl_adapter.service.llm"


def pool_lines(caplog: pytest.LogCaptureFixture, outages: bool = False) -> list[tuple[str, str]]:
    """The LLM pool's log lines about its servers (`outages`: those about the fleet's outages instead)."""
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == POOL_LOG]
    return [(level, message) for level, message in lines if message.startswith("LLM outage") == outages]


@on_virtual_time
async def test_a_server_still_starting_is_waited_for_and_its_first_answer_and_recovery_are_logged_once(caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)
    async with scripted_llms(1) as [llm]:
        llm.down = True  # vLLM still loading its model
        async with llm_pool([llm], health_interval=5.0):
            await asyncio.sleep(30.0)  # virtual: six failed health rounds
            starting = pool_lines(caplog)
            llm.down = False
            await asyncio.sleep(12.5)
            up = pool_lines(caplog)[len(starting) :]
            llm.down = True
            await asyncio.sleep(12.5)
            down = pool_lines(caplog)[len(starting) + len(up) :]
            llm.down = False
            await asyncio.sleep(12.5)
            back = pool_lines(caplog)[len(starting) + len(up) + len(down) :]
    [(level, message)] = starting  # said once, not a warning: nothing has gone wrong yet
    assert level == "INFO" and message.startswith(f"waiting for LLM server {llm.url} to answer")
    [(level, message)] = up
    assert level == "INFO" and message.startswith(f"LLM server {llm.url} answers")
    [(level, message)] = down
    assert level == "WARNING" and message.startswith(f"LLM server {llm.url} is unhealthy")
    assert back == [("INFO", f"LLM server {llm.url} is healthy again")]
    # The fleet of one: out while it starts (waited for: info), back, out (a warning: it had answered), back.
    assert [(level, message.split(";")[0].split(" after")[0]) for level, message in pool_lines(caplog, True)] == [
        ("INFO", "LLM outage: none of the 1 LLM servers has answered yet (starting, or a wrong URL)"),
        ("INFO", "LLM outage over"),
        ("WARNING", "LLM outage: none of the 1 LLM servers is healthy"),
        ("INFO", "LLM outage over"),
    ]


@on_virtual_time
async def test_a_server_that_never_answers_is_a_warning_naming_the_flag_from_the_second_notice(caplog):
    caplog.set_level(logging.INFO, logger=POOL_LOG)
    async with scripted_llms(1) as [llm]:
        llm.down = True  # as a mistyped --llm-url, it never answers
        async with llm_pool([llm], health_interval=5.0):
            await asyncio.sleep(150.0)  # virtual: 30 failed health rounds
    first, *later = pool_lines(caplog)
    assert first[0] == "INFO" and first[1].startswith(f"waiting for LLM server {llm.url} to answer")
    assert len(later) == 2  # at 60 and 120 s: once a minute, not every round
    for level, message in later:
        assert level == "WARNING" and f"LLM server {llm.url} has not answered for" in message
        assert "--llm-url" in message


@on_virtual_time
async def test_a_server_that_fails_requests_is_logged_down_before_it_is_logged_healthy_again(caplog):
    from prorl_adapter.models import SamplingParams
    from prorl_adapter.service.llm import Pin
    from tests.fakes import Fail

    caplog.set_level(logging.INFO, logger=POOL_LOG)
    async with scripted_llms(1) as [llm], llm_pool([llm], health_interval=5.0) as pool:
        answered = pool_lines(caplog)
        llm.cue(Fail(500, "boom"), Fail(500, "boom"))  # two in a row: down, found healthy by the next check
        generation = await pool.generate([1], SamplingParams(max_tokens=8), Pin())
    assert generation.server == llm.url
    transitions = [
        (level, message) for level, message in pool_lines(caplog)[len(answered) :] if "failed (" not in message
    ]
    assert [level for level, _ in transitions] == ["WARNING", "INFO"]
    assert transitions[0][1].startswith(f"LLM server {llm.url} is unhealthy")
    assert transitions[1][1] == f"LLM server {llm.url} is healthy again"


# -- python -m prorl_plugins.verl.check: usage, an override it cannot read, every wrong line at once -------------
@pytest.fixture
def verl_check():
    pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")
    from prorl_plugins.verl import check

    return check


def test_the_verl_preflight_prints_its_usage_for_help(tmp_path):
    result = run([sys.executable, "-m", "prorl_plugins.verl.check", "--help"], tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert "python -m prorl_plugins.verl.check <the same overrides" in result.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--no-netwrk"], "unknown option --no-netwrk: the options are --no-network and --help"),
        (["+prorl.task=shell", "x=[unclosed"], "override 'x=[unclosed' cannot be read"),
        (["actor_rollout_ref.rollout.no_such_key=1"], "Could not override 'actor_rollout_ref.rollout.no_such_key'"),
    ],
)
def test_the_verl_preflight_names_a_bad_override_in_one_line(verl_check, argv, says, capsys):
    assert verl_check.main(["-h"]) == 0
    assert "--no-network" in capsys.readouterr().out
    assert verl_check.main([*argv, "--no-network"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("prorl verl plugin: ") and says in line and "hydra.cc" not in line


async def test_the_verl_preflight_lists_a_wrong_verl_line_and_a_task_typo_at_once(verl_check, capsys):
    from prorl_plugins.verl.config import verl_lines
    from tests.fakes.rigs import rollout_stack

    loop_line = "actor_rollout_ref.rollout.agent.default_agent_loop="
    lines = [line for line in verl_lines() if not line.startswith(loop_line)] + [loop_line + "prorl_agnt"]
    async with rollout_stack() as stack:
        argv = [*lines, f"+prorl.service_url={stack.url}", "+prorl.task=python_mth"]
        assert await asyncio.to_thread(verl_check.main, argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "prorl verl plugin: 2 lines are wrong:"
    assert f"write {loop_line}prorl_agent" in err[1]
    assert "prorl.task='python_mth' is not a task of the rollout service" in err[2]
    assert "write +prorl.task=python_math" in err[2]


# -- examples/quickstart/run_rollouts.py: the command its usage line prints ---------------------------------------
def quickstart():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_rollouts", REPO / "examples/quickstart/run_rollouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quickstart_accepts_its_own_usage_line():
    module = quickstart()
    [usage] = [line.strip() for line in module.__doc__.splitlines() if "run_rollouts.py [" in line]
    argv = usage.replace("[", "").replace("]", "").split()[2:]  # after `python examples/.../run_rollouts.py`
    args = module.build_parser().parse_args(argv)
    assert (args.episodes, args.task, args.keep_logs) == (32, "shell", Path("DIR"))


@pytest.mark.parametrize("task", ["shell", "python_math"])
def test_each_quickstart_task_gets_instances_its_handler_reads_and_turns_only_its_tools_can_match(task):
    import re

    from prorl_adapter.service.chat import tool_call_texts
    from prorl_plugins.tasks import prorl_register_tasks

    module = quickstart()
    assert module.build_parser().parse_args(["--task", task]).task == task
    handler = {handler.name: handler for handler in prorl_register_tasks()}[task]
    [first, second] = module.requests(2, task)
    assert (first.task, first.instance["id"] != second.instance["id"]) == (task, True)
    assert handler.user_prompt(first.instance)  # the instance has what the task reads
    tools = {tool.name: tool for tool in handler.tools(first.instance)}
    actions = {
        "shell": [("bash", "command", module.COMMANDS)],
        "python_math": [("python", "code", module.PROGRAMS), ("finish", "answer", module.ANSWERS)],
    }[task]
    for tool, argument, values in actions:
        assert tool in tools
        for text in tool_call_texts(tool, argument, values):
            assert re.fullmatch(first.sampling.regex, text), text
    assert not re.fullmatch(first.sampling.regex, tool_call_texts("bash", "command", ["rm -rf /"])[0])


# -- docs that name fields: they match the models the servers answer with -----------------------------------------
def test_compat_docs_list_the_fields_of_prorl_status_and_the_v1_status_states_they_count():
    import re

    from prorl_adapter.models import JobState
    from prorl_adapter.service.prorl_api import ProRLStatus

    [row] = [line for line in (REPO / "docs/compat.md").read_text().splitlines() if line.startswith("| `GET /status`")]
    listed = re.search(r"`\{([^}]*)\}`", row).group(1)
    assert [name.strip() for name in listed.split(",")] == list(ProRLStatus.model_fields)
    unfinished = {state.value for state in JobState if not state.finished}
    named = set(re.findall(r"`(\w+)`", row.split("`active` counts them:")[1]))
    assert unfinished <= named  # every state `active` counts is placed in one of init, run, eval


@pytest.mark.parametrize("ready", [False, True], ids=["before-ready", "after-ready"])
def test_a_crash_after_start_up_keeps_its_traceback_and_a_failure_before_it_is_one_line(
    ready, tokenizer_dir, monkeypatch, capsys
):
    """In process, the service replaced by one that fails: before it said it listens (a start-up failure, one
    line), or after (a crash hours into serving, whose traceback must not be lost without --debug)."""
    from prorl_adapter.service import cli, server

    async def serve(config, listening=None):
        if ready:
            listening()
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(server, "serve", serve)
    monkeypatch.delenv("PRORL_BUFFER_URL", raising=False)
    assert cli.main(["serve", "--tokenizer", str(tokenizer_dir), "--port", "0"]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("prorl-rollout: ") and "RuntimeError: the disk went away" in last
    if ready:
        assert "Traceback (most recent call last)" in err and "in serve" in err
    else:
        assert err.splitlines() == [last] and "--debug" in last
