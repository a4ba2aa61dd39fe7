"""LLMPool against scripted LLM stand-ins (tests/fakes): what it sends, where it sends it (fewest in flight, an
episode kept on its server), and what it does when a server dies, hangs, answers nonsense, refuses, or fails its
health check. Time is virtual: the waits (request timeouts, health intervals, waiting for a healthy server) take
no real time. (Malformed answers of every kind: test_llm_answers.py.)"""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.models import LLMOutage, SamplingParams
from prorl_adapter.service.llm import SPIKE_FAILURES, SPIKE_HOLD_S, LLMPool, LLMRequestError, LLMUnavailable, Pin
from tests.fakes import HANG, Fail, Garbage, ScriptedLLM, llm_pool, on_virtual_time, scripted_llms

SAMPLING = SamplingParams(max_tokens=64)


def health(pool: LLMPool) -> dict[str, bool]:
    return {server.url: server.healthy for server in pool.servers()}


def failures(pool: LLMPool) -> dict[str, int]:
    return {server.url: server.failures for server in pool.servers()}


@on_virtual_time
async def test_a_completion_is_asked_for_in_token_ids_and_comes_back_as_sampled():
    async with scripted_llms(1, ["hello"]) as [llm], llm_pool([llm]) as pool:
        sampling = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=5, stop=["\n\n"], regex="h.*")
        generation = await pool.generate([11, 12, 13], sampling, Pin())
    [body] = llm.requests
    assert body["prompt"] == [11, 12, 13] and body["model"] == llm.model
    assert (body["logprobs"], body["return_token_ids"], body["skip_special_tokens"]) == (1, True, False)
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"]) == (9, 0.7, 0.9, 5)
    assert (body["stop"], body["structured_outputs"]) == (["\n\n"], {"regex": "h.*"})
    [sampled] = llm.sampled
    assert (generation.token_ids, generation.logprobs) == (sampled.token_ids, sampled.logprobs)
    assert (generation.text, generation.finish_reason, generation.server) == ("hello", "stop", llm.url)


@on_virtual_time
async def test_a_new_episode_goes_to_the_server_with_the_fewest_requests_in_flight():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        a.cue(HANG)
        held = asyncio.create_task(pool.generate([1], SAMPLING, Pin()))
        await a.until(lambda: a.held == 1)
        for _ in range(3):  # a is busy with one request; every new episode goes to b
            assert (await pool.generate([2], SAMPLING, Pin())).server == b.url
        a.release()
        assert (await held).server == a.url
    assert (len(a.requests), len(b.requests)) == (1, 3)


@on_virtual_time
async def test_an_episode_stays_on_its_server_while_it_is_healthy_even_when_it_is_the_busier_one():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        pin = Pin()
        assert (await pool.generate([1], SAMPLING, pin)).server == a.url
        assert (await pool.generate([1], SAMPLING, Pin())).server == b.url
        a.cue(HANG)  # another episode now keeps a busy
        busy = asyncio.create_task(pool.generate([1], SAMPLING, Pin()))
        await a.until(lambda: a.held == 1)
        assert (await pool.generate([1, 2], SAMPLING, pin)).server == a.url  # its prefix cache is there
        assert pin.failovers == 0
        a.release()
        await busy


@on_virtual_time
async def test_an_episode_fails_over_when_its_server_dies_and_the_dead_one_is_marked_down():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        pin = Pin()
        assert (await pool.generate([1], SAMPLING, pin)).server == a.url
        await a.stop()  # connections refused from now on
        generation = await pool.generate([1, 2], SAMPLING, pin)
        assert (generation.server, pin.failovers) == (b.url, 1)
        assert health(pool) == {a.url: False, b.url: True}
        # A refused connection marks the server down at once; a kept-alive one the client has not yet seen closed
        # may drop first (retried where it was: one dropped connection is not a death).
        assert failures(pool)[a.url] in (1, 2)


@on_virtual_time
async def test_a_server_that_hangs_is_given_up_on_after_the_request_timeout():
    async with scripted_llms(2) as [a, b], llm_pool([a, b], call_timeout_s=60.0) as pool:
        a.cue(HANG, HANG)
        generation = await pool.generate([1], SAMPLING, Pin())  # two timeouts of 60 virtual seconds
        assert generation.server == b.url and health(pool)[a.url] is False


@on_virtual_time
async def test_no_call_has_a_limit_of_its_own_unless_asked_but_one_to_a_server_gone_silent_fails_over():
    async with scripted_llms(2) as [a, b], llm_pool([a, b], health_interval=5.0) as pool:
        a.cue(HANG)
        call = asyncio.ensure_future(pool.generate([1], SAMPLING, Pin()))
        await a.until(lambda: a.held == 1)
        await asyncio.sleep(1200)  # virtual: a long turn on a server that answers its health checks is never cut
        assert not call.done() and health(pool)[a.url] is True
        a.down = True  # its health checks fail from now on (a partition: the held request gets no answer either)
        generation = await call  # SILENT_SERVER_S later, the request ends and fails over
        assert generation.server == b.url and health(pool)[a.url] is False
        a.release()


@on_virtual_time
async def test_a_server_removed_from_the_pool_loses_its_episodes_to_the_others():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        pin = Pin()
        assert (await pool.generate([1], SAMPLING, pin)).server == a.url
        assert pool.remove(a.url) and not pool.remove(a.url)
        assert (await pool.generate([1, 2], SAMPLING, pin)).server == b.url and pin.failovers == 1
        assert [server.url for server in pool.servers()] == [b.url]


@on_virtual_time
async def test_one_malformed_answer_is_retried_on_the_same_server_and_counted():
    async with scripted_llms(2, ["ok"]) as [a, b], llm_pool([a, b]) as pool:
        pin = Pin()
        a.cue(Garbage())
        generation = await pool.generate([1], SAMPLING, pin)
        assert (generation.server, generation.text, pin.failovers) == (a.url, "ok", 0)
        assert health(pool)[a.url] is True and failures(pool) == {a.url: 1, b.url: 0}


@pytest.mark.parametrize("answer", [Fail(502, "bad gateway"), Garbage(b"not json at all")])
@on_virtual_time
async def test_two_failed_answers_in_a_row_mark_the_server_down_and_the_episode_moves(answer):
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        pin = Pin()
        a.cue(answer, answer)
        assert (await pool.generate([1], SAMPLING, pin)).server == b.url
        assert health(pool)[a.url] is False and pin.failovers == 1


@on_virtual_time
async def test_a_refused_request_is_the_callers_error_and_is_not_retried():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        a.cue(Fail(400, "This model's maximum context length is 8 tokens"))
        with pytest.raises(LLMRequestError, match="maximum context length"):
            await pool.generate([1] * 20, SAMPLING, Pin())
        assert (len(a.requests), len(b.requests)) == (1, 0)
        assert health(pool) == {a.url: True, b.url: True} and failures(pool)[a.url] == 0


@on_virtual_time
async def test_a_health_check_marks_a_server_down_and_up_again():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        a.down = True
        await pool.check_health()
        assert health(pool) == {a.url: False, b.url: True}
        assert (await pool.generate([1], SAMPLING, Pin())).server == b.url
        a.down = False
        await pool.check_health()
        assert health(pool) == {a.url: True, b.url: True}


@on_virtual_time
async def test_the_background_health_check_follows_a_server_going_down_and_coming_back():
    async with scripted_llms(1) as [a], llm_pool([a], health_interval=5.0) as pool:
        a.down = True
        await asyncio.sleep(12.5)  # virtual: two health rounds
        assert health(pool) == {a.url: False}
        a.down = False
        await asyncio.sleep(12.5)
        assert health(pool) == {a.url: True}


@on_virtual_time
async def test_with_no_healthy_server_a_request_waits_for_one_to_come_back():
    async with scripted_llms(1, ["back"]) as [a], llm_pool([a], outage_wait_s=30.0) as pool:
        a.down = True
        await pool.check_health()
        asyncio.get_running_loop().call_later(10.0, setattr, a, "down", False)  # up again 10 virtual s later
        generation = await pool.generate([1], SAMPLING, Pin())
        assert (generation.text, generation.server) == ("back", a.url)


@on_virtual_time
async def test_with_no_healthy_server_for_the_whole_wait_a_request_fails_cleanly():
    async with scripted_llms(2) as [a, b], llm_pool([a, b], outage_wait_s=30.0) as pool:
        a.down = b.down = True
        await pool.check_health()
        with pytest.raises(LLMUnavailable, match="no healthy LLM server among 2 configured for 30 s") as failed:
            await pool.generate([1], SAMPLING, Pin())
        assert a.requests == [] and b.requests == []
        assert failed.value.outage and pool.outage_waits == 1  # the outage's failure, not the episode's


def told(pool: LLMPool) -> list[str | None]:
    """What the pool's outage listener hears, in order: each outage's reason as it starts, None as it ends."""
    heard: list[str | None] = []
    pool.on_outage(lambda outage: heard.append(outage.reason if outage is not None else None))
    return heard


@on_virtual_time
async def test_every_server_down_is_an_outage_told_once_and_a_server_back_ends_it():
    async with scripted_llms(2) as [a, b], llm_pool([a, b]) as pool:
        heard = told(pool)
        assert pool.outage() is None
        a.down = True
        await pool.check_health()
        assert pool.outage() is None  # b serves
        b.down = True
        await pool.check_health()
        await pool.check_health()
        outage = pool.outage()
        assert isinstance(outage, LLMOutage) and outage.reason == "none of the 2 LLM servers is healthy"
        assert heard == ["none of the 2 LLM servers is healthy"]  # once, however often it is looked at
        b.down = False
        await pool.check_health()
        assert pool.outage() is None and heard == ["none of the 2 LLM servers is healthy", None]
        pool.remove(a.url)
        pool.remove(b.url)
        assert pool.outage().reason.startswith("no LLM server is configured")


@on_virtual_time
async def test_a_fleet_whose_requests_all_fail_is_in_an_outage_even_while_its_health_checks_pass():
    # The engine is dead behind a live API server: /v1/models answers, every completion is a 502. Each turn is
    # tried where it was, then waits for a server, which the next health check finds, and fails again.
    async with scripted_llms(1, [Fail(502, "engine dead")]) as [a], llm_pool([a], outage_wait_s=1.0) as pool:
        heard = told(pool)
        given_up: list[LLMUnavailable] = []
        while len(a.requests) < SPIKE_FAILURES:
            with pytest.raises(LLMUnavailable) as failed:
                await pool.generate([1], SAMPLING, Pin())
            given_up.append(failed.value)
        # The first turns gave up with the server just found healthy again: their episodes' failures. Once the run
        # of failures is long enough it is the fleet's: an outage that health checks passing do not end.
        assert not given_up[0].outage and given_up[-1].outage
        await pool.check_health()
        assert health(pool) == {a.url: True}
        assert (
            pool.outage().reason
            == f"error-rate spike: the last {SPIKE_FAILURES} requests to the LLM servers all failed"
        )

        await asyncio.sleep(SPIKE_HOLD_S)  # virtual: no request since; episodes may try again
        assert pool.outage() is None and heard[-1] is None
        a.cue(Fail(502))  # the next failure: the fleet still fails
        with pytest.raises(LLMUnavailable):
            await pool.generate([1], SAMPLING, Pin())
        assert pool.outage() is not None
        await pool.check_health()
        a.cue("answered")  # one answer ends the spike
        assert (await pool.generate([1], SAMPLING, Pin())).text == "answered"
        assert pool.outage() is None and heard[-1] is None


@on_virtual_time
async def test_servers_can_be_replaced_as_a_whole_and_a_new_one_is_used_once_healthy():
    async with scripted_llms(1) as [a], llm_pool([a]) as pool, ScriptedLLM(["from c"]) as c:
        pool.replace([c.url + "/"])
        await pool.check_health()
        assert health(pool) == {c.url: True}
        assert (await pool.generate([1], SAMPLING, Pin())).text == "from c"


@on_virtual_time
async def test_a_models_list_of_the_wrong_shape_marks_the_server_down_and_health_checks_go_on():
    async with scripted_llms(1) as [a], llm_pool([a], health_interval=5.0) as pool:
        a.models_body = b'{"data": null}'
        await asyncio.sleep(12.5)  # virtual: two health rounds
        assert health(pool) == {a.url: False}
        a.models_body = None
        await asyncio.sleep(12.5)
        assert health(pool) == {a.url: True}
