"""One Redis client as the Redis-backed storage (the buffer, the prompt queue) uses it: retries, timeouts, and
redis-py's errors turned into the buffer's, with the URL (password hidden) in the message."""

from __future__ import annotations

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

    def check_open(self) -> None:
        if self.closed:
            raise BufferClosed(f"the connection to Redis at {self.where} is closed")

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Turn redis-py's errors into the buffer's: a clear message, no traceback from inside redis-py."""
        self.check_open()
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
