"""For testing without servers: a task plugin's own logic (`ScriptedSandbox`), and what uses the service's job
runner (`SimulatedRunner`: the decoupled producer in tests and benchmarks).

`ScriptedSandbox` is an in-process `SandboxHandle`. It is NOT a sandbox, and nothing runs: files live in a dict,
and every command and one-shot run is answered by the test's own `answer` function (by default: no output, exit
0). That is what a unit test of a task's init, tools and eval wants: the set-up it wrote, the checks it ran, and
its reward for the answers the test gives. A test of what the commands really do belongs against the real
runtime (integration_tests/).

    sandbox = ScriptedSandbox(answer=lambda call, box: ("ok\\n", 0) if call.argv == ["make", "test"] else None)
    await task.init(sandbox.for_task(), instance)
    assert sandbox.files["/workspace/notes.txt"] == b"..."
    assert await task.evaluate(sandbox.for_task(), instance, EpisodeState()) == {"outcome": 1.0}

`SimulatedRunner` is a `JobRunner` (`service/job_runner.py`) whose episodes are simulated, in place of
`RolloutPipeline` (which needs LLM servers and sandboxes). Jobs are held in memory; a subclass decides when each
ends (`_started`, then `end`). The policy version is its coordination's, set as PUT /v1/policy-version sets it
(`new_version`), and plugins hear of a change as they do from the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import posixpath
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from sandbox_runtime.client import SandboxAPIError
from sandbox_runtime.models import ExecResult, RunResult

from .hooks import PluginSet
from .models import JobError, JobRequest, JobState, JobStatus, StageTimings, Trajectory
from .service.storage.coordination import Coordination, MemoryCoordination


@dataclass(frozen=True)
class Call:
    """One command the task gave: `exec` (a shell session's command) or `run` (a one-shot run)."""

    kind: Literal["exec", "run"]
    session: str
    command: str | None = None  # exec's command, or run's script
    argv: list[str] | None = None  # run's argv
    cwd: str | None = None
    env: dict[str, str] | None = None


# What the test answers for a call: (output, exit code), just the output (exit 0), or None (no output, exit 0).
Answer = Callable[[Call, "ScriptedSandbox"], "tuple[str, int] | str | None"]


@dataclass
class _Box:
    """What every view of one sandbox (`for_task`) shares."""

    files: dict[str, bytes] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    ended: int = 0  # how many times end_processes was called


@dataclass(frozen=True)
class ScriptedSandbox:
    answer: Answer = lambda call, box: None
    workdir: str = "/workspace"
    session: str = "default"
    _box: _Box = field(default_factory=_Box)

    @property
    def files(self) -> dict[str, bytes]:
        """Every file by absolute path (relative paths are taken from the workdir)."""
        return self._box.files

    @property
    def calls(self) -> list[Call]:
        """Every command and run, in order, from every session."""
        return self._box.calls

    @property
    def processes_ended(self) -> int:
        return self._box.ended

    def for_task(self) -> ScriptedSandbox:
        return replace(self, session="task")

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def _answer(self, call: Call) -> tuple[str, int]:
        self._box.calls.append(call)
        answered = self.answer(call, self)
        if answered is None:
            return "", 0
        if isinstance(answered, str):
            return answered, 0
        return answered

    async def exec(self, command: str, timeout: float = 30.0, max_output_bytes: int | None = None) -> ExecResult:
        output, code = self._answer(Call("exec", self.session, command=command))
        return ExecResult(
            output=output, exit_code=code, status="completed", truncated=False, duration_s=0.0, cwd=self.workdir
        )

    async def run(
        self,
        *,
        argv: list[str] | None = None,
        script: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        max_output_bytes: int | None = None,
    ) -> RunResult:
        if (argv is None) == (script is None):
            raise SandboxAPIError(400, "give argv or script")
        output, code = self._answer(Call("run", self.session, command=script, argv=argv, cwd=cwd, env=env))
        return RunResult(output=output, exit_code=code, status="completed", truncated=False, duration_s=0.0)

    async def end_processes(self) -> list[str]:
        self._box.ended += 1
        return []

    async def wipe(self) -> None:
        """As the runtime wipes: the workspace and /tmp emptied."""
        for path in list(self._box.files):
            if _under(path, self.workdir) or _under(path, "/tmp"):
                del self._box.files[path]

    async def write_file(self, path: str, data: str | bytes) -> None:
        self._box.files[self._path(path)] = data.encode() if isinstance(data, str) else bytes(data)

    async def read_file(self, path: str) -> bytes:
        """A file's bytes; as the runtime answers: 404 for nothing there, 409 for a directory (files below it)."""
        full = self._path(path)
        if full in self._box.files:
            return self._box.files[full]
        if any(_under(name, full) for name in self._box.files):
            raise SandboxAPIError(409, f"{full!r} is a directory")
        raise SandboxAPIError(404, f"no such file: {path}")

    async def download_archive(self, path: str) -> bytes:
        """A tar.gz of the files under `path`, named relative to it, as the runtime packs them."""
        root = self._path(path)
        found = {p: data for p, data in self._box.files.items() if _under(p, root)}
        if not found:
            raise SandboxAPIError(404, f"no such file or directory: {path}")
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w:gz") as tar:
            for name, data in sorted(found.items()):
                info = tarfile.TarInfo(posixpath.relpath(name, root) if name != root else posixpath.basename(name))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return packed.getvalue()

    async def upload_archive(self, path: str, archive: bytes) -> int:
        """Unpack a tar.gz under `path`; returns how many files it held."""
        root, count = self._path(path), 0
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    data = tar.extractfile(member).read()
                    self._box.files[posixpath.normpath(posixpath.join(root, member.name))] = data
                    count += 1
        return count


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# -- a simulated job runner ---------------------------------------------------------------------------------
@dataclass
class SimJob:
    """A simulated job: running until `finish` gives it its trajectory."""

    id: str
    request: JobRequest
    result: Trajectory | None = None
    state: JobState = JobState.running
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> JobStatus:
        return JobStatus(job_id=self.id, task=self.request.task, state=self.state, submitted_at=0.0, timings={})


class SimulatedRunner:
    def __init__(self, plugins: PluginSet, workers: int = 1_000_000, coordination: Coordination | None = None) -> None:
        self.plugins = plugins
        self.workers = workers  # what `capacity` answers: only a replica sharing a queue asks
        self.coordination = coordination or MemoryCoordination("sim")
        self.coordination.on_policy_version(
            lambda version: plugins.notify("prorl_policy_version_changed", version=version)
        )
        self.jobs: dict[str, SimJob] = {}

    @property
    def policy_version(self) -> int:
        return self.coordination.version

    async def new_version(self, version: int) -> None:
        await self.coordination.set_policy_version(version, raise_only=False)

    def check(self, request: JobRequest) -> None:
        return None

    def submit(self, request: JobRequest) -> tuple[SimJob, bool]:
        if request.job_id in self.jobs:
            return self.jobs[request.job_id], False
        job = self.jobs[request.job_id] = SimJob(request.job_id, request)
        self._started(job)
        return job, True

    def _started(self, job: SimJob) -> None:
        """A job was submitted: a subclass runs it (by default it runs for ever)."""

    def submit_samples(self, request: JobRequest) -> list[tuple[SimJob, bool]]:
        return [self.submit(sample) for sample in request.samples()]

    def not_run(self, request: JobRequest, submitted_at: float, state: JobState, error: JobError) -> SimJob:
        job = SimJob(request.job_id, request)
        self.end(job, sim_trajectory(job, self.policy_version, self.policy_version, error), state, notify=False)
        return job

    def end(self, job: SimJob, trajectory: Trajectory, state: JobState = JobState.done, notify: bool = True) -> None:
        """The job ends with `trajectory`; plugins hear of it (`prorl_job_finished`), as from the pipeline."""
        job.state, job.result = state, trajectory
        job.finished.set()
        if notify:
            self.plugins.notify("prorl_job_finished", trajectory=trajectory, state=state)

    def job(self, job_id: str) -> SimJob | None:
        return self.jobs.get(job_id)

    async def cancel(self, job_id: str) -> SimJob:
        job = self.jobs[job_id]
        if not job.state.finished:
            error = JobError(error_class="cancelled", message="cancelled by request")
            self.end(job, sim_trajectory(job, self.policy_version, self.policy_version, error), JobState.cancelled)
        return job

    def forget(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None and job.state.finished:
            del self.jobs[job_id]

    async def wait(self, job_id: str, timeout: float) -> SimJob:
        job = self.jobs[job_id]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await job.finished.wait()
        return job

    def capacity(self) -> int:
        return self.workers

    def can_generate(self) -> bool:
        return True

    def status(self) -> dict:
        running = sum(not job.state.finished for job in self.jobs.values())
        return {"active": {JobState.running.value: running}, "episodes_per_s_last_60s": 0.0}


def sim_trajectory(job: SimJob, first_version: int, last_version: int, error: JobError | None = None) -> Trajectory:
    return Trajectory(
        job_id=job.id,
        task=job.request.task,
        prompt_ids=[],
        response_ids=[],
        response_mask=[],
        response_logprobs=[],
        turns=[],
        num_turns=0,
        finish_reason="finish" if error is None else "error",
        policy_version_min=first_version,
        policy_version_max=last_version,
        timings=StageTimings(),
        labels=job.request.labels,
        group=job.request.group,
        attempt=job.request.attempt,
        retry_of=job.request.retry_of,
        error=error,
        filter=error is not None,
    )
