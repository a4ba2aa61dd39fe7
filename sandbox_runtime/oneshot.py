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
import os
import time

from . import fdio, procs, spawn
from .models import RunResult
from .output import OutputBuffer
from .session import Launch, preamble, shell_word

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
    pid, stdin_fd, output_fd = spawn.with_pipes(launch.argv, launch.env)
    exited = asyncio.ensure_future(procs.wait_exit(pid))
    output = OutputBuffer(max_output)
    reader = asyncio.ensure_future(_read_all(output_fd, output))
    # A script larger than the pipe's buffer is written as bash reads it. bash needs no end of input: the
    # script is one group that ends in an `exec` (or an exit), with its stdin on /dev/null.
    writer = asyncio.ensure_future(fdio.write_all(stdin_fd, script.encode("utf-8", errors="surrogateescape")))
    try:
        exit_code: int | None = None
        done, _ = await asyncio.wait({exited}, timeout=timeout)
        if done:
            exit_code = exited.result()
        else:
            _kill(pid, launch.pid_namespace)
            await asyncio.shield(exited)
        # Under a pid namespace everything it started is gone now and the pipe closes at once; a local run's
        # leftovers may hold it open, so its output is waited for only briefly.
        drain = None if launch.pid_namespace else _DRAIN_AFTER_EXIT_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), drain)
    finally:
        if not exited.done():
            _kill(pid, launch.pid_namespace)
            await asyncio.shield(exited)
        for task in (writer, reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
        os.close(stdin_fd)  # here, not in the tasks: a task cancelled before it started runs nothing
        os.close(output_fd)
    text, truncated = output.take()
    return RunResult(
        output=text,
        exit_code=exit_code,
        status="completed" if exit_code is not None else "timeout",
        truncated=truncated,
        duration_s=round(time.monotonic() - started, 6),
    )


async def _read_all(fd: int, output: OutputBuffer) -> None:
    """Feed `output` from `fd` (non-blocking) until its end."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            await fdio.ready(fd)
            continue
        if not chunk:
            return
        output.feed(chunk)


def _kill(pid: int, pid_namespace: bool) -> None:
    """Kill the run and everything it started: its pid namespace's init where it has one, else its session."""
    inits = procs.children(pid) if pid_namespace else []
    for child in inits:
        procs.kill(child)
    procs.kill_session(pid)
