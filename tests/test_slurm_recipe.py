"""examples/slurm/slurm_recipe.py: the commands it writes are the ones the real CLIs accept, they line up (every
runtime registers with every replica, the training job gets the service's URL), and the token is never on a
command line, in the job's output or in a file others can read.

The commands are parsed with the projects' own parsers (`build_parser()` of both CLIs), as built functions and,
in `test_the_script_runs_with_stand_ins`, as bash really expands them when it runs the generated script against
stand-ins for Slurm and the servers that record what they were started with. A real single-node Slurm runs the
script in integration_tests/test_slurm.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

from prorl_adapter.service import cli as rollout_cli
from sandbox_runtime import cli as sandbox_cli

RECIPE_FILE = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "slurm_recipe.py"


def _load_recipe_module():
    spec = importlib.util.spec_from_file_location("slurm_recipe", RECIPE_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_recipe"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


slurm_recipe = _load_recipe_module()
Recipe = slurm_recipe.Recipe
TOKEN = "test-token-0123456789abcdef"


def parse(build_parser, args: list[str], env: dict[str, str]):
    """`args` as the CLI parses them in a process whose environment holds `env` (the token defaults come from
    there); a command line the CLI refuses fails the test with argparse's own words."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("PRORL_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        parser = build_parser()
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            return parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{parser.prog} refuses `{shlex.join(args)}`:\n{errors.getvalue()}")


def token_env(token: str = TOKEN) -> dict[str, str]:
    return dict.fromkeys(slurm_recipe.TOKEN_ENV, token)


def recipe(**overrides) -> Recipe:
    settings = {"nodes": 3, "tokenizer": "Qwen/Qwen2.5-7B-Instruct", "image_dir": "/shared/sif", "replicas": 2}
    settings["llm_urls"] = ("http://gpu-0:8000", "http://gpu-1:8000")
    return Recipe(**{**settings, **overrides})


# -- the commands, as functions ---------------------------------------------------------------------------
def test_a_service_replica_is_what_prorl_rollout_serve_accepts():
    r = recipe(service_args=("--max-run-workers", "64"))
    env = {**token_env(), slurm_recipe.BUFFER_ENV: "redis://:pw@10.0.0.1:6379/0"}
    args = parse(rollout_cli.build_parser, slurm_recipe.service_args(r, 1, "cpu-0"), env)
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8767)
    assert args.buffer == "redis://:pw@10.0.0.1:6379/0"
    assert args.service_id == "prorl-rollout-1"
    assert args.advertise_url == "http://cpu-0:8767"
    assert (args.gateway_host, args.gateway_port, args.gateway_address) == ("0.0.0.0", 8867, "cpu-0:8867")
    assert args.tokenizer == "Qwen/Qwen2.5-7B-Instruct"
    assert args.llm_url == ["http://gpu-0:8000", "http://gpu-1:8000"]
    assert args.max_run_workers == 64
    assert (args.token, args.sandbox_token) == (TOKEN, TOKEN)  # from the environment
    assert not args.sandbox_url  # the runtimes register themselves


def test_a_runtime_is_what_prorl_sandbox_serve_accepts_and_registers_with_every_replica():
    r = recipe(runtime_args=("--max-sandboxes", "64"))
    # The runtime step unsets the other tokens: a runtime keeps the registration token only.
    env = {"PRORL_REGISTRATION_TOKEN": TOKEN}
    args = parse(sandbox_cli.build_parser, slurm_recipe.runtime_args(r, "cpu-2", "cpu-0", "77"), env)
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8765)
    assert (args.backend, args.image_dir) == ("apptainer", [Path("/shared/sif")])
    assert args.advertise_url == "http://cpu-2:8765"
    assert args.register == ["http://cpu-0:8766", "http://cpu-0:8767"] == slurm_recipe.service_urls(r, "cpu-0")
    assert args.state_dir == Path("/tmp/prorl-sandbox-77")
    assert args.max_sandboxes == 64
    assert (args.token, args.register_token) == (None, TOKEN)  # its own token it makes; R from the environment


def test_no_command_carries_the_api_token():
    r = recipe()
    argvs = [
        slurm_recipe.service_args(r, 0, "cpu-0"),
        slurm_recipe.runtime_args(r, "cpu-1", "cpu-0", "7"),
        slurm_recipe.runtime_srun_args(r),
        slurm_recipe.redis_args(r, "10.0.0.1"),
    ]
    secret_flags = {"--token", "--sandbox-token", "--register-token", "--buffer", "--requirepass"}
    assert not [word for argv in argvs for word in argv if word.split("=")[0] in secret_flags]


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed (make test installs it)")
def test_redis_starts_with_the_recipes_flags_and_wants_the_password(tmp_path):
    """Run for real: Redis accepts the flags, and the URL handed to the service is the one it answers on."""
    redis = pytest.importorskip("redis")
    from prorl_adapter.dev.localstack import free_port

    r = recipe(redis_port=free_port())
    argv = ["redis-server", *slurm_recipe.redis_args(r, "127.0.0.1"), "--dir", str(tmp_path)]
    feed = subprocess.run(["bash", "-c", slurm_recipe.redis_config("pw-123")], capture_output=True, text=True)
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    server.stdin.write(feed.stdout)
    server.stdin.close()
    try:
        for line in server.stdout:  # it says when it listens: no polling
            if "Ready to accept connections" in line:
                break
        url = slurm_recipe.redis_url("127.0.0.1", r.redis_port, "pw-123")
        assert redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(slurm_recipe.redis_url("127.0.0.1", r.redis_port, "wrong")).ping()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"gateway_port": 8767}, "the gateway port 8767 is also the service port"),
        ({"runtime_port": 8767}, "the service port 8767 is also the runtime port"),
        ({"redis_port": 70000}, "the Redis port 70000 is not a TCP port"),
        ({"image_dir": None}, "the apptainer backend needs --image-dir"),
        ({"tokenizer": "${HOME}/tok"}, "taken literally"),
        ({"job_name": "two words"}, "may not contain spaces"),
        ({"nodes": 0}, "at least 1"),
    ],
)
def test_an_unusable_recipe_is_refused(overrides, problem):
    with pytest.raises(ValueError, match=problem):
        recipe(**overrides)


# -- rendering --------------------------------------------------------------------------------------------
def bash_words(line: str, env: dict[str, str] | None = None) -> list[str]:
    """The words bash makes of `line` (as arguments of printf), with `env` as the environment."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, text=True, env=env, check=True)
    return done.stdout.split("\0")[:-1]


def test_shell_words_stay_literal_but_for_the_recipes_references():
    literal = ["plain", "", "two words", "it's", 'say "hi"', "$HOME", "`id`", "back\\slash", "a;b|c&d", "*"]
    assert bash_words(slurm_recipe.shell_line(literal)) == literal
    word = f"http://{slurm_recipe.HEAD}:8766/$x"
    env = {"PRORL_HEAD": "cpu-0", "x": "no"}
    assert bash_words(slurm_recipe.shell_word(word), env) == ["http://cpu-0:8766/$x"]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"replicas": 1, "backend": "local", "image_dir": None}, {"train_sbatch": "my train.sbatch", "job_dir": "/x"}],
)
def test_bash_accepts_the_script(overrides, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_recipe.sbatch_script(recipe(**overrides)))
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_command_line_writes_the_script(capsys):
    argv = ["--nodes", "4", "--image-dir", "/shared/sif", "--tokenizer", "Qwen/Qwen2.5-7B-Instruct"]
    argv += ["--llm-url", "http://gpu-0:8000", "--replicas", "2", "--service-arg=--plugin-config=plugins.json"]
    assert slurm_recipe.main(argv) == 0
    expected = recipe(nodes=4, llm_urls=("http://gpu-0:8000",), service_args=("--plugin-config=plugins.json",))
    assert capsys.readouterr().out == slurm_recipe.sbatch_script(expected)
    lines = slurm_recipe.sbatch_script(expected).splitlines()
    assert "#SBATCH --nodes=4" in lines and "#SBATCH --ntasks-per-node=1" in lines


def test_the_command_line_refuses_an_unusable_recipe(capsys):
    with pytest.raises(SystemExit) as exit_:
        slurm_recipe.main(["--nodes", "2", "--tokenizer", "t", "--gateway-port", "8765", "--image-dir", "/i"])
    assert exit_.value.code == 2
    assert "the gateway port 8765 is also the runtime port" in capsys.readouterr().err


# -- the script, run by bash against stand-ins -------------------------------------------------------------
# One stand-in program under each name the script calls. Each records its argv and environment, then acts just
# enough: scontrol lists the nodes, getent resolves every name to loopback, "Redis" listens on its port, the
# servers mark themselves up by their --advertise-url (which the curl stand-in checks, so a health URL that
# is not where a server said it is never answers), srun runs its command once per node with SLURMD_NODENAME.
STAND_IN = r"""
import json, os, signal, socket, subprocess, sys, uuid
from pathlib import Path
from urllib.parse import urlsplit

name, args = Path(sys.argv[0]).name, sys.argv[1:]
record = Path(os.environ["PRORL_TEST_RECORD"])
stdin = sys.stdin.read() if name == "redis-server" else ""
entry = {"name": name, "argv": args, "env": dict(os.environ), "stdin": stdin}
partial = record / f".{uuid.uuid4().hex}"
partial.write_text(json.dumps(entry))
partial.rename(record / f"{name}-{uuid.uuid4().hex}.json")

def flag(name):
    return args[args.index(name) + 1]

if name == "scontrol":
    print("\n".join(os.environ["PRORL_TEST_NODES"].split()))
elif name == "getent":
    print(f"127.0.0.1       STREAM {args[-1]}")
elif name == "curl":
    sys.exit(0 if (record / ("up-" + urlsplit(args[-1]).netloc)).exists() else 7)
elif name == "sbatch":
    print("Submitted batch job 99")
elif name == "redis-server":
    server = socket.create_server(("127.0.0.1", int(flag("--port"))))
    while True:
        server.accept()
elif name in ("prorl-rollout", "prorl-sandbox"):
    (record / ("up-" + urlsplit(flag("--advertise-url")).netloc)).touch()
    signal.pause()
elif name == "srun":
    tasks = [subprocess.Popen(["bash", "-c", args[-1]], env={**os.environ, "SLURMD_NODENAME": node})
             for node in os.environ["PRORL_TEST_NODES"].split()]
    sys.exit(max(task.wait() for task in tasks))
"""
STAND_INS = ("scontrol", "getent", "curl", "sbatch", "redis-server", "prorl-rollout", "prorl-sandbox", "srun")
NODES = ("cpu-0", "cpu-1", "cpu-2")


def install_stand_ins(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name in STAND_INS:
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{STAND_IN}")
        path.chmod(0o755)


def run_until_ready(script: Path, env: dict[str, str], cwd: Path) -> tuple[list[str], str]:
    """Run the script until it says it is ready (or exits), then end it as scancel would: SIGTERM to all of it.
    Returns its output lines and its stderr."""
    stderr_path = cwd / "stderr.txt"
    with stderr_path.open("w") as stderr:
        job = subprocess.Popen(
            ["bash", str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
            start_new_session=True,
        )  # fmt: skip
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("prorl: ready:"):
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGTERM)
        job.wait()
        job.stdout.close()
    return lines, stderr_path.read_text()


def recorded(record: Path) -> dict[str, list[dict]]:
    calls: dict[str, list[dict]] = {}
    for path in sorted(record.glob("*.json")):
        entry = json.loads(path.read_text())
        calls.setdefault(entry["name"], []).append(entry)
    return calls


def pick(env: dict[str, str]) -> dict[str, str]:
    """The variables the CLIs read their secrets from."""
    return {key: env[key] for key in (*slurm_recipe.TOKEN_ENV, slurm_recipe.BUFFER_ENV) if key in env}


class StandInRun(NamedTuple):
    recipe: Recipe
    calls: dict[str, list[dict]]  # by program name: what each stand-in was started with
    job_dir: Path
    output: str  # the job's stdout and stderr


@pytest.fixture(scope="module")
def stand_in_run(tmp_path_factory):
    """The generated script run by bash on three stand-in nodes, up to its ready line."""
    from prorl_adapter.dev.localstack import free_port

    tmp_path = tmp_path_factory.mktemp("stand-in-run")
    r = recipe(redis_port=free_port(), train_sbatch="train.sbatch", local_dir="/scratch/local", startup_timeout_s=30)
    record, bin_dir = tmp_path / "record", tmp_path / "bin"
    record.mkdir()
    install_stand_ins(bin_dir)
    script = tmp_path / "rollout.sbatch"
    script.write_text(slurm_recipe.sbatch_script(r))
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "cpu-[0-2]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PRORL_TEST_RECORD": str(record),
        "PRORL_TEST_NODES": " ".join(NODES),
    }
    lines, stderr = run_until_ready(script, env, tmp_path)
    assert lines and lines[-1].startswith("prorl: ready:"), f"the script did not get ready:\n{''.join(lines)}{stderr}"
    return StandInRun(r, recorded(record), tmp_path / "prorl-42", "".join(lines) + stderr)


def test_the_script_runs_with_stand_ins(stand_in_run):
    r, calls, job_dir = stand_in_run.recipe, stand_in_run.calls, stand_in_run.job_dir
    handoff = slurm_recipe.read_handoff(job_dir / slurm_recipe.ENV_FILE)
    token = handoff["PRORL_TOKEN"]
    assert len(token) == 64 and int(token, 16) >= 0  # generated in the job: 32 random bytes

    (redis,) = calls["redis-server"]
    argv = redis["argv"]
    assert argv[0] == "-"  # its password comes on its stdin
    assert (argv[argv.index("--bind") + 1], argv[argv.index("--port") + 1]) == ("127.0.0.1", str(r.redis_port))
    [password] = re.fullmatch(r'requirepass "([0-9a-f]+)"\n', redis["stdin"]).groups()
    assert password != token

    services = sorted(
        (parse(rollout_cli.build_parser, call["argv"], pick(call["env"])) for call in calls["prorl-rollout"]),
        key=lambda args: args.service_id,
    )
    assert [args.service_id for args in services] == ["prorl-rollout-0", "prorl-rollout-1"]
    assert {args.buffer for args in services} == {f"redis://:{password}@127.0.0.1:{r.redis_port}/0"}
    assert all((args.token, args.sandbox_token) == (token, token) for args in services)
    service_urls = [args.advertise_url for args in services]
    assert service_urls == ["http://cpu-0:8766", "http://cpu-0:8767"]
    assert [args.gateway_address for args in services] == ["cpu-0:8866", "cpu-0:8867"]

    runtimes = {
        call["env"]["SLURMD_NODENAME"]: parse(sandbox_cli.build_parser, call["argv"], pick(call["env"]))
        for call in calls["prorl-sandbox"]
    }
    assert sorted(runtimes) == list(NODES)  # one per node
    for node, args in runtimes.items():
        assert args.advertise_url == f"http://{node}:8765"
        assert args.register == service_urls  # every runtime with every replica
        assert (args.token, args.register_token) == (None, token)  # its own token it makes
        assert args.state_dir == Path("/scratch/local/prorl-sandbox-42")

    (srun,) = calls["srun"]
    assert {"--overlap", "--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=16"} <= set(srun["argv"])

    assert handoff["PRORL_SERVICE_URL"] == service_urls[0]
    assert handoff["PRORL_SERVICE_URLS"].split(",") == service_urls
    assert handoff["PRORL_SANDBOX_URLS"].split(",") == [f"http://{node}:8765" for node in NODES]
    assert handoff["PRORL_ROLLOUT_JOB"] == "42"

    (train,) = calls["sbatch"]
    assert train["argv"] == [f"--export=ALL,PRORL_ROLLOUT_ENV={job_dir}/rollout.env", "train.sbatch"]
    assert token not in train["env"].values()


def test_the_token_is_on_no_command_line_in_no_output_and_in_no_readable_file(stand_in_run):
    calls, job_dir = stand_in_run.calls, stand_in_run.job_dir
    token = slurm_recipe.read_handoff(job_dir / slurm_recipe.ENV_FILE)["PRORL_TOKEN"]
    assert not [call["name"] for entries in calls.values() for call in entries if token in " ".join(call["argv"])]
    assert token not in stand_in_run.output
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    for path in job_dir.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is open to others"
    assert stat.S_IMODE((job_dir / slurm_recipe.ENV_FILE).stat().st_mode) == 0o600
