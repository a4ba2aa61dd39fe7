"""A persistent bash session driven through a pseudo-terminal by the asyncio event loop.

How a command runs, and why:
- bash runs interactive (`-i`) so that job control gives each command its own process group (Ctrl-C and
  a timeout kill reach the command, not the shell) and so that PROMPT_COMMAND runs after every command.
- PROMPT_COMMAND prints a completion marker `RS nonce:exit_code:cwd RS`. A marker printed by the command
  line itself would be dropped by bash after an interrupt; one printed from PROMPT_COMMAND always appears.
  The nonce is random per command, so a late marker is never mistaken, and output of a process that does not
  share the shell's variables (a program it runs, a file it cats) cannot forge the marker. The session's own
  code can: the nonce is a shell variable, which a DEBUG trap or PROMPT_COMMAND-like code may print. A
  session's exit_code and cwd are therefore what the session's own code says; a grader must not trust them
  and runs its checks through the one-shot /run, a process of its own (clean_check.run_check, swe.py).
- Each command is sent as one line, `eval $'...'`, with every control byte escaped: the terminal never
  sees a raw newline (a multi-line script cannot leave bash waiting at PS2) nor a byte that the line
  discipline would act on. The terminal is in non-canonical mode, so a line has no 4 KB limit.
- The line sets the nonce inside an arithmetic expansion that expands to nothing (`${__prorl_z:N=...:0}`), not
  with an assignment before `eval`: an assignment is a command of its own and sets `$?` to 0, so `echo $?` would
  never see the previous command's status. An expansion leaves `$?` as the previous command left it, fires no
  ERR trap and trips no `set -e`. The nonce is therefore a number.
- Reads happen in an event-loop reader callback, only while a command is in flight; an idle session is
  not read at all, so a background job flooding output blocks on the full terminal instead of burning CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass, field

from server_kit.errors import ApiError

from . import fdio, procs, spawn
from .forwards import ForwardError, Forwards
from .models import ExecResult, ExecStatus, PortForward
from .output import OutputBuffer

MARKER_START = b"\x1e"
# How long a command may take to react to Ctrl-C before its process group is killed.
INTERRUPT_GRACE_S = 0.5
KILL_GRACE_S = 1.0
START_TIMEOUT_S = 20.0

_PROMPT_COMMAND = r'__prorl_rc=$?; printf "\036%s:%s:%s\036\n" "$__prorl_nonce" "$__prorl_rc" "$PWD"'
# PS1 and PS2 are reset here, whatever bash inherited: a launcher's environment may set them (Apptainer's action
# script exports PS1="Apptainer> "), and the marker must be the only prompt text.
_SETUP_LINE = (
    "set +H +o history; unset HISTFILE; PS1=; PS2=; "
    f"declare -r PROMPT_COMMAND='{_PROMPT_COMMAND}' __prorl_z=; __prorl_nonce={{nonce}}\n"
)


def command_line(nonce: str, command: str) -> bytes:
    """The terminal line that runs `command` with completion marker `nonce`, leaving `$?` as it was."""
    expansion = b'"${__prorl_z:__prorl_nonce=' + nonce.encode() + b':0}"'  # empty, and sets the nonce
    return b"eval " + expansion + encode_command(command).removeprefix(b"eval ") + b"\n"


# Named keys for the input API; "C-x" control chords are computed.
KEYS = {
    "Enter": b"\r",
    "Tab": b"\t",
    "Escape": b"\x1b",
    "Backspace": b"\x7f",
    "Up": b"\x1b[A",
    "Down": b"\x1b[B",
}
KEYS.update({"Right": b"\x1b[C", "Left": b"\x1b[D", "Space": b" "})


def key_bytes(key: str) -> bytes:
    if key in KEYS:
        return KEYS[key]
    if len(key) == 3 and key[:2] == "C-" and key[2].isascii() and key[2].isalpha():
        return bytes([ord(key[2].lower()) - ord("a") + 1])
    raise ValueError(f"unknown key {key!r}: use C-a..C-z or one of {', '.join(KEYS)}")


def encode_command(command: str) -> bytes:
    """One terminal line that makes bash run `command` verbatim: `eval $'...'` with every control byte escaped."""
    out = []
    for byte in command.encode("utf-8", errors="surrogateescape"):
        if byte in (0x5C, 0x27):  # backslash, single quote
            out.append(b"\\" + bytes([byte]))
        elif byte < 0x20 or byte == 0x7F:
            out.append(b"\\x%02x" % byte)
        else:
            out.append(bytes([byte]))
    return b"eval $'" + b"".join(out) + b"'"


@dataclass
class Launch:
    """What a backend hands a session or a one-shot run: the command line that starts bash in the sandbox."""

    argv: list[str]
    env: dict[str, str]  # the host-side launcher's whole environment: fixed by the backend, never a client's
    sandbox_env: dict[str, str] = field(default_factory=dict)  # exported by the sandboxed bash itself
    # A directory inside the sandbox whose *.sh the bash sources before it exports `sandbox_env`: an image's
    # /.singularity.d/env, which Apptainer's own action scripts source, so that an image means the same here.
    env_scripts: str | None = None
    ulimits: list[str] = field(default_factory=list)  # `ulimit -HS` arguments the shell applies first
    # True when the launched process is a pid-namespace holder (bwrap): killing its child, the namespace's
    # init, makes the kernel kill everything inside, and the holder exits only once all of it is gone.
    pid_namespace: bool = False


class SessionError(ApiError):
    """A session could not start, or is busy; `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def shell_word(text: str) -> str:
    """`text` as one bash word, verbatim: $'...' with every control byte, quote and backslash escaped."""
    return encode_command(text).decode("utf-8", errors="surrogateescape").removeprefix("eval ")


def preamble(launch: Launch) -> str:
    """What the sandboxed bash runs before anything else: its limits, then its environment."""
    limits = f"ulimit -HS {' '.join(launch.ulimits)} || exit 97; " if launch.ulimits else ""
    exports = "".join(f"export {name}={shell_word(value)}; " for name, value in launch.sandbox_env.items())
    if launch.env_scripts:
        where = shell_word(launch.env_scripts)
        scripts = f'for __prorl_f in {where}/*.sh; do [ -f "$__prorl_f" ] && . "$__prorl_f"; done'
        exports = f"{scripts}; unset __prorl_f; {exports}"
    return limits + exports


class ShellSession:
    """One bash process in a PTY. Commands run one at a time; `busy` while one is in flight."""

    def __init__(
        self, name: str, launch: Launch, default_output_limit: int, forwards: list[PortForward] | None = None
    ) -> None:
        self.name = name
        self._launch = launch
        self._forwards = Forwards(forwards or [])
        self._default_limit = default_output_limit
        self._fd: int | None = None  # the terminal's master side; None before start and after close
        self.pid = 0
        self.started_at = 0  # kernel start time of `pid`, for crash recovery
        self._loop = asyncio.get_event_loop()
        self._out = OutputBuffer(default_output_limit)
        self._reading = False  # whether the terminal's fd is registered with the event loop
        self._carry = b""
        self._prefix = b""  # marker prefix awaited, empty when idle
        self._done: asyncio.Future[tuple[int, str]] | None = None
        self._exited: asyncio.Task[int] | None = None
        self._interrupted = False
        self._ended: ExecStatus | None = None  # how the last command ended, once a reply has said so
        self._command_started = 0.0
        self._command_ended = 0.0  # when the marker of the command came; 0 while it runs
        self.cwd = ""
        self.last_used = time.monotonic()

    # -- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        launch = self._launch
        # No prompt before the set-up line has run (it would lead the first command's output).
        env = {**launch.env, "TERM": "dumb", "PS1": "", "PS2": ""}
        try:
            self.pid, self._fd = spawn.on_terminal(launch.argv, env)
        except OSError as exc:
            raise SessionError(f"cannot start shell: {exc}", status=500) from exc
        self.started_at = procs.start_time(self.pid) or 0
        self._exited = self._loop.create_task(procs.wait_exit(self.pid))
        nonce = self._arm(self._default_limit)
        setup = _SETUP_LINE.replace("{nonce}", nonce)
        await self._write((preamble(launch) + setup).encode("utf-8", errors="surrogateescape"))
        result = await self._wait(START_TIMEOUT_S)
        if result is None or self.dead:
            output, _ = self._out.take()
            await self.close()
            raise SessionError(f"shell did not start: {output.strip() or 'no output'}", status=500)
        self.cwd = result[1]
        self._done = None  # the set-up line's marker is no command's: the output API reports no exit code yet
        if self._forwards.specs:
            await self._open_forwards()

    async def _open_forwards(self) -> None:
        """The spec's forwards, in the network namespace of the session's init (the shell is up, so it exists),
        before the first command can look for them."""
        inits = procs.children(self.pid) if self._launch.pid_namespace else []
        try:
            if len(inits) != 1:
                raise ForwardError("the sandbox's namespace init was not found")
            await self._forwards.open(inits[0])
        except BaseException as exc:  # the shell runs already: whatever happened, it must not be left running
            await asyncio.shield(self.close())
            if isinstance(exc, ForwardError):
                raise SessionError(f"shell did not start: {exc}", status=500) from None
            raise

    @property
    def dead(self) -> bool:
        return self._exited is None or self._exited.done()

    @property
    def busy(self) -> bool:
        return bool(self._prefix)

    async def close(self) -> None:
        """Kill every process of the session (its whole Unix session) and wait until the shell is reaped."""
        await self._forwards.close()
        if self._fd is None:
            return
        self._stop_reading()
        if not self.dead:
            inits = procs.children(self.pid) if self._launch.pid_namespace else []
            for pid in inits:
                procs.kill(pid)
            if not inits:
                procs.kill_session(self.pid)
            await asyncio.shield(self._exited)
        os.close(self._fd)
        self._fd = None
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- commands ---------------------------------------------------------------------------------------
    async def run(self, command: str, timeout: float, max_output: int | None, keep: bool) -> ExecResult:
        if self.busy:
            raise SessionError(
                f"session {self.name!r} is still running a command left running by on_timeout=keep; "
                "send it input, read its output, or delete the session"
            )
        self._command_started = time.monotonic()
        self._interrupted = False
        # What background jobs printed since the last command stays in the buffer and leads this output.
        nonce = self._arm(max_output or self._default_limit, keep_buffer=True)
        deadline = time.monotonic() + timeout
        # The shell stopped reading when the line cannot be written in time: it cannot be used any more.
        if not await self._write_within(command_line(nonce, command), timeout):
            procs.kill_session(self.pid)
            return await self._died("timeout")
        return await self._finish(max(deadline - time.monotonic(), 0.0), keep)

    async def send(self, data: bytes, timeout: float) -> ExecResult:
        """Input for a command left running; returns what it printed until it finished or `timeout` passed."""
        if not self.busy:
            raise SessionError(f"session {self.name!r} has no running command to send input to")
        if b"\x03" in data:
            self._interrupted = True
        deadline = time.monotonic() + timeout
        if not await self._write_within(data, timeout):  # the command does not read its input
            text, truncated = self._out.take()
            text += "\n[the input was not all delivered: the command did not read it in time]\n"
            return self._result(text, truncated, None, "timeout")
        return await self._finish(max(deadline - time.monotonic(), 0.0), keep=True)

    def read_output(self) -> ExecResult:
        """What a command left running printed since the last read, without waiting. Once it has finished, its
        exit code and the shell's cwd, as its marker gave them (every read until the next command says so)."""
        text, truncated = self._out.take()
        done = self._done.result() if not self.busy and self._done is not None and self._done.done() else None
        if done is None:
            return self._result(text, truncated, None, "running" if self.busy else "completed")
        exit_code, self.cwd = done
        status = self._ended or ("interrupted" if self._interrupted else "completed")
        return self._result(text, truncated, exit_code, status)

    async def _finish(self, timeout: float, keep: bool) -> ExecResult:
        done = await self._wait(timeout)
        if done is not None:
            return self._completed(done, "interrupted" if self._interrupted else "completed")
        if self.dead:
            return await self._died("dead")
        if keep:
            text, truncated = self._out.take()
            return self._result(text, truncated, None, "timeout")
        done = await self._stop_command()
        if done is not None:
            return self._completed(done, "timeout")
        return await self._died("timeout")

    async def _stop_command(self) -> tuple[int, str] | None:
        """Interrupt the command; if it ignores that, kill its process group; if bash itself hangs, kill it.

        Returns the marker once the shell is back at its prompt, or None after killing the shell.
        """
        await self._write(b"\x03")
        if (done := await self._wait(INTERRUPT_GRACE_S)) is not None:
            return done
        for _ in range(3):  # a command list runs on after one of its commands is killed: kill each in turn
            try:
                foreground = os.tcgetpgrp(self._fd)
                if foreground <= 0 or foreground == self.pid:
                    break
                os.killpg(foreground, signal.SIGKILL)
            except OSError:
                break
            if (done := await self._wait(KILL_GRACE_S)) is not None:
                return done
        procs.kill_session(self.pid)
        return None

    def _completed(self, done: tuple[int, str], status: ExecStatus) -> ExecResult:
        exit_code, self.cwd = done
        self._ended = status
        text, truncated = self._out.take()
        return self._result(text, truncated, exit_code, status)

    async def _died(self, status: ExecStatus) -> ExecResult:
        """The shell exited (or was killed): collect its last output and exit code, and release it."""
        self._drain()
        self._out.feed(self._carry)  # no marker will come: what was held back is output
        self._carry = b""
        exit_code = await asyncio.shield(self._exited)
        text, truncated = self._out.take()
        await self.close()
        return self._result(text, truncated, exit_code, status)

    def _result(self, text: str, truncated: bool, exit_code: int | None, status: ExecStatus) -> ExecResult:
        self.last_used = time.monotonic()
        return ExecResult(
            output=text,
            exit_code=exit_code,
            status=status,
            truncated=truncated,
            duration_s=round((self._command_ended or time.monotonic()) - self._command_started, 6)
            if self._command_started
            else 0.0,
            cwd=self.cwd,
        )

    # -- the reader -------------------------------------------------------------------------------------
    def _arm(self, limit: int, keep_buffer: bool = False) -> str:
        nonce = str(secrets.randbelow(9 * 10**17) + 10**17)  # 18 digits: within bash's 64-bit arithmetic
        self._ended = None
        self._command_ended = 0.0
        self._prefix = MARKER_START + nonce.encode() + b":"
        self._done = self._loop.create_future()
        if not keep_buffer:
            self._out = OutputBuffer(limit)
        elif limit != self._out.limit:
            pending, _ = self._out.take()
            self._out = OutputBuffer(limit)
            self._out.feed(pending.encode())
        self._carry = b""
        if not self._reading:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True
        return nonce

    def _disarm(self) -> None:
        # The reader stays registered (two epoll calls per command saved); `_on_readable` pauses it only if
        # output arrives while no command is in flight.
        self._prefix = b""

    def _stop_reading(self) -> None:
        if self._fd is not None and self._reading:
            self._loop.remove_reader(self._fd)
        self._reading = False

    async def _wait(self, timeout: float) -> tuple[int, str] | None:
        """Wait for the armed marker, the shell's death, or the timeout; None unless the marker came."""
        done = self._done
        waiters = {done, self._exited}
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if done.done() and done.result() is not None:
            return done.result()
        if self.dead:  # output may still sit in the terminal after the shell exited
            self._drain()
            if done.done() and done.result() is not None:
                return done.result()
        return None

    def _drain(self) -> None:
        if self._fd is None:
            return
        while self._read_once():
            pass

    def _on_readable(self) -> None:
        if not self._prefix:  # idle: leave the output in the terminal (a flooding background job blocks)
            self._stop_reading()
            return
        self._read_once()

    def _read_once(self) -> bool:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return False
        except OSError:  # EIO: every process holding the terminal has exited
            data = b""
        if not data:
            self._stop_reading()
            return False
        self._scan(data)
        return True

    def _scan(self, data: bytes) -> None:
        if not self._prefix:
            self._out.feed(data)
            return
        buf = self._carry + data
        at = buf.find(self._prefix)
        if at < 0:  # hold back only a tail that could be the start of the marker
            tail = buf.rfind(MARKER_START, max(0, len(buf) - len(self._prefix) + 1))
            split = tail if tail >= 0 and self._prefix.startswith(buf[tail:]) else len(buf)
            self._out.feed(buf[:split])
            self._carry = buf[split:]
            return
        end = buf.find(MARKER_START, at + len(self._prefix))
        if end < 0:
            self._out.feed(buf[:at])
            self._carry = buf[at:]
            return
        self._out.feed(buf[:at])
        code, _, cwd = buf[at + len(self._prefix) : end].partition(b":")
        rest = buf[end + 1 :]
        self._out.feed(rest[1:] if rest.startswith(b"\n") else rest)
        self._carry = b""
        self._disarm()
        self._command_ended = time.monotonic()
        self._done.set_result((int(code or b"0"), cwd.decode("utf-8", errors="replace")))

    async def _write_within(self, data: bytes, timeout: float) -> bool:
        """Write `data`, giving up after `timeout` (a program that does not read lets the terminal fill up);
        False when it gave up, with part of the data possibly written."""
        try:
            async with asyncio.timeout(timeout):
                await self._write(data)
        except TimeoutError:
            return False
        return True

    async def _write(self, data: bytes) -> None:
        """Write everything, waiting (not spinning) whenever the terminal's input queue is full; stop when the
        shell is gone (the caller sees that through `dead`)."""
        with contextlib.suppress(OSError):
            await fdio.write_all(self._fd, data, unless=self._exited)
