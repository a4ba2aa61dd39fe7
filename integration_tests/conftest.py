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
