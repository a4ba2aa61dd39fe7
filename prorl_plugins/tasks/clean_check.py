"""How a task's eval runs a check command in the agent's sandbox so that nothing the agent left there runs in its
place: the workspace is data the check reads, never code it imports.

A one-shot run (`Environment.run`) already starts from the sandbox's own environment, not the agent's shell: no
variable the agent exported, no BASH_ENV or ENV, `bash --norc --noprofile`, PATH as the sandbox's spec sets it. What
is left is Python's habit of importing from where it stands: `python3 -c` and `python3 -m` put the working
directory (the workspace) first on sys.path, and `python3 script.py` the script's directory, so a planted `json.py`
would be what `import json` runs; and the user site directory lies in the workspace too (HOME), where a planted
`.pth` file runs at every start. CHECK_ENV turns both off for every Python 3.11 or newer the check starts
(PYTHONSAFEPATH is new in 3.11: an image with an older Python still imports from the working directory).
"""

from __future__ import annotations

from prorl_adapter.tasks import Environment
from sandbox_runtime.models import RunResult

CHECK_ENV = {
    "PYTHONSAFEPATH": "1",  # no working directory or script directory on sys.path
    "PYTHONNOUSERSITE": "1",  # no ~/.local site-packages (HOME is the workspace)
    "PYTHONDONTWRITEBYTECODE": "1",  # the check leaves no __pycache__ in the workspace it reads
}


async def run_check(env: Environment, script: str, timeout: float = 60.0) -> RunResult:
    """`script` run by bash as a one-shot process in the workspace, with CHECK_ENV: what a check should use."""
    return await env.run(script=script, env=CHECK_ENV, timeout=timeout)
