"""A sandbox runtime server on the apptainer backend with tests/standins/apptainer in place of Apptainer, run as
an unprivileged user (nobody, when the tests run as root), as Apptainer runs on a cluster."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import Service

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "apptainer"
NOBODY = 65534


def as_user() -> list[str]:
    """argv prefix that runs the rest as nobody when we are root (nothing otherwise)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def python_for_user() -> tuple[str, dict[str, str]] | None:
    """A Python that the unprivileged user can run with this checkout importable, and the environment it
    needs: this interpreter where that user can run it, else the system's Python of the same version with this
    environment's site-packages on PYTHONPATH (a root-only pyenv is common); None if neither works."""
    candidates = [(sys.executable, {})]
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if system.exists():
        paths = [*site.getsitepackages(), str(REPO)]
        candidates.append((str(system), {"PYTHONPATH": os.pathsep.join(paths)}))
    for python, env in candidates:
        probe = [*as_user(), "env", "-i", *(f"{k}={v}" for k, v in env.items()), python, "-c", "import sandbox_runtime"]
        if subprocess.run(probe, capture_output=True, cwd="/").returncode == 0:
            return python, env
    return None


def private_dir(prefix: str, mode: int = 0o711) -> Path:
    """A directory of the unprivileged user's under the system temp dir, which it can reach (pytest's own
    temporary directories are 0700 root's). Removed by the caller."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(mode)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    return path


def standin_bin(directory: Path, name: str = "apptainer", conf: str = "") -> Path:
    """`directory` with the stand-in under `name` (a symlink: `singularity` makes it SingularityCE) and, next to
    it, its configuration file `<name>.conf` holding `conf` (as apptainer.conf / singularity.conf would)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    (directory / name).symlink_to(STANDIN)
    (directory / f"{name}.conf").write_text(conf)
    (directory / f"{name}.conf").chmod(0o644)
    return directory


@dataclass
class StandinServer:
    service: Service
    state: Path
    home: Path  # the server's HOME: the stand-in keeps its instance files below it
    env: dict[str, str]  # the server's whole environment

    @property
    def url(self) -> str:
        return self.service.url

    def apptainer(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run the stand-in as the server's user with the server's environment (and `env` over it)."""
        argv = [*as_user(), "env", "-i", *(f"{k}={v}" for k, v in {**self.env, **env}.items()), "apptainer", *args]
        return subprocess.run(argv, capture_output=True, text=True, cwd="/")

    def stop(self) -> None:
        self.service.stop()
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


def start_standin_server(
    bin_dir: Path, image_dirs: list[Path], extra_env: dict[str, str] | None = None, backend: str = "apptainer"
) -> StandinServer:
    """`prorl-sandbox serve --backend BACKEND` as the unprivileged user, with `bin_dir` (see `standin_bin`)
    first on PATH, a HOME of its own, and `extra_env` (APPTAINER_BIND, say) in its environment."""
    found = python_for_user()
    if found is None:
        raise RuntimeError("no Python that the unprivileged user nobody can run with this checkout importable")
    python, python_env = found
    state, home = private_dir("prorl-standin-state-"), private_dir("prorl-standin-home-", 0o700)
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "USER": "nobody" if os.geteuid() == 0 else os.environ.get("USER", ""),
        "LANG": "C.UTF-8",
        **python_env,
        **(extra_env or {}),
    }
    argv = [*as_user(), "env", "-i", *(f"{k}={v}" for k, v in env.items())]
    argv += localstack.runtime_argv(state, python)
    argv += ["--backend", backend, "--log-level", "WARNING"]
    argv += [arg for directory in image_dirs for arg in ("--image-dir", str(directory))]
    service = localstack.start_service(f"{backend} stand-in sandbox runtime", argv, "/healthz", 30)
    return StandinServer(service, state, home, env)
