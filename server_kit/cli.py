"""The start-up conventions of both servers' command lines: a wrong flag or a failure to start is one line on
stderr naming what to fix, with a non-zero exit status; a traceback only under --debug or for a crash after the
server said it listens."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn

from .errors import ProrlError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class StartupError(ProrlError, RuntimeError):
    """The server cannot start, for a reason its operator can fix (a port in use, a state dir it cannot use): the
    message names the problem and the flag or step that fixes it, and the server's command prints it as one
    line, without a traceback (--debug shows one)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a wrong command line is one line on stderr (and exit status 2), not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def fail(prog: str, message: str, status: int = 2) -> int:
    """A start-up failure of command `prog` as one line on stderr; the exit status to return."""
    print(f"{prog}: {message}", file=sys.stderr)
    return status


class Readiness:
    """Passed to `serve` as its `ready`: whether the server has said it listens. What fails before is a failure to
    start, told in one line; what fails after (hours into serving, perhaps) is a crash, whose traceback is kept."""

    def __init__(self) -> None:
        self.ready = False

    def __call__(self) -> None:
        self.ready = True


def stopped_by(prog: str, exc: Exception, readiness: Readiness, debug: bool, line: str) -> int:
    """Report the failure `exc` that ended a server, `line` saying it in one line; the exit status (1). The
    traceback goes first to stderr (whatever --log-level says) for a crash after start-up, except a StartupError
    (a check that runs late), and for every failure under --debug."""
    if debug or (readiness.ready and not isinstance(exc, StartupError)):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: {line}", file=sys.stderr)
    return 1
