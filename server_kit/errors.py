"""The root of the project's exceptions, and the two kinds a server's error middleware tells apart.

- `ApiError`: what this server answers about the request it serves (`status`: 4xx for the caller's mistakes,
  5xx for its own side); the middleware answers `{"error", "status"}` with it.
- `DownstreamError`: another server's answer to a call this process made, or no answer at all. Its `status`
  (where there is one) is that server's, never this server's answer: a handler that lets one escape answers 502,
  or 503 where the other server could not be reached or did not answer in time, or no LLM server was healthy
  (`answer_status`). A runtime's 404 for a sandbox is not the rollout service's 404 for its caller's URL.

Anything else that escapes a handler is a bug: 500, logged with its traceback.
"""

from __future__ import annotations

from typing import ClassVar


class ProrlError(Exception):
    """The root of every exception class the project defines (Python's own, such as a ValueError for a bad
    argument, are raised as they are)."""


class ApiError(ProrlError):
    """A server's answer to the request it serves: `status`, the message the caller reads, and where a protocol's
    clients act on one, a machine-readable `code` (the gateway's `context_length_exceeded`)."""

    status: int = 500
    code: str | None = None


class DownstreamError(ProrlError):
    """A call to another server failed; `answer_status` is what a server answers its own caller then."""

    answer_status: ClassVar[int] = 502
