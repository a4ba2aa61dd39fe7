"""The Ray launcher without a cluster: the command lines of the parts, which nodes run them, the `ray` CLI's
parser, and the server process that cannot outlive its starter (integration_tests/test_ray_cluster.py runs
the stack on a real multi-node Ray cluster)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prorl_adapter.launch import commands
from prorl_adapter.launch.cli import add_ray_parser
from prorl_adapter.launch.commands import PlacementError, place, runtime_nodes
from prorl_adapter.launch.process import PartFailed, ServerProcess, free_port, http_ready, redis_ready

TOKEN = "tok-en_1"


# -- the command lines: the contract with the servers' CLIs --------------------------------------------------
def test_redis_keeps_nothing_on_disk_and_reads_its_password_from_stdin():
    argv = commands.redis_argv("/usr/bin/redis-server", "10.0.0.5", 6400)
    assert argv == [
        "/usr/bin/redis-server",
        "-",
        "--port",
        "6400",
        "--bind",
        "10.0.0.5",
        "--protected-mode",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    assert commands.redis_config(TOKEN) == f'requirepass "{TOKEN}"\n'
    assert commands.redis_config('a"b\\c') == 'requirepass "a\\"b\\\\c"\n'
    assert commands.redis_url("10.0.0.5", 6400, TOKEN) == f"redis://:{TOKEN}@10.0.0.5:6400/0"


def test_a_token_that_is_not_url_safe_is_quoted_in_the_redis_url():
    assert commands.redis_url("::1", 6400, "a/b@c") == "redis://:a%2Fb%40c@[::1]:6400/0"


def test_a_replica_listens_on_its_node_with_its_secrets_in_its_environment():
    argv = commands.service_argv(
        "/venv/bin/python",
        "10.0.0.5",
        8766,
        index=1,
        tokenizer="Qwen/Qwen2.5-7B-Instruct",
        llm_urls=["http://gpu-0:8000", "sglang+http://gpu-1:8000"],
        extra=["--timeout", "600"],
    )
    assert argv == [
        "/venv/bin/python",
        "-m",
        "prorl_adapter",
        "serve",
        "--host",
        "10.0.0.5",
        "--port",
        "8766",
        "--service-id",
        "prorl-rollout-1",
        "--advertise-url",
        "http://10.0.0.5:8766",
        "--gateway-host",
        "10.0.0.5",
        "--tokenizer",
        "Qwen/Qwen2.5-7B-Instruct",
        "--llm-url",
        "http://gpu-0:8000",
        "--llm-url",
        "sglang+http://gpu-1:8000",
        "--timeout",
        "600",
    ]
    assert "--sandbox-url" not in argv  # the runtimes register themselves
    env = commands.service_env(TOKEN, "redis://:t@10.0.0.1:6400/0")
    args = parsed_with_env(rollout_parser(), argv[3:], env)
    assert (args.token, args.sandbox_token, args.buffer) == (TOKEN, TOKEN, "redis://:t@10.0.0.1:6400/0")


def test_a_runtime_registers_with_every_replica():
    argv = commands.runtime_argv(
        "/venv/bin/python",
        "10.0.0.7",
        8765,
        service_urls=["http://10.0.0.5:8766", "http://10.0.0.6:8766"],
        state_dir=Path("/tmp/prorl-runtime-state-x"),
        extra=["--backend", "bwrap"],
    )
    assert argv == [
        "/venv/bin/python",
        "-m",
        "sandbox_runtime",
        "serve",
        "--host",
        "10.0.0.7",
        "--port",
        "8765",
        "--advertise-url",
        "http://10.0.0.7:8765",
        "--register",
        "http://10.0.0.5:8766",
        "--register",
        "http://10.0.0.6:8766",
        "--state-dir",
        "/tmp/prorl-runtime-state-x",
        "--backend",
        "bwrap",
    ]
    args = parsed_with_env(runtime_parser(), argv[3:], commands.runtime_env(TOKEN))
    assert (args.token, args.register_token) == (None, TOKEN)  # its own token it makes at start-up


def rollout_parser():
    from prorl_adapter.service.cli import build_parser

    return build_parser


def runtime_parser():
    from sandbox_runtime.cli import build_parser

    return build_parser


def parsed_with_env(build_parser, argv: list[str], env: dict[str, str]):
    """The CLI's parse of `argv` with `env` set: the CLIs read their secrets' defaults from the environment
    when the parser is built."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return build_parser().parse_args(argv)


def test_a_part_handed_its_socket_serves_on_it_and_advertises_its_port():
    """The actor binds the socket and hands it over (no other process can take the port in between): the server
    is told its descriptor, not an address to bind."""
    service = commands.service_argv("py", "10.0.0.5", 40001, index=0, tokenizer="t", listen_fd=7)
    runtime = commands.runtime_argv("py", "10.0.0.7", 40002, service_urls=[], state_dir="/s", listen_fd=8)
    for argv, parser, fd, url in [
        (service, rollout_parser(), 7, "http://10.0.0.5:40001"),
        (runtime, runtime_parser(), 8, "http://10.0.0.7:40002"),
    ]:
        assert "--host" not in argv and "--port" not in argv
        assert argv[argv.index("--advertise-url") + 1] == url
        assert parser().parse_args(argv[3:]).listen_fd == fd


def test_an_ipv6_node_address_is_bracketed_in_urls_only():
    argv = commands.runtime_argv("py", "fd00::7", 1, service_urls=[], state_dir="/s")
    assert argv[argv.index("--host") + 1] == "fd00::7"
    assert argv[argv.index("--advertise-url") + 1] == "http://[fd00::7]:1"


# -- which nodes run what ------------------------------------------------------------------------------------
def node(node_id: str, *, head: bool = False, alive: bool = True, labels=None, **resources) -> dict:
    resources = {"CPU": 2.0, **resources} | ({commands.HEAD_RESOURCE: 1.0} if head else {})
    return {"NodeID": node_id, "Alive": alive, "Resources": resources, "Labels": labels or {}}


NODES = [
    node("c-worker", prorl_runtime=1.0, labels={"pool": "sandbox"}),
    node("b-dead", alive=False, prorl_runtime=1.0),
    node("z-head", head=True),
    node("a-worker", prorl_runtime=1.0),
]


def test_redis_goes_to_the_head_and_replicas_round_robin_from_it():
    placement = place(NODES, replicas=4, with_redis=True, runtime_resource="prorl_runtime")
    assert placement.redis == "z-head"
    assert placement.services == ("z-head", "a-worker", "c-worker", "z-head")
    assert placement.runtimes == ("a-worker", "c-worker")  # the dead node has none


def test_a_given_redis_url_places_no_redis():
    assert place(NODES, replicas=1, with_redis=False).redis is None


def test_runtimes_by_node_ids_label_or_everywhere():
    assert runtime_nodes(NODES, node_ids=["c-worker", "c-worker"]) == ["c-worker"]
    assert runtime_nodes(NODES, label="pool=sandbox") == ["c-worker"]
    assert runtime_nodes(NODES) == ["z-head", "a-worker", "c-worker"]


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        ({"resource": "gpu_sandbox"}, r"no alive node with the resource 'gpu_sandbox'"),
        ({"node_ids": ["b-dead"]}, r"runtime nodes b-dead are not alive nodes"),
        ({"label": "pool"}, r"runtime label 'pool': write KEY=VALUE"),
        ({"label": "pool=none"}, r"no alive node with the label pool=none"),
        ({"resource": "prorl_runtime", "label": "pool=sandbox"}, r"one way"),
    ],
)
def test_a_selection_of_no_node_says_which(selection, message):
    with pytest.raises(PlacementError, match=message):
        runtime_nodes(NODES, **selection)


def test_replicas_on_named_nodes_and_at_least_one():
    assert place(NODES, replicas=2, with_redis=True, service_nodes=["a-worker"]).services == ("a-worker",) * 2
    with pytest.raises(PlacementError, match="at least one"):
        place(NODES, replicas=0, with_redis=True)
    with pytest.raises(PlacementError, match="no alive node"):
        place([node("x", alive=False)], replicas=1, with_redis=True)


# -- the CLI's parser ------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="prorl-rollout")
    add_ray_parser(root.add_subparsers(dest="command", required=True))
    return root


def test_ray_up_takes_the_stack_settings():
    where = ["--replicas", "2", "--runtime-resource", "prorl_runtime"]
    llms = ["--llm-url", "http://a:1", "--llm-url", "http://b:1"]
    args = parser().parse_args(
        ["ray", "up", "--tokenizer", "/m", *where, *llms, "--service-args", "--timeout 60 --plugin x"]
    )
    assert (args.command, args.ray_command, args.address, args.namespace) == ("ray", "up", "auto", "prorl")
    assert (args.replicas, args.runtime_resource, args.runtime_nodes) == (2, "prorl_runtime", None)
    assert args.llm_url == ["http://a:1", "http://b:1"]
    assert args.service_args == ["--timeout", "60", "--plugin", "x"] and args.runtime_args == []


def test_ray_up_takes_node_ids_and_refuses_two_selections(capsys):
    args = parser().parse_args(["ray", "up", "--tokenizer", "/m", "--runtime-nodes", "n1, n2"])
    assert args.runtime_nodes == ["n1", "n2"]
    with pytest.raises(SystemExit):
        parser().parse_args(["ray", "up", "--tokenizer", "/m", "--runtime-nodes", "n1", "--runtime-resource", "r"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["ray", "up", "--tokenizer", "/m", "--replicas", "0"])


@pytest.mark.parametrize("command", ["down", "status"])
def test_down_and_status_name_the_cluster_and_namespace(command):
    args = parser().parse_args(["ray", command, "--address", "ray://h:10001", "--namespace", "run-7"])
    assert (args.ray_command, args.address, args.namespace) == (command, "ray://h:10001", "run-7")


# -- one server process ----------------------------------------------------------------------------------------
def gone(pid: int) -> bool:
    """No such process, or a zombie: whatever reaps orphans here may be slow to."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling a condition with a deadline
    return True


def http_server(tmp_path: Path, before: str = "") -> tuple[ServerProcess, int]:
    port = free_port("127.0.0.1")
    script = f"{before}exec {shlex.quote(sys.executable)} -m http.server --bind 127.0.0.1 {port}"
    return ServerProcess("test server", ["sh", "-c", script], tmp_path / "log"), port


def test_stop_reaches_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    server, port = http_server(tmp_path, before=f"sleep 300 & echo $! > {pidfile}; ")
    server.start().wait_ready(http_ready(f"http://127.0.0.1:{port}/"), "GET /", 20)
    child = int(pidfile.read_text())
    assert not gone(child)
    server.stop(timeout_s=10)
    assert gone(server.pid) and wait_for(lambda: gone(child))


def test_a_part_that_exits_fails_with_its_log(tmp_path):
    server = ServerProcess(
        "prorl-rollout-0", ["sh", "-c", "echo no such flag --advertise-url >&2; exit 3"], tmp_path / "l"
    )
    with pytest.raises(PartFailed, match=r"(?s)prorl-rollout-0 on node n exited with status 3.*no such flag"):
        server.start().wait_ready(lambda: False, "GET /healthz", 20, where=" on node n")


def test_a_part_that_never_answers_is_killed_at_the_deadline(tmp_path):
    server = ServerProcess("quiet", ["sleep", "300"], tmp_path / "log").start()
    with pytest.raises(PartFailed, match=r"quiet did not answer GET /healthz within 0.3 s(?s:.)*the log is empty"):
        server.wait_ready(lambda: False, "GET /healthz", 0.3)
    assert gone(server.pid)


def test_the_process_dies_with_its_starter(tmp_path):
    """SIGKILL the process that started it (as `ray.kill` does an actor): the kernel kills the server too."""
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from prorl_adapter.launch.process import ServerProcess; "
            f"p = ServerProcess('x', ['sleep', '300'], Path({str(tmp_path / 'log')!r})).start(); "
            "print(p.pid, flush=True); time.sleep(300)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = int(starter.stdout.readline())
    assert not gone(server_pid)
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    assert wait_for(lambda: gone(server_pid)), "the server outlived its starter"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_starts_from_its_command_line_and_answers_with_the_token_from_its_stdin(tmp_path):
    port = free_port("127.0.0.1")
    argv = commands.redis_argv(shutil.which("redis-server"), "127.0.0.1", port)
    server = ServerProcess("redis", argv, tmp_path / "log", stdin_text=commands.redis_config(TOKEN)).start()
    try:
        server.wait_ready(redis_ready("127.0.0.1", port, TOKEN), "PING", 20)
        assert not redis_ready("127.0.0.1", port, "wrong")()
        assert TOKEN not in Path(f"/proc/{server.pid}/cmdline").read_text()
    finally:
        server.stop(5)
