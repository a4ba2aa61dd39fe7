"""One Redis client as the Redis-backed storage (the buffer, the prompt queue) uses it: retries, timeouts, and
redis-py's errors turned into the buffer's, with the URL (password hidden) in the message."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

try:
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"the Redis storage needs the redis package (>= 5): pip install 'prorl-adapter[redis]' ({exc})"
    ) from None

from .buffer import BufferClosed, BufferUnavailable, ExperienceBufferError


def redact(url: str) -> str:
    """The URL with its password hidden, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def keeping_cancellation() -> Iterator[None]:
    """Raise CancelledError at the end of the block if the task was cancelled during it and the block ended
    otherwise: the cancellation was swallowed.

    redis-py sends each command under `asyncio.wait_for` when a socket timeout is set, and on Python 3.11
    `wait_for` returns the result instead of raising when the cancellation arrives just as the send completes
    (CPython gh-86296, fixed in 3.12). With a 5 s socket timeout that happens to most cancellations of a task
    that talks to Redis in a loop, and such a task never ends: `Producer.stop()` waited for it forever. The
    task's pending cancel requests (`Task.cancelling()`) still count the swallowed one, so comparing them before
    and after tells a swallowed cancellation apart from one delivered before the block (a clean-up running in
    an `except CancelledError:` is left to finish)."""
    task = asyncio.current_task()
    pending = task.cancelling() if task is not None else 0
    try:
        yield
    finally:  # also when the block raised something else after the swallowed cancellation: the task is ending
        if task is not None and task.cancelling() > pending:
            raise asyncio.CancelledError("cancelled during a Redis call (redis-py swallowed the cancellation)")


class RedisConnection:
    """One Redis client as this project's Redis-backed parts use it (the buffer, the prompt queue): a command is
    retried after a connection error with a short backoff, a silent Redis counts as unavailable after
    `socket_timeout`, and redis-py's errors become the buffer's, with the URL (password hidden) and the
    operation that failed in the message."""

    def __init__(self, url: str, *, socket_timeout: float = 5.0, retries: int = 2, **redis_kwargs: Any) -> None:
        self.where = redact(url)
        self.redis = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            **redis_kwargs,
        )
        self.closed = False
        where = self.redis.connection_pool.connection_kwargs
        # Which server and database the keys live on (not the URL's spelling): what fences compare.
        address = f"unix:{where['path']}" if "path" in where else f"{where.get('host')}:{where.get('port')}"
        self.server = f"{address}/{where.get('db', 0)}"

    def check_open(self) -> None:
        if self.closed:
            raise BufferClosed(f"the connection to Redis at {self.where} is closed")

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Turn redis-py's errors into the buffer's: a clear message, no traceback from inside redis-py. A
        cancellation that redis-py swallowed during the block is raised at its end (`keeping_cancellation`)."""
        self.check_open()
        with keeping_cancellation():
            try:
                yield
            except (TimeoutError, redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
                self.check_open()  # closed while waiting: that, not the broken connection, is the news
                raise BufferUnavailable(
                    f"Redis at {self.where} is unavailable: {what} failed ({type(exc).__name__}: {exc})"
                ) from None
            except redis_errors.ResponseError as exc:
                raise ExperienceBufferError(f"Redis at {self.where} refused {what}: {exc}") from None

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            closer = getattr(self.redis, "aclose", None) or self.redis.close
            await closer()
