"""A malformed 200 from an LLM server is that server's failure: the pool counts it, fails the episode over to a
healthy server, and never hands the agent loop ids that are not ids. The servers are small aiohttp apps in this
process answering exactly the bodies under test (stand-ins for a vLLM that misbehaves)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from prorl_adapter.models import SamplingParams
from prorl_adapter.service.llm import LLMPool, LLMUnavailable, Pin

GOOD = {"choices": [{"text": "ok", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}}]}
MALFORMED = {
    "not JSON": b"{nope",
    "no choices": json.dumps({"object": "error"}).encode(),
    "empty choices": json.dumps({"choices": []}).encode(),
    "ids that are not integers": json.dumps(
        {"choices": [{"text": "x", "token_ids": ["5", 6.5], "logprobs": {"token_logprobs": [0.0, 0.0]}}]}
    ).encode(),
    "lengths that disagree": json.dumps(
        {"choices": [{"text": "x", "token_ids": [5, 6], "logprobs": {"token_logprobs": [0.0]}}]}
    ).encode(),
    "no text": json.dumps({"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [0.0]}}]}).encode(),
}


async def serve(body: Callable[[], bytes]) -> tuple[web.AppRunner, str]:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(request: web.Request) -> web.Response:
        return web.Response(body=body(), content_type="application/json")

    app = web.Application()
    app.router.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[bytes], object]]:
    runners: list[web.AppRunner] = []

    async def start(body: bytes) -> str:
        runner, url = await serve(lambda: body)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_answer_fails_over_to_a_healthy_server(servers, case):
    bad = await servers(MALFORMED[case])
    good = await servers(json.dumps(GOOD).encode())
    pool = LLMPool([bad, good], health_interval=3600)
    await pool.start()
    try:
        pin = Pin()
        pin.server = next(s for s in pool._servers.values() if s.url == bad)  # the episode starts on the bad one
        generation = await pool.generate([1, 2], SamplingParams(), pin)
        assert (generation.token_ids, generation.server) == ([5, 6], good)
        failures = {s.url: s.failures for s in pool.servers()}
        assert failures[bad] >= 2 and failures[good] == 0
        assert not next(s for s in pool.servers() if s.url == bad).healthy
    finally:
        await pool.close()


async def test_only_malformed_servers_is_a_clean_failure(servers):
    pool = LLMPool([await servers(MALFORMED["ids that are not integers"])], health_interval=3600, outage_wait_s=0.1)
    await pool.start()
    try:
        with pytest.raises(LLMUnavailable, match="no healthy LLM server"):  # it went unhealthy: a clean end
            await pool.generate([1], SamplingParams(), Pin())
    finally:
        await pool.close()
