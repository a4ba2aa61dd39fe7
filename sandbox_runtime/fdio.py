"""Reading and writing a spawned launcher's non-blocking descriptors (spawn.py) from the event loop: every wait
is on the loop's readiness callbacks, none spins.

asyncio's pipe transports would serve the one-shot runs' pipes, but not the terminal a session's shell is on
(its master reports EIO when the shell goes, and a write must stop waiting when it does): one helper for both.
"""

from __future__ import annotations

import asyncio
import os


async def ready(fd: int, *, writable: bool = False, unless: asyncio.Future | None = None) -> None:
    """Return once `fd` can be read (or written) without blocking, or once `unless` is done."""
    loop = asyncio.get_running_loop()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    became_ready = loop.create_future()
    add(fd, _resolve, became_ready)
    try:
        waits = {became_ready} if unless is None else {became_ready, unless}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        remove(fd)


async def write_all(fd: int, data: bytes, *, unless: asyncio.Future | None = None) -> bool:
    """Write all of `data` to `fd`, waiting whenever its reader's queue is full. False when it stopped because
    `unless` was done first (its reader is gone), part of `data` possibly written. A reader that closed its end
    of a pipe: BrokenPipeError."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await ready(fd, writable=True, unless=unless)
            if unless is not None and unless.done():
                return False
    return True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
