"""Write the sbatch script that runs the rollout side of a training run on Slurm CPU nodes.

    python examples/slurm/slurm_recipe.py --nodes 4 --image-dir /shared/sif --tokenizer Qwen/Qwen2.5-7B-Instruct \\
        --llm-url http://gpu-0:8000 --replicas 2 > rollout.sbatch
    sbatch rollout.sbatch

What runs where: every node of the job runs one sandbox runtime (`prorl-sandbox serve`, one `srun` task per
node); the first node also runs Redis and the rollout service replicas (`prorl-rollout serve`), which share
that Redis as their experience buffer. Each runtime registers itself with every replica, so no service is told
of a runtime. Once everything answers `/healthz`, the job writes the service URLs and the token to
`rollout.env` (mode 0600) in its job dir, for the training job to source.

Every command line is built by a function of this module from the recipe's parameters, with the hosts known
only inside the job passed as shell references (`${PRORL_HEAD}`, `${SLURMD_NODENAME}`): the tests call the same
functions with real values and parse the result with the projects' own argument parsers, so the script cannot
drift from the CLIs. The API token travels in the environment (`PRORL_ROLLOUT_TOKEN`, `PRORL_SANDBOX_TOKEN`,
which both CLIs read), never on a command line, where any user of the node could read it in `ps`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Shell references: values the script knows only once the job runs. The builders take them as strings,
# and `shell_word` leaves exactly these unquoted so that bash expands them.
HEAD = "${PRORL_HEAD}"  # the first node's name: Redis and the service replicas run there
HEAD_IP = "${PRORL_HEAD_IP}"  # its address, for Redis's --bind
NODE = "${SLURMD_NODENAME}"  # inside an srun task: the node it runs on
JOB_ID = "${SLURM_JOB_ID}"
JOB_DIR = "${PRORL_JOB_DIR}"  # logs and rollout.env (mode 0700)
REDIS_PASSWORD = "${PRORL_REDIS_PASSWORD}"
TOKEN = "${PRORL_TOKEN}"  # the API token, for rollout.env only
SANDBOX_URLS = "${PRORL_SANDBOX_URLS}"  # every runtime's URL, once each answers
SHELL_REFS = (HEAD, HEAD_IP, NODE, JOB_ID, JOB_DIR, REDIS_PASSWORD, TOKEN, SANDBOX_URLS)

# The environment variables through which the API token reaches the CLIs (their --token, --sandbox-token and
# --register-token defaults, and so the replicas' registration token), so that it never appears on a command line.
TOKEN_ENV = ("PRORL_ROLLOUT_TOKEN", "PRORL_SANDBOX_TOKEN", "PRORL_REGISTRATION_TOKEN")
BUFFER_ENV = "PRORL_BUFFER_URL"  # the Redis URL, password and all, for the service replicas
# What the training job finds in rollout.env.
HANDOFF_KEYS = ("PRORL_SERVICE_URL", "PRORL_SERVICE_URLS", "PRORL_SANDBOX_URLS", "PRORL_TOKEN", "PRORL_ROLLOUT_JOB")
ENV_FILE = "rollout.env"


@dataclass(frozen=True)
class Recipe:
    """The parameters of one rollout job. Ports are per node: the runtime's on every node, the replicas'
    (`service_port + i`, `gateway_port + i`) and Redis's on the first."""

    nodes: int
    tokenizer: str
    llm_urls: tuple[str, ...] = ()
    image_dir: str | None = None
    backend: str = "apptainer"
    replicas: int = 1
    runtime_port: int = 8765
    service_port: int = 8766
    gateway_port: int = 8866
    redis_port: int = 6379
    cpus_per_node: int = 16
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str = "prorl-rollout"
    job_dir: str | None = None  # default: $SLURM_SUBMIT_DIR/prorl-$SLURM_JOB_ID
    local_dir: str = "/tmp"  # node-local: each runtime's state dir is LOCAL_DIR/prorl-sandbox-$SLURM_JOB_ID
    sandbox_command: tuple[str, ...] = ("prorl-sandbox",)
    rollout_command: tuple[str, ...] = ("prorl-rollout",)
    redis_command: tuple[str, ...] = ("redis-server",)
    runtime_args: tuple[str, ...] = ()  # more flags for every runtime, e.g. --max-sandboxes 64
    service_args: tuple[str, ...] = ()  # more flags for every replica, e.g. --plugin-config plugins.json
    train_sbatch: str | None = None  # submitted once everything answers, with PRORL_ROLLOUT_ENV set
    startup_timeout_s: int = 600
    extra_sbatch: tuple[str, ...] = ()  # more #SBATCH options, e.g. --constraint=cpu

    def __post_init__(self) -> None:
        if problems := self.problems():
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """What makes this recipe unusable, in words; checked at construction so that no script is written."""
        found = []
        if self.nodes < 1 or self.replicas < 1 or self.cpus_per_node < 1:
            found.append("--nodes, --replicas and --cpus-per-node must be at least 1")
        if self.backend in ("apptainer", "singularity") and not self.image_dir:
            found.append(f"the {self.backend} backend needs --image-dir (a directory of .sif images on every node)")
        found += _port_clashes(self)
        literals = [self.tokenizer, *self.llm_urls, self.image_dir or "", self.job_dir or "", self.local_dir]
        literals += [*self.runtime_args, *self.service_args, self.train_sbatch or ""]
        if any("${" in value for value in literals):
            found.append("parameters are taken literally: none may contain '${'")
        options = [self.job_name, self.time, self.partition or "", self.account or "", *self.extra_sbatch]
        if any(char.isspace() for option in options for char in option):
            found.append("#SBATCH options (job name, time, partition, account, --sbatch) may not contain spaces")
        return found


def _port_clashes(recipe: Recipe) -> list[str]:
    """The first node runs a runtime, Redis and each replica's API and gateway: no two may share a port."""
    ports = {"runtime": [recipe.runtime_port], "Redis": [recipe.redis_port]}
    ports["service"] = [recipe.service_port + i for i in range(recipe.replicas)]
    ports["gateway"] = [recipe.gateway_port + i for i in range(recipe.replicas)]
    seen: dict[int, str] = {}
    clashes = []
    for name, numbers in ports.items():
        for port in numbers:
            if not 0 < port < 65536:
                clashes.append(f"the {name} port {port} is not a TCP port")
            elif port in seen:
                clashes.append(f"the {name} port {port} is also the {seen[port]} port")
            seen.setdefault(port, name)
    return clashes


# -- the commands: pure functions of the recipe and the hosts ------------------------------------------------
def redis_url(host: str, port: int, password: str) -> str:
    return f"redis://:{password}@{host}:{port}/0"


def redis_args(recipe: Recipe, bind: str) -> list[str]:
    """An in-memory Redis for the replicas' shared state: nothing saved, as it lives as long as the job. `-`:
    the rest of its configuration, the password, comes on its standard input (`redis_config`), off every
    command line."""
    return [
        "-",
        *("--port", str(recipe.redis_port), "--bind", bind, "--protected-mode", "no"),
        *("--save", "", "--appendonly", "no"),
    ]


def redis_config(password: str) -> str:
    """The shell that feeds Redis its password (printf is bash's own: no process shows it)."""
    return f"printf 'requirepass \"%s\"\\n' {password}"


def service_url(recipe: Recipe, host: str, replica: int) -> str:
    return f"http://{host}:{recipe.service_port + replica}"


def service_urls(recipe: Recipe, host: str) -> list[str]:
    return [service_url(recipe, host, i) for i in range(recipe.replicas)]


def service_args(recipe: Recipe, replica: int, host: str) -> list[str]:
    """Replica `replica` of the rollout service, reached at `host`; its tokens and the Redis URL (with the
    password) come from the environment."""
    port = recipe.service_port + replica
    gateway = recipe.gateway_port + replica
    args = ["serve", "--host", "0.0.0.0", "--port", str(port)]
    args += ["--service-id", f"prorl-rollout-{replica}", "--advertise-url", service_url(recipe, host, replica)]
    args += ["--gateway-host", "0.0.0.0", "--gateway-port", str(gateway), "--gateway-address", f"{host}:{gateway}"]
    args += ["--tokenizer", recipe.tokenizer]
    args += [arg for url in recipe.llm_urls for arg in ("--llm-url", url)]
    return [*args, *recipe.service_args]


def runtime_url(recipe: Recipe, node: str) -> str:
    return f"http://{node}:{recipe.runtime_port}"


def runtime_args(recipe: Recipe, node: str, head: str, job_id: str) -> list[str]:
    """The sandbox runtime of `node`, registering with every replica on `head`; its token and the services'
    come from the environment."""
    args = ["serve", "--host", "0.0.0.0", "--port", str(recipe.runtime_port), "--backend", recipe.backend]
    args += ["--image-dir", recipe.image_dir] if recipe.image_dir else []
    args += ["--advertise-url", runtime_url(recipe, node)]
    args += [arg for url in service_urls(recipe, head) for arg in ("--register", url)]
    args += ["--state-dir", f"{recipe.local_dir}/prorl-sandbox-{job_id}"]
    return [*args, *recipe.runtime_args]


def runtime_srun_args(recipe: Recipe) -> list[str]:
    """One task per node, holding the node's CPUs for its sandboxes; `--overlap` lets it share the first node
    with the batch step (Redis, the service), and a runtime that dies ends the step, hence the job."""
    return [
        *("--overlap", f"--nodes={recipe.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={recipe.cpus_per_node}"),
        *("--kill-on-bad-exit=1", f"--output={JOB_DIR}/runtime-%N.log"),
    ]


def read_handoff(path: str | Path) -> dict[str, str]:
    """rollout.env as a training job's shell reads it (bash sources it: the values are written with %q)."""
    words = " ".join(f'"${key}"' for key in HANDOFF_KEYS)
    done = subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(path))} && printf '%s\\0' {words}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(zip(HANDOFF_KEYS, done.stdout.split("\0")[:-1], strict=True))


# -- rendering ----------------------------------------------------------------------------------------------
_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_REFS = re.compile("(" + "|".join(re.escape(ref) for ref in SHELL_REFS) + ")")


def shell_word(word: str) -> str:
    """`word` as one bash word: the shell references in it expanded by bash, everything else literal."""
    if _PLAIN.fullmatch(word):
        return word
    parts = _REFS.split(word)
    quoted = (part if part in SHELL_REFS else re.sub(r'([\\"$`])', r"\\\1", part) for part in parts)
    return '"' + "".join(quoted) + '"'


def shell_line(argv: Sequence[str]) -> str:
    return " ".join(shell_word(word) for word in argv)


def _sbatch_header(recipe: Recipe) -> list[str]:
    options = [f"--job-name={recipe.job_name}", f"--nodes={recipe.nodes}", "--ntasks-per-node=1"]
    options += [f"--cpus-per-task={recipe.cpus_per_node}", "--exclusive", "--mem=0", f"--time={recipe.time}"]
    options += [f"--partition={recipe.partition}"] if recipe.partition else []
    options += [f"--account={recipe.account}"] if recipe.account else []
    return [f"#SBATCH {option}" for option in [*options, *recipe.extra_sbatch]]


_HELPERS = r"""
die() { echo "prorl: $*" >&2; exit 1; }
random_secret() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
# Poll until URL answers 200; fail as soon as process PID (NAME, logging to LOG) is gone or the deadline passes.
wait_healthy() {
    local url=$1 pid=$2 name=$3 log=$4
    until curl -sf -o /dev/null --max-time 5 "$url"; do
        kill -0 "$pid" 2>/dev/null || die "$name exited before $url answered; see $log"
        ((SECONDS < PRORL_DEADLINE)) || die "$url did not answer within ${PRORL_STARTUP_TIMEOUT}s; see $log"
        sleep 0.5
    done
}
# The same for a TCP port (Redis speaks no HTTP).
wait_port() {
    local host=$1 port=$2 pid=$3 name=$4 log=$5
    until (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; do
        kill -0 "$pid" 2>/dev/null || die "$name exited before $host:$port opened; see $log"
        ((SECONDS < PRORL_DEADLINE)) || die "$host:$port did not open within ${PRORL_STARTUP_TIMEOUT}s; see $log"
        sleep 0.5
    done
}
command -v curl >/dev/null || die "curl is needed on the first node to wait for the servers"
"""

_PLACES = r"""
# -- where: the first node runs Redis and the service replicas; every node runs a sandbox runtime
mapfile -t PRORL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
PRORL_HEAD=${PRORL_NODES[0]}
PRORL_HEAD_IP=$(getent ahostsv4 "$PRORL_HEAD" | awk 'NR == 1 {print $1}')
[[ -n $PRORL_HEAD_IP ]] || die "cannot resolve the first node, $PRORL_HEAD"
export PRORL_HEAD PRORL_HEAD_IP
"""

_SECRETS = r"""
# -- secrets: in the environment (srun hands it to the tasks) and in 0600 files, never on a command line (any
# user of a node can read those) nor in the job's output. A PRORL_TOKEN from the submitting shell is kept, so
# that a training job may know it beforehand.
umask 077
mkdir -p "$PRORL_JOB_DIR" && chmod 700 "$PRORL_JOB_DIR"
PRORL_TOKEN=${PRORL_TOKEN:-$(random_secret)}
PRORL_REDIS_PASSWORD=$(random_secret)
export PRORL_ROLLOUT_TOKEN=$PRORL_TOKEN PRORL_SANDBOX_TOKEN=$PRORL_TOKEN PRORL_REGISTRATION_TOKEN=$PRORL_TOKEN
"""


def _setup_block(recipe: Recipe) -> list[str]:
    job_dir = shell_word(recipe.job_dir) if recipe.job_dir else '"$SLURM_SUBMIT_DIR/prorl-$SLURM_JOB_ID"'
    return [
        f"PRORL_JOB_DIR={job_dir}",
        f"PRORL_STARTUP_TIMEOUT={recipe.startup_timeout_s}",
        "PRORL_DEADLINE=$((SECONDS + PRORL_STARTUP_TIMEOUT))",
    ]


def _redis_block(recipe: Recipe) -> list[str]:
    log = shell_word(f"{JOB_DIR}/redis.log")
    argv = [*recipe.redis_command, *redis_args(recipe, HEAD_IP)]
    return [
        "# -- Redis: the replicas' shared state (buffer, prompts, jobs, runtimes); its password on its stdin",
        f"{redis_config(shell_word(REDIS_PASSWORD))} | {shell_line(argv)} >{log} 2>&1 &",
        f'wait_port "$PRORL_HEAD_IP" {recipe.redis_port} $! Redis {log}',
    ]


def _service_block(recipe: Recipe) -> list[str]:
    lines = [
        "# -- the rollout service replicas, all on the same Redis (its URL, with the password, in the environment)"
    ]
    lines.append(f"export PRORL_BUFFER_URL={shell_word(redis_url(HEAD_IP, recipe.redis_port, REDIS_PASSWORD))}")
    for i in range(recipe.replicas):
        log = shell_word(f"{JOB_DIR}/service-{i}.log")
        argv = [*recipe.rollout_command, *service_args(recipe, i, HEAD)]
        lines.append(f"{shell_line(argv)} >{log} 2>&1 &")
        health = shell_word(service_url(recipe, HEAD, i) + "/healthz")
        lines.append(f"wait_healthy {health} $! 'rollout service {i}' {log}")
    return lines


def _runtime_block(recipe: Recipe) -> list[str]:
    """One srun step for all runtimes; each task's command is expanded on its own node ($SLURMD_NODENAME)."""
    # A runtime keeps only the registration token: its own API token is one it makes (sent to the replicas in
    # its heartbeats), so no runtime holds another's, nor the service's API token.
    task = "unset PRORL_ROLLOUT_TOKEN PRORL_SANDBOX_TOKEN; exec " + shell_line(
        [*recipe.sandbox_command, *runtime_args(recipe, NODE, HEAD, JOB_ID)]
    )
    return [
        "# -- a sandbox runtime on every node; each registers itself with every replica",
        f"srun {shell_line(runtime_srun_args(recipe))} bash -c {shlex.quote(task)} &",
        "PRORL_RUNTIMES=$!",
        "PRORL_SANDBOX_URLS=",
        'for node in "${PRORL_NODES[@]}"; do',
        f"    url=http://$node:{recipe.runtime_port}",
        '    wait_healthy "$url/healthz" $PRORL_RUNTIMES "the runtime step" "$PRORL_JOB_DIR/runtime-$node.log"',
        "    PRORL_SANDBOX_URLS+=${PRORL_SANDBOX_URLS:+,}$url",
        "done",
    ]


def handoff(recipe: Recipe) -> dict[str, str]:
    """What rollout.env holds, as shell words (with references): the first replica's URL (what verl's
    +prorl.service_url takes), every replica's and runtime's, the token, and the job holding them."""
    values = {
        "PRORL_SERVICE_URL": service_url(recipe, HEAD, 0),
        "PRORL_SERVICE_URLS": ",".join(service_urls(recipe, HEAD)),
        "PRORL_SANDBOX_URLS": SANDBOX_URLS,
        "PRORL_TOKEN": TOKEN,
        "PRORL_ROLLOUT_JOB": JOB_ID,
    }
    return {key: values[key] for key in HANDOFF_KEYS}


def _handoff_block(recipe: Recipe) -> list[str]:
    # printf is a builtin: the token passes through no process's command line.
    lines = ["# -- the hand-off: URLs and token for the training job, readable by this user only", "{"]
    lines += [f"    printf '%s=%q\\n' {key} {shell_word(value)}" for key, value in handoff(recipe).items()]
    lines.append(f'}} >"$PRORL_JOB_DIR/{ENV_FILE}"')
    return lines


def _ready_line(recipe: Recipe) -> str:
    services = shell_word(",".join(service_urls(recipe, HEAD)))
    return f'echo "prorl: ready:" {services} "(URLs and token for the training job: $PRORL_JOB_DIR/{ENV_FILE})"'


def _train_block(recipe: Recipe) -> list[str]:
    """Submit the training job with the path of rollout.env in its environment, and none of the secrets."""
    if not recipe.train_sbatch:
        return []
    unset = " ".join(f"-u {name}" for name in (*TOKEN_ENV, "PRORL_TOKEN"))
    export = f'--export=ALL,PRORL_ROLLOUT_ENV="$PRORL_JOB_DIR/{ENV_FILE}"'
    return ["# -- the training job", f"env {unset} sbatch {export} {shell_word(recipe.train_sbatch)}"]


_WAIT = """
# -- until the time limit or scancel; the first server to exit ends the job, and Slurm ends the rest
wait -n || true
die "a server exited; logs in $PRORL_JOB_DIR"
"""


def sbatch_script(recipe: Recipe) -> str:
    """The whole sbatch script for `recipe`."""
    last = recipe.service_port + recipe.replicas - 1
    header = [
        "#!/bin/bash",
        "# The rollout side of a training run, written by examples/slurm/slurm_recipe.py (see README.md there).",
        f"# Every node: a sandbox runtime ({recipe.backend}), port {recipe.runtime_port}. The first node also: Redis,",
        f"# port {recipe.redis_port}, and {recipe.replicas} rollout service replica(s), ports "
        f"{recipe.service_port}-{last}.",
        *_sbatch_header(recipe),
        "set -euo pipefail",
    ]
    blocks = [
        header,
        [_HELPERS.strip()],
        [_PLACES.strip()],
        [*_setup_block(recipe), _SECRETS.strip()],
        _redis_block(recipe),
        _service_block(recipe),
        _runtime_block(recipe),
        _handoff_block(recipe),
        _train_block(recipe),
        [_ready_line(recipe)],
        [_WAIT.strip()],
    ]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"


# -- the command line -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--nodes", type=int, required=True, help="CPU nodes; each runs a sandbox runtime, the first also the service")
    add("--tokenizer", required=True, help="the policy's tokenizer, as the service loads it (path or hub name)")
    add("--llm-url", action="append", default=[], help="an LLM server (repeatable); none: the trainer adds them")
    add("--image-dir", default=None, help="directory of .sif images, on every node (needed by apptainer)")
    add("--backend", default="apptainer", choices=["apptainer", "singularity", "bwrap", "local"])
    add("--replicas", type=int, default=1, help="rollout service replicas on the first node (default 1)")
    for name, default in (("runtime", 8765), ("service", 8766), ("gateway", 8866), ("redis", 6379)):
        add(f"--{name}-port", type=int, default=default, help=f"default {default}")
    add("--cpus-per-node", type=int, default=16, help="CPUs of each node, all given to its runtime (default 16)")
    add("--time", default="24:00:00")
    add("--partition", default=None)
    add("--account", default=None)
    add("--job-name", default="prorl-rollout")
    add("--job-dir", default=None, help="logs and rollout.env (default: $SLURM_SUBMIT_DIR/prorl-$SLURM_JOB_ID)")
    add("--local-dir", default="/tmp", help="node-local directory for the runtimes' state (default /tmp)")
    for name in ("sandbox", "rollout", "redis"):
        default = {"sandbox": "prorl-sandbox", "rollout": "prorl-rollout", "redis": "redis-server"}[name]
        add(f"--{name}-command", default=default, help=f"how to run it on the nodes (default {default})")
    add(
        "--runtime-arg",
        action="append",
        default=[],
        help="a flag for every runtime, as --runtime-arg=--max-sandboxes=64",
    )
    add(
        "--service-arg",
        action="append",
        default=[],
        help="a flag for every replica, as --service-arg=--plugin-config=p.json",
    )
    add("--train-sbatch", default=None, help="an sbatch script to submit once all answer, with PRORL_ROLLOUT_ENV set")
    add("--startup-timeout", type=int, default=600, help="seconds for everything to answer (default 600)")
    add("--sbatch", action="append", default=[], help="another #SBATCH option, as --sbatch=--constraint=cpu")
    return parser


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    return Recipe(
        nodes=args.nodes,
        tokenizer=args.tokenizer,
        llm_urls=tuple(args.llm_url),
        image_dir=args.image_dir,
        backend=args.backend,
        replicas=args.replicas,
        runtime_port=args.runtime_port,
        service_port=args.service_port,
        gateway_port=args.gateway_port,
        redis_port=args.redis_port,
        cpus_per_node=args.cpus_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        job_dir=args.job_dir,
        local_dir=args.local_dir,
        sandbox_command=tuple(shlex.split(args.sandbox_command)),
        rollout_command=tuple(shlex.split(args.rollout_command)),
        redis_command=tuple(shlex.split(args.redis_command)),
        runtime_args=tuple(args.runtime_arg),
        service_args=tuple(args.service_arg),
        train_sbatch=args.train_sbatch,
        startup_timeout_s=args.startup_timeout,
        extra_sbatch=tuple(args.sbatch),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        recipe = recipe_from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(sbatch_script(recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
