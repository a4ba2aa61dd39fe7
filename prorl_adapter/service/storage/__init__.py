"""Where the service keeps its state, chosen by one URL: the experience buffer, the queue of upcoming prompts
and what replicas share (jobs, runtimes, the policy version), all in this process (`memory://`, the default)
or all in Redis (`redis://`, `rediss://`, `unix://`), where they outlive the service and the trainer and every
replica given the same URL shares them.

The Redis parts are imported only when asked for: the `redis` package is an optional extra.
"""

from __future__ import annotations

from typing import Any

from .buffer import ExperienceBuffer, ExperienceBufferError
from .coordination import Coordination, MemoryCoordination
from .memory_buffer import MemoryBuffer
from .prompts import MemoryPromptQueue, PromptQueue

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _check_url(url: str) -> None:
    if url != "memory://" and not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"unknown experience buffer URL {url!r}: use memory://, redis://host:port/db or unix://path")


def create_buffer(url: str | None = None, consumer: str | None = None, **kwargs: Any) -> ExperienceBuffer:
    """A buffer from a URL: None or `memory://` -> `MemoryBuffer(**kwargs)`; a Redis URL -> `RedisBuffer(url,
    consumer=consumer, **kwargs)` (needs the `redis` extra). `consumer` names the taker in a shared buffer (a
    replica of the service: its id, so that its next incarnation finds what it had taken)."""
    url = url or "memory://"
    _check_url(url)
    if url == "memory://":
        return MemoryBuffer(**kwargs)
    try:
        from .redis_buffer import RedisBuffer
    except ImportError as exc:  # the redis package is an optional extra
        raise ExperienceBufferError(f"cannot open a Redis buffer: {exc}") from None
    return RedisBuffer(url, consumer=consumer, **kwargs)


def create_prompt_queue(url: str | None = None, replica: str = "prorl-rollout") -> PromptQueue:
    """The prompt queue beside the buffer of the same URL; `replica` owns what it admits."""
    url = url or "memory://"
    _check_url(url)
    if url == "memory://":
        return MemoryPromptQueue()
    from .redis_prompts import RedisPromptQueue

    return RedisPromptQueue(url, replica)


def create_coordination(url: str | None, replica: str) -> Coordination:
    """What the replicas of the service share, beside the buffer of the same URL."""
    url = url or "memory://"
    _check_url(url)
    if url == "memory://":
        return MemoryCoordination(replica)
    from .redis_coordination import RedisCoordination

    return RedisCoordination(url, replica)
