"""Apptainer (or SingularityCE): rootless containers from a SIF image, the backend of HPC clusters.

Each sandbox is one named instance, `prorl-<id>`, started by `create` and stopped by `destroy`; each session
is an `apptainer exec instance://...` that joins the instance's namespaces and runs bash in it.
The instance runs `--containall` (its own pid and ipc namespaces; no host home, cwd or /tmp mounted), with
`--no-mount bind-paths,hostfs` so that the site's `bind path` entries of apptainer.conf are not mounted either,
a throw-away writable layer over the image, no network unless asked, and only the sandbox's own workspace and
/tmp bound in from the host. Where cgroups v2 delegates memory and pids to the server's user (decided once,
`cgroup_limits_usable`), `--memory` and `--pids-limit` on the instance are the sandbox's real limits; the
session's `ulimit`s apply as well, everywhere.

Every apptainer command runs with the global `-s` (silent: no INFO or WARNING notices ahead of a session's
first output) and a fixed, minimal environment (`command_env`): PATH, HOME, USER, LOGNAME, XDG_RUNTIME_DIR,
DBUS_SESSION_BUS_ADDRESS and Apptainer's own location variables (config, cache and tmp dirs), nothing else.
HOME (or APPTAINER_CONFIGDIR) is where Apptainer keeps its instance files, so `exec` needs the same as
`instance start`; XDG_RUNTIME_DIR and DBUS_SESSION_BUS_ADDRESS let a rootless `exec` join the instance's
cgroup through the user's systemd. The rest of the server's environment is left out on purpose: variables that
HPC module files set, such as APPTAINER_BIND / SINGULARITY_BINDPATH (mounts) and APPTAINERENV_* (variables
injected into the container), would otherwise reach the sandbox despite `--containall`.

`--cleanenv` is given on each `exec`: an exec builds its own environment, whatever the instance was started
with. The container's environment is then the image's (its /.singularity.d/env scripts) plus what Apptainer's
action script exports, among which `PS1="Apptainer> "` and a PROMPT_COMMAND that sets it again: the session
drops PROMPT_COMMAND (`env -u PROMPT_COMMAND`) before bash starts and its set-up line resets PS1 and PS2.

SingularityCE 4 may run in OCI mode (`oci mode = yes` in singularity.conf), which has no `instance start`: the
flavour is read once from `<binary> --version`, before the first start, and `--no-oci` is added for
SingularityCE >= 4 (Apptainer refuses that flag).

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
import logging
import os
import re
import shutil
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..models import SandboxSpec
from ..session import Launch
from .base import DEFAULT_PATH, SHELL_ARGV, Backend, BackendError, SandboxDirs, ulimit_args

log = logging.getLogger(__name__)

# Runs one command line with exactly the given environment; returns its exit status and its output (stdout
# and stderr together).
Runner = Callable[[list[str], dict[str, str]], Awaitable[tuple[int, str]]]

INSTANCE_PREFIX = "prorl-"
COMMAND_TIMEOUT_S = 120.0  # starting an instance may convert a SIF to a sandbox or pull an image first
TIMEOUT_STATUS = 124  # what a timed-out command reports, as timeout(1) does
OUTPUT_TAIL = 2000
NOT_INSTALLED = "neither apptainer nor singularity is installed"
# Global flag before every subcommand: no INFO/WARNING notices (errors are still printed).
SILENT = "-s"
# `--no-mount` of the instance: no host home, cwd or /tmp, no hostfs, no site `bind path` entries.
NO_MOUNT = "home,cwd,tmp,hostfs,bind-paths"
# What the apptainer command itself may see of the server's environment, where set: where its instance
# files live (HOME), who runs it, and the user's systemd (cgroups for a rootless exec)...
_HOST_ENV = ("HOME", "USER", "LOGNAME", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")
# ...and Apptainer's own location variables (the SINGULARITY_ spellings are its legacy names).
_LOCATION_ENV = tuple(f"{p}_{s}" for p in ("APPTAINER", "SINGULARITY") for s in ("CONFIGDIR", "CACHEDIR", "TMPDIR"))
# `--bind src:dst[:opts]` lists are split on ',' and each bind on ':', with no escape: a path holding either
# would add binds or options of its own choosing (workdir "/data:ro", or "/w,/etc:/x"). Such paths are
# refused rather than passed through `--mount` (whose CSV quoting SingularityCE 3.x and old Apptainer lack).
_BIND_SEPARATORS = frozenset(":,")
_VERSION_LINE = re.compile(r"^\s*(apptainer|singularity-ce|singularity)\s+version\s+v?(\d+(?:\.\d+)*)", re.M)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_CONTROLLERS = ("memory", "pids")


async def run_command(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = COMMAND_TIMEOUT_S
) -> tuple[int, str]:
    """Run `argv` with environment `env` (None: the server's) to completion without a terminal; kill its
    process group if it outlasts `timeout`."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
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
        return TIMEOUT_STATUS, f"{' '.join(argv[:4])} timed out after {timeout:g} s"
    return proc.returncode, output.decode("utf-8", errors="replace")


def command_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of an apptainer command: PATH (the server's, to find apptainer's helpers), the
    host variables it needs and its own location variables, where set; nothing else of `environ`."""
    environ = os.environ if environ is None else environ
    env = {"PATH": environ.get("PATH") or DEFAULT_PATH}
    env.update({key: environ[key] for key in (*_HOST_ENV, *_LOCATION_ENV) if environ.get(key)})
    return env


@dataclass(frozen=True)
class Flavour:
    """Which implementation the binary is, from its `--version`: apptainer, singularity-ce, or singularity
    (Singularity before the Apptainer/SingularityCE split); "unknown" with no version where it said nothing."""

    name: str
    version: tuple[int, ...] = ()

    @property
    def needs_no_oci(self) -> bool:
        """SingularityCE 4 in OCI mode refuses `instance start`; `--no-oci` makes it use its native runtime."""
        return self.name == "singularity-ce" and self.version >= (4,)


def parse_version(output: str) -> Flavour:
    """`apptainer version 1.4.5`, `singularity-ce version 4.3.0`, ... (notices may come first)."""
    match = _VERSION_LINE.search(output)
    if match is None:
        return Flavour("unknown")
    return Flavour(match.group(1), tuple(int(part) for part in match.group(2).split(".")))


def cgroup_limits_usable(
    unified_controllers: str | None, user_controllers: str | None, environ: Mapping[str, str]
) -> tuple[bool, str]:
    """Whether a rootless `instance start --memory/--pids-limit` can work, and why (not).

    `unified_controllers` is /sys/fs/cgroup/cgroup.controllers (None: absent, so no cgroups v2 unified
    hierarchy); `user_controllers` the cgroup.controllers of the user's systemd service
    (user.slice/user-UID.slice/user@UID.service; None: absent), which lists what systemd delegates to the
    user; `environ` the server's environment: Apptainer asks the user's systemd over D-Bus for the cgroup.
    """
    if unified_controllers is None:
        return False, "no cgroups v2 unified hierarchy (/sys/fs/cgroup/cgroup.controllers is missing)"
    unset = [key for key in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS") if not environ.get(key)]
    if unset:
        return False, f"{' and '.join(unset)} not set, so Apptainer cannot reach the user's systemd"
    if user_controllers is None:
        return False, "the user has no systemd user slice (user@UID.service) to delegate cgroup controllers"
    missing = [name for name in _CGROUP_CONTROLLERS if name not in user_controllers.split()]
    if missing:
        return False, f"the user's systemd slice does not delegate the {' and '.join(missing)} controller(s)"
    return True, "cgroups v2 with the memory and pids controllers delegated to this user"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_limits_here(uid: int | None = None, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """`cgroup_limits_usable` for this machine and the server's uid."""
    uid = os.getuid() if uid is None else uid
    user = _CGROUP_ROOT / "user.slice" / f"user-{uid}.slice" / f"user@{uid}.service" / "cgroup.controllers"
    return cgroup_limits_usable(
        _read(_CGROUP_ROOT / "cgroup.controllers"), _read(user), os.environ if environ is None else environ
    )


def _refuse_root(dirs: SandboxDirs) -> None:
    """Apptainer started by root runs its containers as root; clusters run it as the user, and so must we."""
    if dirs.uid is not None:
        raise BackendError(
            "the apptainer backend runs only under an unprivileged server (as on a cluster): started by root, "
            "Apptainer would run the sandbox as root; run prorl-sandbox as a normal user",
            400,
        )


def _refuse_bind_separators(dirs: SandboxDirs, spec: SandboxSpec) -> None:
    """A path in a `--bind` may hold neither ':' nor ',' (see _BIND_SEPARATORS)."""
    if _BIND_SEPARATORS & set(spec.workdir):
        raise BackendError(
            f"workdir {spec.workdir!r} contains ':' or ',', which Apptainer's --bind would read as bind "
            "options or a further bind; choose a workdir without them, e.g. /workspace",
            400,
        )
    for path in (dirs.tmp, dirs.workspace):
        if _BIND_SEPARATORS & set(str(path)):
            raise BackendError(
                f"the sandbox directory {path} contains ':' or ',', which Apptainer's --bind cannot take; "
                "start the server with a --state-dir whose path has neither",
                500,
            )


def _tail(output: str) -> str:
    text = output.strip()
    return text[-OUTPUT_TAIL:] if text else "no output"


class ApptainerBackend(Backend):
    name = "apptainer"
    isolated = True
    runs_sif = True

    def __init__(
        self,
        binary: str | None = None,
        fakeroot: bool = False,
        default_image: str | None = None,
        runner: Runner | None = None,
        cgroups: bool | None = None,
    ) -> None:
        """`cgroups`: whether to put `--memory`/`--pids-limit` on instances; None decides it from this machine
        (`cgroup_limits_here`) at the first start."""
        self.binary = binary or shutil.which("apptainer") or shutil.which("singularity")
        self.fakeroot = fakeroot
        self.default_image = default_image
        self._runner: Runner = runner or run_command
        self._cgroups = cgroups
        self._flavour: Flavour | None = None
        self._flavour_lock = asyncio.Lock()

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        path = shutil.which("apptainer") or shutil.which("singularity")
        if path is None:
            return False, NOT_INSTALLED
        return True, path

    # -- what this installation is ----------------------------------------------------------------------
    async def flavour(self) -> Flavour:
        """The binary's flavour, asked once (`--version`); "unknown" (no `--no-oci`) if it would not say."""
        async with self._flavour_lock:
            if self._flavour is None:
                code, output = await self._runner([self._bin(), "--version"], command_env())
                self._flavour = parse_version(output) if code == 0 else Flavour("unknown")
                if self._flavour.name == "unknown":
                    log.warning("%s --version did not name a version (exit %s): %s", self._bin(), code, _tail(output))
        return self._flavour

    @property
    def cgroups(self) -> bool:
        if self._cgroups is None:
            self._cgroups, why = cgroup_limits_here()
            log.info(
                "apptainer: %s cgroup limits (--memory, --pids-limit): %s", "using" if self._cgroups else "no", why
            )
        return self._cgroups

    # -- command lines ----------------------------------------------------------------------------------
    @staticmethod
    def instance_name(dirs: SandboxDirs) -> str:
        return INSTANCE_PREFIX + dirs.id

    def _bin(self) -> str:
        if self.binary is None:
            raise BackendError(NOT_INSTALLED, 500)
        return self.binary

    def image(self, dirs: SandboxDirs) -> str:
        """The image's host path as the manager resolved its name under the server's image directories: a SIF
        file, else a root filesystem directory (Apptainer runs such a sandbox directory directly)."""
        resolved = dirs.image_file or dirs.image_root
        image = str(resolved) if resolved else self.default_image
        if not image:
            raise BackendError("an image is required for apptainer (a SIF file in one of the image directories)", 400)
        return image

    def start_argv(self, dirs: SandboxDirs, spec: SandboxSpec) -> list[str]:
        """`instance start`; the flavour must have been asked (`flavour()`) for `--no-oci` to be added."""
        _refuse_root(dirs)
        _refuse_bind_separators(dirs, spec)
        image = self.image(dirs)
        argv = [self._bin(), SILENT, "instance", "start"]
        if self._flavour is not None and self._flavour.needs_no_oci:
            argv.append("--no-oci")
        argv += ["--containall", "--no-mount", NO_MOUNT, "--writable-tmpfs"]
        if spec.network != "host":
            argv += ["--net", "--network", "none"]
        if self.fakeroot:
            argv.append("--fakeroot")
        if self.cgroups:
            if spec.limits.memory_mb is not None:
                argv += ["--memory", f"{spec.limits.memory_mb}M"]
            if spec.limits.pids is not None:
                argv += ["--pids-limit", str(spec.limits.pids)]
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
            SILENT,
            "exec",
            "--cleanenv",
            "--pwd",
            workdir,
            f"instance://{self.instance_name(dirs)}",
            # Apptainer's action script exports a PROMPT_COMMAND that sets PS1="Apptainer> " at bash's first
            # prompt; bash must not inherit it.
            "env",
            "-u",
            "PROMPT_COMMAND",
            "--",
            *assignments,
            *command,
        ]

    def stop_argv(self, name: str) -> list[str]:
        return [self._bin(), SILENT, "instance", "stop", "--force", name]

    def list_argv(self) -> list[str]:
        return [self._bin(), SILENT, "instance", "list", "--json"]

    # -- life cycle -------------------------------------------------------------------------------------
    async def create(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        _refuse_root(dirs)
        _refuse_bind_separators(dirs, spec)
        self.image(dirs)
        await self.flavour()
        argv = self.start_argv(dirs, spec)
        code, output = await self._runner(argv, command_env())
        if code == TIMEOUT_STATUS:  # it may have got as far as starting the instance: do not leave it behind
            await self._runner(self.stop_argv(self.instance_name(dirs)), command_env())
        if code != 0:
            raise BackendError(f"apptainer instance start failed (exit {code}): {_tail(output)}", 500)

    def launch(self, dirs: SandboxDirs, spec: SandboxSpec, command: list[str] = SHELL_ARGV) -> Launch:
        # `--cleanenv` keeps this environment out of the sandbox: it is what the apptainer command itself
        # needs. The session's own variables are in the argv (see the module doc).
        return Launch(
            argv=self.exec_argv(dirs, spec, command),
            env=command_env(),
            ulimits=ulimit_args(spec.limits),
            # The exec process is not a pid-namespace holder: the session is killed as a Unix session.
            pid_namespace=False,
        )

    async def reset(
        self, dirs: SandboxDirs, spec: SandboxSpec, clean: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """A daemon a session started lives on in the instance's pid namespace: stopping the instance ends them
        all. It starts again only after `clean`, so that nothing of the new one sees a half-emptied workspace."""
        await self.destroy(dirs, spec)
        if clean is not None:
            await clean()
        await self.create(dirs, spec)

    async def destroy(self, dirs: SandboxDirs, spec: SandboxSpec) -> None:
        await self._stop(self.instance_name(dirs))

    async def _stop(self, name: str) -> None:
        code, output = await self._runner(self.stop_argv(name), command_env())
        if code != 0 and "no instance found" not in output.lower():
            raise BackendError(f"apptainer instance stop {name} failed (exit {code}): {_tail(output)}", 500)

    async def instance_names(self) -> set[str]:
        """Names of this user's running instances, for crash recovery to tell which sandboxes survived.

        This runs `instance list --json` through the runner rather than spython's `instances()`: spython
        hard-codes the `singularity` command (and checks for it with `singularity --version`), ignoring the
        configured binary, and it runs the command synchronously, which would block the event loop.
        """
        code, output = await self._runner(self.list_argv(), command_env())
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
