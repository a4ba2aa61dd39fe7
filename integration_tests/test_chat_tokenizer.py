"""Where the service's tokenizer work runs (the tiny model's real tokenizer): small work on the event loop, large
work on the tokenizer's thread, and never both at once, as the tokenizer is not safe to share between threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.service.chat import INLINE_SIZE, ChatTokenizer, text_size


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    localstack.build_tiny_model()
    return ChatTokenizer(str(localstack.TINY_MODEL))


def where(chat: ChatTokenizer, text: str) -> tuple[str, list[int]]:
    """The thread that did the work, and its ids."""
    return threading.current_thread().name, chat.encode(text)


async def test_small_work_runs_on_the_loop_and_large_or_unsized_work_on_the_thread(chat):
    loop_thread = threading.current_thread().name
    text = "ls -la /workspace"
    small, ids = await chat.off_loop(where, chat, text, size=len(text))
    assert small == loop_thread
    large, same_ids = await chat.off_loop(where, chat, text, size=INLINE_SIZE + 1)
    assert large.startswith("tokenizer") and same_ids == ids
    unsized, _ = await chat.off_loop(where, chat, text)
    assert unsized.startswith("tokenizer")


async def test_small_work_waits_for_the_thread_while_it_holds_the_tokenizer(chat):
    entered, release = threading.Event(), threading.Event()

    def long_work() -> str:
        entered.set()
        release.wait(30)
        return threading.current_thread().name

    running = asyncio.ensure_future(chat.off_loop(long_work, size=INLINE_SIZE + 1))
    assert await asyncio.to_thread(entered.wait, 30)
    small = asyncio.ensure_future(chat.off_loop(where, chat, "echo hi", size=7))
    await asyncio.sleep(0)  # it would have run here, had it not found the tokenizer busy
    assert not small.done()
    release.set()
    assert (await running).startswith("tokenizer")
    thread, ids = await small
    assert thread.startswith("tokenizer") and ids == chat.encode("echo hi")


def test_the_size_of_messages_counts_their_text_and_the_tool_schemas():
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}, {"role": "assistant"}]
    assert text_size(messages) == 5
    assert text_size(messages, [{"name": "bash"}]) == 5 + len('[{"name": "bash"}]')
