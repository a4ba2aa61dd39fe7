"""Apptainer (or Singularity): rootless containers from a SIF image, the backend of HPC clusters.

Each sandbox is one named instance, `prorl-<id>`, started by `create` and stopped by `destroy`; each session
is an `apptainer exec instance://...` that joins the instance's namespaces and runs bash in it.
The instance runs `--containall` (its own pid, ipc and mount namespaces, a clean environment), with no
host home, cwd or /tmp mounted, a throw-away writable layer over the image, no network unless asked, and
only the sandbox's own workspace and /tmp bound in from the host.

The session's environment travels as `env -- K=V ... bash` after the instance URI, not as `--env` flags:
- `--env HOME=...` is refused by Apptainer ("Overriding HOME environment variable ... is not permitted",
  printed to the session's terminal) and HOME stays the host user's home path;
- unless `--no-eval` (Apptainer >= 1.1 only) is given, values passed with `--env` are shell-evaluated as
  they are injected, so `$`, backquotes and quotes in a value are not kept verbatim;
- the `--env` flag parser splits a pair with several '=' on commas (CSV) and strips '"' from the ends.
`env` hands the variables to bash exactly as given, after the image's own environment scripts have run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import Awaitable, Callable

from ..models import SandboxSpec
from ..session import Launch
from .base import DEFAULT_PATH, SHELL_ARGV, Backend, BackendError, SandboxDirs, ulimit_args

# Runs one command line; returns its exit status and its output (stdout and stderr together).
Runner = Callable[[list[str]], Awaitable[tuple[int, str]]]

INSTANCE_PREFIX = "prorl-"
COMMAND_TIMEOUT_S = 120.0  # starting an instance may convert a SIF to a sandbox or pull an image first
TIMEOUT_STATUS = 124  # what a timed-out command reports, as timeout(1) does
OUTPUT_TAIL = 2000
NOT_INSTALLED = "neither apptainer nor singularity is installed"
# Host variables that configure the apptainer command itself (where its instance files live, its config,
# its cache). `instance start` inherits the server's environment; each session's exec must see the same
# ones to find the instance. Apptainer never forwards them into the container.
_CLI_ENV_PREFIXES = ("APPTAINER_", "SINGULARITY_")


async def run_command(argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> tuple[int, str]:
    """Run `argv` to completion without a terminal; kill its process group if it outlasts `timeout`."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return 127, f"cannot run {argv[0]}: {exc}"
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return TIMEOUT_STATUS, f"{' '.join(argv[:3])} timed out after {timeout:g} s"
    return proc.returncode, output.decode("utf-8", errors="replace")


def _refuse_root(dirs: SandboxDirs) -> None:
    """Apptainer started by root runs its containers as root; clusters run it as the user, and so must we."""
    if dirs.uid is not None:
        raise BackendError(
            "the apptainer backend runs only under an unprivileged server (as on a cluster): started by root, "
            "Apptainer would run the sandbox as root; run prorl-sandbox as a normal user",
            400,
        )


def _tail(output: str) -> str:
    text = output.strip()
    return text[-OUTPUT_TAIL:] if text else "no output"


class ApptainerBackend(Backend):
    name = "apptainer"
    isolated = True

    def __init__(
        self,
        binary: str | None = None,
        fakeroot: bool = False,
        default_image: str | None = None,
        runner: Runner | None = None,
    ) -> None:
        self.binary = binary or shutil.which("apptainer") or shutil.which("singularity")
        self.fakeroot = fakeroot
        self.default_image = default_image
        self._runner: Runner = runner or run_command

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        path = shutil.which("apptainer") or shutil.which("singularity")
        if path is None:
            return False, NOT_INSTALLED
        return True, path

    # -- command lines ----------------------------------------------------------------------------------
    @staticmethod
    def instance_name(dirs: SandboxDirs) -> str:
        return INSTANCE_PREFIX + dirs.id

    def _bin(self) -> str:
        if self.binary is None:
            raise BackendError(NOT_INSTALLED, 500)
        return self.binary

    def image(self, dirs: SandboxDirs) -> str:
        """The image's host path, as the manager resolved its name under the server's image directories."""
        image = str(dirs.image_root) if dirs.image_root else self.default_image
        if not image:
            raise BackendError("an image is required for apptainer (a SIF file in one of the image directories)", 400)
        return image

    def start_argv(self, dirs: SandboxDirs, spec: SandboxSpec) -> list[str]:
        _refuse_root(dirs)
        image = self.image(dirs)
        argv = [
            self._bin(),
            "instance",
            "start",
            "--containall",
            "--no-mount",
            "home,cwd,tmp",
            "--writable-tmpfs",
        ]
        if spec.network != "host":
            argv += ["--net", "--network", "none"]
        if self.fakeroot:
            argv.append("--fakeroot")
        argv += ["--bind", f"{dirs.tmp}:/tmp", "--bind", f"{dirs.workspace}:{spec.workdir}"]
        argv += [image, self.instance_name(dirs)]
        return argv

    def exec_argv(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> list[str]:
        _refuse_root(dirs)
        workdir = self.workdir(dirs, spec)
        env = self.sandbox_env(dirs, spec)
        assignments = [f"{key}={env[key]}" for key in sorted(env)]
        return [
            self._bin(),
            "exec",
            "--pwd",
            workdir,
            f"instance://{self.instance_name(dirs)}",
            "env",
            "--",
            *assignments,
            *command,
        ]

    def stop_argv(self, name: str) -> list[str]:
        return [self._bin(), "instance", "stop", "--force", name]

    def list_argv(self) -> list[str]:
        return [self._bin(), "instance", "list", "--json"]

    # -- life cycle -------------------------------------------------------------------------------------
    async def create(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        argv = self.start_argv(dirs, spec)
        code, output = await self._runner(argv)
        if code == TIMEOUT_STATUS:  # it may have got as far as starting the instance: do not leave it behind
            await self._runner(self.stop_argv(self.instance_name(dirs)))
        if code != 0:
            raise BackendError(f"apptainer instance start failed (exit {code}): {_tail(output)}", 500)

    def launch(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> Launch:
        # --containall implies --cleanenv, so nothing of this environment reaches the sandbox: it is what the
        # apptainer command itself needs. The session's own variables are in the argv (see the module doc).
        env = {"PATH": os.environ.get("PATH") or DEFAULT_PATH}
        env.update({key: value for key, value in os.environ.items() if key.startswith(_CLI_ENV_PREFIXES)})
        return Launch(
            argv=self.exec_argv(dirs, spec, command),
            env=env,
            ulimits=ulimit_args(spec.limits),
            # The exec process is not a pid-namespace holder: the session is killed as a Unix session.
            pid_namespace=False,
        )

    async def end_processes(self, dirs: SandboxDirs, spec: SandboxSpec) -> int:
        """A daemon a session started lives on in the instance's pid namespace: restarting it ends them all."""
        await self.destroy(dirs, spec)
        await self.create(dirs, spec)
        return 0

    async def destroy(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        await self._stop(self.instance_name(dirs))

    async def _stop(self, name: str) -> None:
        code, output = await self._runner(self.stop_argv(name))
        if code != 0 and "no instance found" not in output.lower():
            raise BackendError(f"apptainer instance stop {name} failed (exit {code}): {_tail(output)}", 500)

    async def instance_names(self) -> set[str]:
        """Names of this user's running instances, for crash recovery to tell which sandboxes survived.

        This runs `instance list --json` through the runner rather than spython's `instances()`: spython
        hard-codes the `singularity` command (and checks for it with `singularity --version`), ignoring the
        configured binary, and it runs the command synchronously, which would block the event loop.
        """
        code, output = await self._runner(self.list_argv())
        if code != 0:
            if "no instance" in output.lower():  # old Singularity releases exit 1 when there are none
                return set()
            raise BackendError(f"apptainer instance list failed (exit {code}): {_tail(output)}", 500)
        start = output.find("{")
        if start < 0:
            raise BackendError(f"apptainer instance list printed no JSON: {_tail(output)}", 500)
        try:
            listing, _ = json.JSONDecoder().raw_decode(output, start)  # warnings may precede the JSON
        except ValueError as exc:
            raise BackendError(f"apptainer instance list printed invalid JSON ({exc}): {_tail(output)}", 500) from exc
        entries = listing.get("instances") if isinstance(listing, dict) else None
        return {
            name
            for entry in entries or []
            if isinstance(entry, dict) and (name := entry.get("instance") or entry.get("name"))
        }
