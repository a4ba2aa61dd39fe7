"""The Slurm recipe (examples/slurm) submitted to a real single-node Slurm cluster of the test's own.

The cluster is Debian's slurmctld and slurmd with munge, all three run in the foreground as children of the test,
every file of theirs (key, sockets, state, spool, logs) under one temporary directory, stopped by pid. It needs
root (SlurmUser=root) and the packages (`apt-get install slurmctld slurmd slurm-client munge`); without them the
test skips, and the generated script is still run against stand-ins by tests/test_slurm_recipe.py. The recipe's
backend is a parameter: Apptainer is not installable here, so the runtime runs `--backend local`.

What it shows: sbatch accepts the script, the batch step starts Redis and the rollout service, `srun` starts the
runtime, both answer /healthz and accept the token from rollout.env, and `scancel` leaves no process of the job.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from prorl_adapter.dev.localstack import TINY_MODEL, free_port
from tests.test_slurm_recipe import slurm_recipe

from .redis_server import REDIS_SERVER, REDIS_SKIP

REPO = Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo")


def _why_not() -> str | None:
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (
            f"Slurm is not installed here ({', '.join(missing)} missing: apt-get install slurmctld slurmd "
            "slurm-client munge); the generated script is run against stand-ins in tests/test_slurm_recipe.py"
        )
    if os.geteuid() != 0:
        return "the test's own single-node Slurm runs as root (SlurmUser=root)"
    return REDIS_SKIP


SLURM_SKIP = _why_not()
pytestmark = pytest.mark.skipif(bool(SLURM_SKIP), reason=SLURM_SKIP or "")


SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={node}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
NodeName={node} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def poll(what: str, check, timeout: float, details=lambda: ""):
    """Wait for a starting or stopping daemon or job: `check()` until it returns something true."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:g} s\n{details()}")
        time.sleep(0.2)  # polling processes we do not control, not synchronising code under test
    return result


@dataclass
class Cluster:
    """munged, slurmctld and slurmd of our own, in the foreground, with everything in `dir`."""

    dir: Path
    node: str
    cpus: int
    name: str = field(default_factory=lambda: f"prorl{uuid.uuid4().hex[:8]}")
    daemons: list[subprocess.Popen] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    def run(self, *argv: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, **kwargs)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.dir.glob("*.log"))

    def start(self) -> Cluster:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        conf = SLURM_CONF.format(
            cluster=self.name, node=self.node, dir=self.dir, cpus=self.cpus, memory=1024,
            ctld_port=free_port(), slurmd_port=free_port(),
        )  # fmt: skip
        (self.dir / "slurm.conf").write_text(conf)
        munge = [f"--key-file={key}", f"--socket={self.dir}/munge.socket", f"--pid-file={self.dir}/munged.pid"]
        munge += [f"--log-file={self.dir}/munged.log", f"--seed-file={self.dir}/munge.seed", "--foreground"]
        self._spawn(["munged", *munge])
        self.wait_for("munged did not open its socket", (self.dir / "munge.socket").exists, 20)
        self._spawn(["slurmctld", "-D", "-f", str(self.dir / "slurm.conf")])
        self._spawn(["slurmd", "-D", "-N", self.node, "-f", str(self.dir / "slurm.conf")])
        idle = lambda: "idle" in self.run("sinfo", "-h", "-o", "%T").stdout  # noqa: E731
        self.wait_for("the node did not come up idle", idle, 60)
        return self

    def submit(self, script: Path, *options: str) -> str:
        done = self.run("sbatch", "--parsable", *options, str(script), cwd=script.parent)
        assert done.returncode == 0, done.stderr
        self.jobs.append(done.stdout.strip().split(";")[0])
        return self.jobs[-1]

    def wait_for(self, what: str, check, timeout: float) -> None:
        def alive_and_done():
            if exited := [p.args[0] for p in self.daemons if p.poll() is not None]:
                pytest.fail(f"{', '.join(exited)} exited\n{self.logs()}")
            return check()

        poll(what, alive_and_done, timeout, self.logs)

    def _spawn(self, argv: list[str]) -> None:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # each writes a log file of its own
        self.daemons.append(subprocess.Popen(argv, env=self.env, start_new_session=True, **quiet))

    def stop(self) -> None:
        """Cancel every job, kill by pid what outlives that (a failed test's job), then stop the daemons."""
        for job in self.jobs:
            self.run("scancel", job)
        deadline = time.monotonic() + 30
        while (left := [pid for job in self.jobs for pid in processes_of(self, job)]) and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for slurmstepd to end the job's processes
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for daemon in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(daemon.pid, signal.SIGKILL)
                daemon.wait()


def node_cpus() -> tuple[str, int]:
    """The node's name and CPUs as slurmd sees them (`slurmd -C`)."""
    found = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return re.search(r"NodeName=(\S+)", found)[1], int(re.search(r"CPUs=(\d+)", found)[1])


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    # A short path (munge's socket name has a length limit) that a root runtime's sandbox uids can traverse.
    root = Path(tempfile.mkdtemp(prefix="prorl-slurm-"))
    root.chmod(0o711)
    node, cpus = node_cpus()
    started = time.monotonic()
    cluster = Cluster(root / "slurm", node, cpus)
    cluster.dir.mkdir()
    cluster.dir.chmod(0o755)  # munged wants its socket's directory open to all (the key itself is 0600)
    try:
        cluster.start()
        print(f"single-node Slurm {node} ({cpus} CPUs) up in {time.monotonic() - started:.1f} s")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def job_state(cluster: Cluster, job: str) -> str:
    return cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip()


def processes_of(cluster: Cluster, job: str) -> list[int]:
    """Processes whose environment says they belong to `job` of this cluster: by the job's own marks, not names."""
    marks = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_CLUSTER_NAME={cluster.name}".encode()}
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and marks <= set((proc / "environ").read_bytes().split(b"\0")):
                found.append(int(proc.name))
    return found


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# The training job the recipe submits once all answer: it records what reached it. It waits for the node, which
# the rollout job holds (--exclusive), so it runs once that job is cancelled.
TRAIN_SBATCH = """\
#!/bin/bash
#SBATCH --nodes=1 --job-name=prorl-train
{{ echo "rollout_env=$PRORL_ROLLOUT_ENV"; env; }} >{out}
"""


def rollout_recipe(cluster: Cluster, train_sbatch: Path):
    """The recipe on this one node, with the `local` backend (Apptainer is not installable here)."""
    return slurm_recipe.Recipe(
        nodes=1,
        tokenizer=str(TINY_MODEL),
        backend="local",
        runtime_port=free_port(),
        service_port=free_port(),
        gateway_port=free_port(),
        redis_port=free_port(),
        cpus_per_node=cluster.cpus,
        time="10:00",
        job_dir=str(cluster.dir.parent / "job"),
        local_dir=str(cluster.dir.parent / "local"),
        sandbox_command=(sys.executable, "-m", "sandbox_runtime"),
        rollout_command=(sys.executable, "-m", "prorl_adapter"),
        redis_command=(REDIS_SERVER,),
        train_sbatch=str(train_sbatch),
        startup_timeout_s=120,
    )


def test_the_recipe_runs_on_a_real_single_node_slurm(cluster):
    work = cluster.dir.parent
    (work / "local").mkdir(mode=0o711)
    train = work / "train.sbatch"
    train.write_text(TRAIN_SBATCH.format(out=work / "train-env.txt"))
    recipe = rollout_recipe(cluster, train)
    job_dir = Path(recipe.job_dir)
    script = work / "rollout.sbatch"
    script.write_text(slurm_recipe.sbatch_script(recipe))
    started = time.monotonic()
    job = cluster.submit(script, f"--output={work}/slurm-%j.out")
    output = work / f"slurm-{job}.out"

    def details() -> str:
        logs = [p for p in [output, *sorted(job_dir.glob("*.log"))] if p.exists()]
        text = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
        return f"job {job}: {job_state(cluster, job) or 'gone'}\n{text}\n{cluster.logs()}"

    def ready() -> bool:
        if not job_state(cluster, job):
            pytest.fail(f"the job ended before it was ready\n{details()}")
        return output.exists() and "prorl: ready:" in output.read_text()

    poll("the job did not get ready", ready, 180, details)
    print(f"job {job} ready {time.monotonic() - started:.1f} s after sbatch")
    handoff = slurm_recipe.read_handoff(job_dir / slurm_recipe.ENV_FILE)
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((job_dir / slurm_recipe.ENV_FILE).stat().st_mode) == 0o600
    headers = {"Authorization": f"Bearer {handoff['PRORL_TOKEN']}"}
    for url in (handoff["PRORL_SERVICE_URL"], handoff["PRORL_SANDBOX_URLS"]):
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200, details()
    # The runtime holds a token of its own (sent in its registration), not the job's: the job's does not open it.
    runtime_info = httpx.get(f"{handoff['PRORL_SANDBOX_URLS']}/v1/info", headers=headers, timeout=10)
    assert runtime_info.status_code == 401, runtime_info.text
    service_status = httpx.get(f"{handoff['PRORL_SERVICE_URL']}/v1/status", headers=headers, timeout=10)
    assert service_status.status_code == 200, service_status.text
    # The registration token reached the runtime through srun's environment: it registered with the replica.
    runtimes = httpx.get(f"{handoff['PRORL_SERVICE_URL']}/v1/runtimes", headers=headers, timeout=10).json()
    assert [r["url"] for r in runtimes["runtimes"] if r["alive"]] == [handoff["PRORL_SANDBOX_URLS"]], runtimes
    assert processes_of(cluster, job)
    (training,) = re.findall(r"Submitted batch job (\d+)", output.read_text())
    cluster.jobs.append(training)
    assert job_state(cluster, training) == "PENDING"  # for the node, which the rollout job holds

    cancelled = time.monotonic()
    assert cluster.run("scancel", job).returncode == 0
    poll("the job is still queued after scancel", lambda: not job_state(cluster, job), 60, details)
    poll("processes of the job outlived scancel", lambda: not processes_of(cluster, job), 60, details)
    ports = (recipe.runtime_port, recipe.service_port, recipe.gateway_port, recipe.redis_port)
    assert all(port_closed(port) for port in ports), details()
    print(f"job {job} gone {time.monotonic() - cancelled:.1f} s after scancel")

    poll("the training job did not run once the node was free", lambda: not job_state(cluster, training), 60, details)
    seen = (work / "train-env.txt").read_text()
    assert f"rollout_env={job_dir / slurm_recipe.ENV_FILE}" in seen.splitlines()
    assert handoff["PRORL_TOKEN"] not in seen  # told where the token is, not what it is
