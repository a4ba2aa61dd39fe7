"""One server process of the stack, which cannot outlive the actor that started it.

An actor of the stack may end any way: stopped, killed by `ray.kill`, or with its raylet when the node goes.
Its server must end with it, so the process is started with PR_SET_PDEATHSIG=SIGKILL (the kernel kills it
when its parent dies) and as the leader of its own process group, so that stopping it reaches whatever it
started too, by the pid we hold, never by a name. Waiting for it polls a readiness check with a deadline; a
part that exits or never answers fails with its log's tail, naming the part.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from server_kit.errors import ProrlError

PR_SET_PDEATHSIG = 1
# free_port's picks: above the ports Ray's workers take by default (10002-19999), below the ephemeral range.
FREE_PORTS_FROM = 20_000
_HANDED_OUT: set[int] = set()  # free_port's picks in this process, never given twice
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
LOG_TAIL_CHARS = 3000


class PartFailed(ProrlError, RuntimeError):
    """A part did not start, or did not answer in time; the message names it and quotes its log."""


def _die_with(parent: int) -> Callable[[], None]:
    """The child's first act after fork: die when `parent` does (and at once, if it already has)."""
    prctl = _LIBC.prctl if _LIBC is not None else None  # resolved before the fork, called after it

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def listening_socket(ip: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `ip`:`port` (0: a port the kernel picks), to hand to a server of this project
    (`--listen-fd`): its port is held from here on, so no other process can take it before the server starts.
    SO_REUSEADDR (Python sets it): a server restarted on its old port binds it past the old one's TIME_WAITs."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    return socket.create_server((ip, port), family=family)  # the server sets its own backlog


def free_port(ip: str = "127.0.0.1") -> int:
    """A port free on `ip` now, for a server that cannot be handed a socket (Redis, vLLM) and binds it a moment
    later. Picked below the kernel's ephemeral range: a port the kernel hands out (bind to port 0) is one that
    any outgoing connection on the machine may take in that moment, and a test run makes thousands."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    low, _ = _ephemeral_range()
    candidates = range(FREE_PORTS_FROM, low) if low - FREE_PORTS_FROM >= 1000 else range(0)
    for port in random.sample(candidates, min(64, len(candidates))):
        if port in _HANDED_OUT:  # free now, but another server this process started may bind it any moment
            continue
        with socket.socket(family) as s:
            try:
                s.bind((ip, port))
            except OSError:  # in use, or in TIME_WAIT
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(family) as s:  # no room below the ephemeral range (or all taken): the kernel's pick
        s.bind((ip, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def fresh_dir(prefix: str, mode: int = 0o700) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(mode)
    return path


def http_ready(url: str) -> Callable[[], bool]:
    def check() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=2.0).status_code == 200
        return False

    return check


def redis_ready(ip: str, port: int, password: str) -> Callable[[], bool]:
    """AUTH then PING in Redis's own protocol: no client library needed on the node."""
    words = (("AUTH", password), ("PING",))
    request = b"".join(
        f"*{len(cmd)}\r\n".encode() + b"".join(f"${len(w.encode())}\r\n{w}\r\n".encode() for w in cmd) for cmd in words
    )

    def check() -> bool:
        try:
            with socket.create_connection((ip, port), timeout=2.0) as s:
                s.sendall(request)
                answer = b""
                while b"+PONG" not in answer and not answer.startswith(b"-"):
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    answer += chunk
                return b"+PONG" in answer
        except OSError:
            return False

    return check


class ServerProcess:
    """`argv` run as its own process group, its output in `log`; started, awaited and stopped by its pid.
    `env` is added to this process's environment and `stdin_text` written to its standard input: the ways a
    secret reaches a server without a command line, which every user of the node can read."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        stdin_text: str | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.env = dict(env or {})
        self.stdin_text = stdin_text
        self.listener = listener  # handed to the server (its --listen-fd), and closed here once it has it
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> ServerProcess:
        try:
            with open(self.log, "ab") as out:
                self.process = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL if self.stdin_text is None else subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env},
                    start_new_session=True,  # its own session and process group, whose id is its pid
                    preexec_fn=_die_with(os.getpid()),
                    pass_fds=(self.listener.fileno(),) if self.listener else (),
                )
        finally:
            if self.listener is not None:
                self.listener.close()  # the server holds its own copy
        if self.stdin_text is not None:
            with self.process.stdin:  # closed: the server reads to its end
                self.process.stdin.write(self.stdin_text.encode())
        return self

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return text[-chars:] or "(the log is empty)"

    def wait_ready(self, ready: Callable[[], bool], what: str, timeout_s: float, where: str = "") -> None:
        """Poll `ready` until it holds; fail when the process exits or `timeout_s` passes (then kill it)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.running:
                raise PartFailed(self._failure(f"exited with status {self.returncode} before {what}", where))
            if time.monotonic() > deadline:
                self.kill()
                raise PartFailed(self._failure(f"did not answer {what} within {timeout_s:g} s", where))
            time.sleep(0.2)  # polling a starting server

    def _failure(self, what: str, where: str) -> str:
        return f"{self.name}{where} {what}; its log {self.log} ends with:\n{self.log_tail()}"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the group, a wait, then SIGKILL to the group; returns the exit status."""
        if self.process is None:
            return None
        if self.running:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # then SIGKILL
                self.process.wait(timeout=timeout_s)
        self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to the group: the leader and whatever of its group outlived it."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


def remove_dirs(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
