"""How a task's eval runs a check command in the agent's sandbox so that nothing the agent left there runs in its
place: the workspace is data the check reads, never code it imports.

A one-shot run (`SandboxHandle.run`) already starts from the sandbox's own environment, not the agent's shell: no
variable the agent exported, no BASH_ENV or ENV, `bash --norc --noprofile`, PATH as the sandbox's spec sets it. What
is left is Python's habit of importing from where it stands: `python3 -c` and `python3 -m` put the working
directory (the workspace) first on sys.path, and `python3 script.py` the script's directory, so a planted `json.py`
would be what `import json` runs; and the user site directory lies in the workspace too (HOME), where a planted
`.pth` file runs at every start. CHECK_ENV turns both off for every Python 3.11 or newer the check starts
(PYTHONSAFEPATH is new in 3.11: an image with an older Python still imports from the working directory).

The sandbox's HOME is the workspace too, and the tools a check uses read their configuration from there: a planted
~/.gitconfig runs code (`core.fsmonitor` runs a command at `git status`), ~/.npmrc, ~/.bashrc for a nested shell,
~/.config. So a check runs with a HOME of its own, new and empty under /tmp, with XDG_CONFIG_HOME and the caches
below it, and git reads no global or system configuration (GIT_CONFIG_GLOBAL=/dev/null, GIT_CONFIG_NOSYSTEM=1). A
repository's own .git/config in the workspace is still the agent's: a check should not run git in one it left.
"""

from __future__ import annotations

import uuid

from prorl_adapter.tasks import SandboxHandle
from sandbox_runtime.models import RunResult

CHECK_ENV = {
    "PYTHONSAFEPATH": "1",  # no working directory or script directory on sys.path
    "PYTHONNOUSERSITE": "1",  # no ~/.local site-packages (HOME is the workspace)
    "PYTHONDONTWRITEBYTECODE": "1",  # the check leaves no __pycache__ in the workspace it reads
    "GIT_CONFIG_GLOBAL": "/dev/null",  # no ~/.gitconfig (core.fsmonitor, aliases, hooksPath)
    "GIT_CONFIG_NOSYSTEM": "1",
}


def check_env() -> dict[str, str]:
    """CHECK_ENV with a fresh HOME under /tmp (its name unguessable, made by the script before the check runs)."""
    home = f"/tmp/check-home-{uuid.uuid4().hex}"
    return {
        **CHECK_ENV,
        "HOME": home,
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_DATA_HOME": f"{home}/.local/share",
    }


def check_script(script: str) -> str:
    """What bash runs for a check: the check's HOME made first (the run fails if it cannot be), then `script`."""
    return f'mkdir -p -m 700 -- "$HOME" || exit 1\n{script}'


async def run_check(env: SandboxHandle, script: str, timeout: float = 60.0) -> RunResult:
    """`script` run by bash as a one-shot process in the workspace, with `check_env()`: what a check should use."""
    return await env.run(script=check_script(script), env=check_env(), timeout=timeout)
