"""Where decoupled mode keeps its state, chosen by one URL: the experience buffer and the queue of upcoming
prompts, both in this process (`memory://`, the default) or both in Redis (`redis://`, `rediss://`,
`unix://`), where they outlive the service and the trainer.

The Redis parts are imported only when asked for: the `redis` package is an optional extra.
"""

from __future__ import annotations

from typing import Any

from .buffer import ExperienceBuffer, ExperienceBufferError
from .memory_buffer import MemoryBuffer
from .prompts import MemoryPromptQueue, PromptQueue

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _check_url(url: str) -> None:
    if url != "memory://" and not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"unknown experience buffer URL {url!r}: use memory://, redis://host:port/db or unix://path")


def create_buffer(url: str | None = None, **kwargs: Any) -> ExperienceBuffer:
    """A buffer from a URL: None or `memory://` -> `MemoryBuffer(**kwargs)`; a Redis URL -> `RedisBuffer(url,
    **kwargs)` (needs the `redis` extra)."""
    url = url or "memory://"
    _check_url(url)
    if url == "memory://":
        return MemoryBuffer(**kwargs)
    try:
        from .redis_buffer import RedisBuffer
    except ImportError as exc:  # the redis package is an optional extra
        raise ExperienceBufferError(f"cannot open a Redis buffer: {exc}") from None
    return RedisBuffer(url, **kwargs)


def create_prompt_queue(url: str | None = None) -> PromptQueue:
    """The prompt queue beside the buffer of the same URL."""
    url = url or "memory://"
    _check_url(url)
    if url == "memory://":
        return MemoryPromptQueue()
    from .redis_prompts import RedisPromptQueue

    return RedisPromptQueue(url)
