"""One-shot runs: a fresh process in the sandbox whose exit status the server takes from the kernel.

An interactive session reports a command's exit code through the terminal the command itself writes to: a
program in the sandbox that finds the shell's completion marker (it can read its parent's memory) prints a
forged one. Evaluation must not rest on that. A one-shot run starts a new launcher (under bwrap, a new set of
namespaces), feeds its bash a trusted script on stdin, and reaps the launcher with waitpid: the exit status is
the kernel's (bwrap passes on its command's status, 128+N for a signal). Nothing of a session's shell state (a
`cd`, an alias, a function, a variable) reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from . import procs
from .models import RunResult
from .output import OutputBuffer
from .session import Launch, default_signals, preamble, shell_word

# After a local run's process exits, how long its output may keep arriving from processes it left behind.
_DRAIN_AFTER_EXIT_S = 1.0


def run_script(launch: Launch, cwd: str, env: dict[str, str], argv: list[str]) -> str:
    """The script the one-shot bash reads: limits, environment, cwd, then `exec` of the program with its stdin
    on /dev/null. The group is parsed whole before it runs, so the program cannot read the rest of it."""
    exports = "".join(f"export {name}={shell_word(value)}; " for name, value in env.items())
    command = " ".join(shell_word(arg) for arg in argv)
    return f"{{ {preamble(launch)}{exports}cd -- {shell_word(cwd)} || exit 96; exec {command}; }} </dev/null\n"


async def run_once(launch: Launch, script: str, timeout: float, max_output: int) -> RunResult:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *launch.argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=launch.env,
        cwd=launch.cwd,
        start_new_session=True,
        preexec_fn=default_signals,
    )
    output = OutputBuffer(max_output)
    reader = asyncio.ensure_future(_read_all(proc.stdout, output))
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(script.encode("utf-8", errors="surrogateescape"))
            await proc.stdin.drain()
            proc.stdin.close()
        try:
            exit_code: int | None = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            exit_code = None
            _kill(proc.pid, launch.pid_namespace)
            await proc.wait()
        # Under a pid namespace everything it started is gone now and the pipe closes at once; a local run's
        # leftovers may hold it open, so its output is waited for only briefly.
        drain = None if launch.pid_namespace else _DRAIN_AFTER_EXIT_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), drain)
    finally:
        if proc.returncode is None:
            _kill(proc.pid, launch.pid_namespace)
            await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    text, truncated = output.take()
    return RunResult(
        output=text,
        exit_code=exit_code,
        status="completed" if exit_code is not None else "timeout",
        truncated=truncated,
        duration_s=round(time.monotonic() - started, 6),
    )


async def _read_all(stream: asyncio.StreamReader, output: OutputBuffer) -> None:
    while chunk := await stream.read(65536):
        output.feed(chunk)


def _kill(pid: int, pid_namespace: bool) -> None:
    """Kill the run and everything it started: its pid namespace's init where it has one, else its session."""
    inits = procs.children(pid) if pid_namespace else []
    for child in inits:
        procs.kill(child)
    procs.kill_session(pid)
