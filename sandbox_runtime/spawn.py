"""Starting a sandbox's launcher (setpriv, bwrap, apptainer) without forking the server.

ptyprocess and subprocess with a `preexec_fn` fork the whole server and run Python in the child until it execs.
With the server's heap that took 5-9 ms per process here, the event loop blocked throughout: copy-on-write
faults for every page the child touched, then the teardown of the copy at exec. `os.posix_spawn` is glibc's
clone(CLONE_VM | CLONE_VFORK): nothing is copied, no Python runs in the child, and the parent waits only until
the exec (measured here, bwrap + bash to its first marker: 22.8 ms through ptyprocess, 14.1 ms so). uvloop's
subprocesses were no alternative either: their children kept the ends of their own stdio sockets open beyond
0-2 (integration_tests/test_isolation.py checks what a sandbox holds).

What every child gets:
- a new session (setsid), so that killing its session or its namespace's init ends all it started;
- its stdin, stdout and stderr, and no other descriptor of the server's: every descriptor Python opens is
  close-on-exec (PEP 446), these pipes and terminals included, and only the three the file actions make are not.
  What the server inherited is another matter: whoever started it may have left descriptors open without
  close-on-exec (a shell's `exec 7<file`, a `pass_fds`), and posix_spawn passes those on to bwrap, which passes
  them into the sandbox. The server marks every such descriptor close-on-exec at start-up, before anything else
  runs (`seal_once`, from cli.main), and the first spawn does it again where no start-up did (code that embeds the
  runtime); once is enough, since nothing of the server's opens an inheritable one later. (Python's posix_spawn
  has no closefrom action, and a close action per descriptor at every spawn would cost a scan of them all each
  time.)
- signals at their default dispositions and none blocked. Ignored dispositions survive exec: Python ignores
  SIGPIPE and SIGXFSZ (`yes | head -n1` would run forever in a sandbox, a file-size limit would give EFBIG
  instead of killing the writer), and `nohup` ignores SIGHUP.

The caller reaps the pid (procs.wait_exit) and closes the descriptors it gets back.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import struct
import termios

DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
ROWS, COLUMNS = 24, 80  # ptyprocess's default terminal size


_sealed = False


def seal_inherited() -> list[int]:
    """Mark every descriptor above 2 that a child would inherit close-on-exec; returns those it marked."""
    marked = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                os.set_inheritable(fd, False)
                marked.append(fd)
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return marked


def seal_once() -> None:
    """`seal_inherited`, the first time only: at start-up, and as a guard at each spawn. Both run on the event
    loop's thread (or before it), so the flag needs no lock."""
    global _sealed
    if not _sealed:
        seal_inherited()
        _sealed = True


def _spawn(argv: list[str], env: dict[str, str], file_actions: list[tuple]) -> int:
    seal_once()
    program = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if program is None:
        raise FileNotFoundError(f"{argv[0]}: not found on the launcher's PATH")
    return os.posix_spawn(
        program, argv, env, file_actions=file_actions, setsid=True, setsigdef=DEFAULT_SIGNALS, setsigmask=()
    )


def _raw(fd: int) -> None:
    """Echo off, raw output (no \\n -> \\r\\n), non-canonical input (no 4 KB line cap) with the signal keys on.
    Set from the parent: terminal modes belong to the terminal, not to a process."""
    attrs = termios.tcgetattr(fd)
    attrs[1] &= ~termios.ONLCR
    attrs[3] &= ~(termios.ICANON | termios.ECHO)
    attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))


def on_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Start `argv` (its program looked up on `env`'s PATH) on a new terminal, raw, which becomes its controlling
    terminal (job control and Ctrl-C need one): (pid, the terminal's master fd, non-blocking). The child opens
    the terminal by name after its setsid (glibc runs the file actions after it), and a session leader with no
    controlling terminal that opens one acquires it. OSError when the program cannot start."""
    master, slave = os.openpty()
    try:
        _raw(slave)
        pid = _spawn(
            argv,
            env,
            [
                (os.POSIX_SPAWN_OPEN, 0, os.ttyname(slave), os.O_RDWR, 0),
                (os.POSIX_SPAWN_DUP2, 0, 1),
                (os.POSIX_SPAWN_DUP2, 0, 2),
            ],
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)  # posix_spawn returns after the child's exec: it has its own
    os.set_blocking(master, False)
    return pid, master


def with_pipes(argv: list[str], env: dict[str, str]) -> tuple[int, int, int]:
    """Start `argv` with its stdin on one pipe and its stdout and stderr on another: (pid, the write end of its
    stdin, the read end of its output), both non-blocking. OSError when the program cannot start."""
    stdin_r, stdin_w = os.pipe()
    output_r, output_w = os.pipe()
    try:
        pid = _spawn(
            argv,
            env,
            [(os.POSIX_SPAWN_DUP2, stdin_r, 0), (os.POSIX_SPAWN_DUP2, output_w, 1), (os.POSIX_SPAWN_DUP2, output_w, 2)],
        )
    except BaseException:
        os.close(stdin_w)
        os.close(output_r)
        raise
    finally:
        os.close(stdin_r)
        os.close(output_w)
    os.set_blocking(stdin_w, False)
    os.set_blocking(output_r, False)
    return pid, stdin_w, output_r
