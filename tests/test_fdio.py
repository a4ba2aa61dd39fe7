"""sandbox_runtime/fdio.py on real pipes: a write larger than the pipe's buffer goes through as its reader takes
it, stops when told its reader is gone, and a closed reader is an error, not a hang."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from sandbox_runtime import fdio

BIG = 1 << 20  # many times a pipe's 64 KiB buffer


@pytest.fixture
def pipe():
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    yield read_fd, write_fd
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):  # the test closed it
            os.close(fd)


async def drain(fd: int, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        await fdio.ready(fd)
        received += os.read(fd, 65536)
    return bytes(received)


async def test_a_write_larger_than_the_pipe_arrives_whole_as_its_reader_takes_it(pipe):
    read_fd, write_fd = pipe
    data = os.urandom(BIG)
    reader = asyncio.ensure_future(drain(read_fd, BIG))
    assert await asyncio.wait_for(fdio.write_all(write_fd, data), 30) is True
    assert await asyncio.wait_for(reader, 30) == data


async def test_a_write_nobody_reads_stops_when_its_reader_is_gone(pipe):
    _, write_fd = pipe
    gone = asyncio.get_running_loop().create_future()
    writer = asyncio.ensure_future(fdio.write_all(write_fd, os.urandom(BIG), unless=gone))
    await asyncio.sleep(0)  # one step: it fills the pipe and waits for room
    assert not writer.done()  # nobody reads: it waits (not spinning, or this step would never have ended)
    gone.set_result(0)
    assert await asyncio.wait_for(writer, 5) is False


async def test_a_write_to_a_closed_reader_is_a_broken_pipe(pipe):
    read_fd, write_fd = pipe
    os.close(read_fd)
    with pytest.raises(BrokenPipeError):
        await asyncio.wait_for(fdio.write_all(write_fd, b"x" * BIG), 5)


async def test_ready_waits_for_data_and_unregisters_its_reader(pipe):
    read_fd, write_fd = pipe
    waiting = asyncio.ensure_future(fdio.ready(read_fd))
    await asyncio.sleep(0)  # one step: it registers its reader and waits
    assert not waiting.done()  # nothing to read yet
    os.write(write_fd, b"hello")
    await asyncio.wait_for(waiting, 5)
    assert not asyncio.get_running_loop().remove_reader(read_fd)  # no longer watched
