"""Adaptive concurrency of the run stage (adaptive_concurrency.py): vLLM's /metrics read, the control law moving the
limit (on a fake engine source, then in closed loop with a model of an engine), the limiter under change, the
fallback for servers without usable metrics (real HTTP servers on loopback: 404, a hang, a refused connection), and
the whole service with an LLM stand-in that reports vLLM's gauges. Time is virtual where there are waits."""

from __future__ import annotations

import asyncio
from collections import deque

import aiohttp
import pytest

from prorl_adapter.models import LLMServerInfo
from prorl_adapter.service.adaptive_concurrency import (
    AdaptiveConfig,
    EngineReading,
    NoEngineMetrics,
    RunConcurrency,
    RunLimiter,
    engine_load,
)
from prorl_adapter.service.config import RolloutConfig
from prorl_adapter.service.server import PIPELINE
from tests.fakes import HANG, ScriptedLLM, llm_pool, on_virtual_time, rollout_stack, shell_job

# Verbatim from vLLM 0.32.0's /metrics (the tiny model of this project, 40 requests in flight), lines around the
# two gauges the controller reads, with a histogram and a client-library counter from the same answer.
VLLM_0_32_SAMPLE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14798.0
python_gc_objects_collected_total{generation="1"} 2304.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 40.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: 'capacity' = waiting \
for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). \
Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.004883408619216212
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="tiny"} 0.0
"""


def vllm_metrics(running: float, waiting: float, engines: int = 1, deferred: float | None = None) -> str:
    """vLLM's format (as in VLLM_0_32_SAMPLE), the load split over `engines` data-parallel engines; with `deferred`,
    the waiting requests by reason too (the rest wait for capacity)."""
    lines = []
    for name, value, help_text in (
        ("running", running, "Number of requests in model execution batches."),
        ("waiting", waiting, "Number of requests waiting to be processed."),
    ):
        lines += [f"# HELP vllm:num_requests_{name} {help_text}", f"# TYPE vllm:num_requests_{name} gauge"]
        lines += [
            f'vllm:num_requests_{name}{{engine="{e}",model_name="tiny"}} {value / engines!r}' for e in range(engines)
        ]
    if deferred is not None:
        lines += ["# TYPE vllm:num_requests_waiting_by_reason gauge"]
        lines += [
            f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="tiny",reason="{reason}"}} {value!r}'
            for reason, value in (("capacity", waiting - deferred), ("deferred", deferred))
        ]
    return "\n".join(lines) + "\n"


# -- /metrics ----------------------------------------------------------------------------------------------
def test_vllms_own_metrics_text_gives_running_and_waiting_requests():
    assert engine_load(VLLM_0_32_SAMPLE) == EngineReading(running=40.0, waiting=0.0, for_capacity=0.0)


def test_the_gauges_are_summed_over_engines_and_models():
    assert engine_load(vllm_metrics(6.0, 4.0, engines=2)) == EngineReading(6.0, 4.0, 4.0)  # no reasons: all waiting
    two_models = vllm_metrics(3.0, 1.0) + vllm_metrics(2.0, 2.0).replace('model_name="tiny"', 'model_name="other"')
    assert engine_load(two_models.replace("# HELP", "# OTHER")) == EngineReading(5.0, 3.0, 3.0)


def test_requests_vllm_defers_do_not_count_as_waiting_for_the_engine():
    # As in VLLM_0_32_SAMPLE, with 3 waiting: 1 for capacity, 2 deferred (e.g. a grammar compiling). The real
    # trace showed 0 running and 3 waiting for seconds while structured-output grammars compiled.
    text = (
        VLLM_0_32_SAMPLE.replace('model_name="tiny"} 0.0', 'model_name="tiny"} 3.0', 1)
        .replace('reason="capacity"} 0.0', 'reason="capacity"} 1.0')
        .replace('reason="deferred"} 0.0', 'reason="deferred"} 2.0')
    )
    assert 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0' in text
    assert engine_load(text) == EngineReading(running=40.0, waiting=3.0, for_capacity=1.0)


@pytest.mark.parametrize(
    "text",
    [
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3.0\n",  # another engine's names
        "<html>not found</html>",
        'vllm:num_requests_running{engine="0" 3.0\n',  # cut off
        "",
    ],
)
def test_an_answer_without_vllms_gauges_is_no_engine_metrics(text):
    with pytest.raises(NoEngineMetrics):
        engine_load(text)


# -- the control law, on a fake engine source ----------------------------------------------------------------
class FakeEngines:
    """Servers and, per server, the loads their next reads give ((running, waiting), an EngineReading, or an
    exception to raise); the last one repeats."""

    def __init__(self, **loads: list) -> None:
        self.loads = {f"http://{name}": deque(seq) for name, seq in loads.items()}
        self.healthy = dict.fromkeys(self.loads, True)
        self.in_flight = dict.fromkeys(self.loads, 0)  # the pool's own count of requests to each
        self.reads: list[str] = []

    def servers(self) -> list[LLMServerInfo]:
        return [
            LLMServerInfo(url=url, protocol="openai", healthy=h, in_flight=self.in_flight[url], requests=0, failures=0)
            for url, h in self.healthy.items()
        ]

    async def read(self, url: str, path: str, timeout: float) -> bytes:
        assert path == "/metrics"
        self.reads.append(url)
        loads = self.loads[url]
        load = loads.popleft() if len(loads) > 1 else loads[0]
        if isinstance(load, BaseException):
            raise load
        if isinstance(load, EngineReading):  # the waiting ones by reason
            return vllm_metrics(load.running, load.waiting, deferred=load.waiting - load.for_capacity).encode()
        return vllm_metrics(*load).encode()


def controller(engines: FakeEngines, queued: int = 10, max_run: int = 64, **config) -> RunConcurrency:
    adaptive = AdaptiveConfig(**{"target_engine_batch": 8, **config})
    return RunConcurrency(adaptive, max_run, engines, queued=lambda: queued)


async def limits(run: RunConcurrency, polls: int) -> list[int]:
    seen = []
    for _ in range(polls):
        await run.poll()
        seen.append(run.limiter.limit)
    return seen


async def test_the_limit_starts_at_the_target_per_server_and_grows_while_the_engines_are_below_it_with_demand():
    engines = FakeEngines(a=[(0, 0)], b=[(2, 0)])
    run = controller(engines)
    assert run.limiter.limit == 16  # 8 for each server before anything is read
    seen = await limits(run, 20)
    assert seen[0] == 16 + 4 + 3  # a: +ceil(0.5 * 8); b: +ceil(0.5 * 6)
    assert seen == sorted(seen) and seen[-1] == 64  # up, and no further than --max-run-workers
    shares = {s.url: s.share for s in run.describe().servers}
    assert sum(shares.values()) <= 64 + 8  # no wind-up past the ceiling


async def test_without_episodes_queued_for_run_the_limit_does_not_grow():
    run = controller(FakeEngines(a=[(0, 0)]), queued=0)
    assert await limits(run, 5) == [8] * 5


async def test_requests_waiting_in_the_engine_shrink_the_limit_only_when_they_persist():
    # One poll with waiting requests (between two engine steps) changes nothing; two in a row do.
    run = controller(FakeEngines(a=[(8, 3), (8, 0), (8, 4), (8, 4), (8, 4)]), min_run_workers=2)
    assert await limits(run, 5) == [8, 8, 8, 6, 4]  # -ceil(0.5 * 4) from the second poll in a row on
    assert await limits(run, 3) == [2, 2, 2]  # and never below --min-run-workers


async def test_deferred_requests_count_towards_the_target_but_never_as_a_full_engine():
    # 3 running, 4 waiting, all of them deferred (grammars compiling): 7 of the target 8, nothing queues.
    run = controller(FakeEngines(a=[EngineReading(running=3, waiting=4, for_capacity=0)]))
    assert await limits(run, 3) == [9, 10, 11]  # +ceil(0.5 * (8 - 3 - 4)) each time, and no shrinking


async def test_requests_this_service_has_in_flight_count_though_the_engine_does_not_see_them_yet():
    # A burst still in vLLM's front end: the engine reports nothing, the pool has 6 requests out.
    engines = FakeEngines(a=[(0, 0)])
    engines.in_flight["http://a"] = 6
    run = controller(engines)
    assert await limits(run, 2) == [9, 10]  # +ceil(0.5 * (8 - 6)), not +4
    engines.in_flight["http://a"] = 8
    assert await limits(run, 2) == [10, 10]


async def test_requests_waiting_while_the_engine_runs_none_shrink_nothing():
    run = controller(FakeEngines(a=[(0, 3)]), queued=0)
    assert await limits(run, 4) == [8] * 4


async def test_running_past_the_target_shrinks_the_limit_and_at_the_target_it_holds():
    run = controller(FakeEngines(a=[(12, 0), (9, 0), (8, 0)]))
    assert await limits(run, 4) == [6, 5, 5, 5]  # -ceil(0.5 * 4), -ceil(0.5 * 1), then on target


class EngineModel:
    """A closed-loop stand-in for one vLLM server: each episode generates a fraction `duty` of its time, the engine
    runs at most `max_num_seqs` requests and queues the rest. Its read reports the load of the current limit."""

    def __init__(self, duty: float, max_num_seqs: int) -> None:
        self.duty, self.max_num_seqs = duty, max_num_seqs
        self.run: RunConcurrency | None = None

    def servers(self) -> list[LLMServerInfo]:
        return [LLMServerInfo(url="http://v", protocol="openai", healthy=True, in_flight=0, requests=0, failures=0)]

    async def read(self, url: str, path: str, timeout: float) -> bytes:
        requests = int(self.duty * self.run.limiter.limit)
        running = min(requests, self.max_num_seqs)
        return vllm_metrics(running, requests - running).encode()


@pytest.mark.parametrize(("duty", "settles"), [(1.0, 16), (0.5, 32), (0.25, 64)])
async def test_in_closed_loop_the_limit_settles_where_the_engine_batch_meets_the_target(duty, settles):
    engine = EngineModel(duty, max_num_seqs=256)
    run = engine.run = RunConcurrency(AdaptiveConfig(target_engine_batch=16), 256, engine, queued=lambda: 100)
    seen = await limits(run, 40)
    assert seen == sorted(seen) and max(seen) == settles  # up without overshoot...
    assert seen[-10:] == [settles] * 10  # ...to T / duty, where it stays


@pytest.mark.parametrize(("duty", "settles"), [(1.0, 6), (0.5, 13)])
@on_virtual_time
async def test_in_closed_loop_an_engine_smaller_than_the_target_is_held_where_nothing_queues(duty, settles):
    # max_num_seqs 6 < target 16: requests queue before the target is met, and the limit backs off to the most
    # episodes the engine runs without a queue (floor(duty * limit) <= 6) and stays there...
    engine = EngineModel(duty, max_num_seqs=6)
    config = AdaptiveConfig(target_engine_batch=16, capacity_memory_s=30.0)
    run = engine.run = RunConcurrency(config, 256, engine, queued=lambda: 100)
    seen = await limits(run, 20)
    assert seen[-10:] == [settles] * 10 and max(seen) == 16
    # ...until the engine's capacity is forgotten: the limit probes upwards, and backs off again.
    await asyncio.sleep(config.capacity_memory_s)  # virtual time: the memory lapses
    probe = await limits(run, 20)
    assert max(probe) > settles and probe[-10:] == [settles] * 10


# -- the limiter ---------------------------------------------------------------------------------------------
async def test_lowering_the_limit_takes_no_slot_back_and_grants_none_until_below_it():
    limiter = RunLimiter(3)
    for _ in range(3):
        await limiter.acquire()
    limiter.set_limit(1)
    assert (limiter.held, limiter.limit) == (3, 1)  # nothing interrupted
    waiter = asyncio.ensure_future(limiter.acquire())
    await asyncio.wait({waiter}, timeout=0)
    assert limiter.waiting == 1
    limiter.release()
    limiter.release()
    assert not waiter.done() and limiter.held == 1  # one held: at the limit, still no new slot
    limiter.release()
    assert limiter.waiting == 0  # granted when the holders fell below the limit
    await waiter
    assert (limiter.held, limiter.waiting) == (1, 0)


async def test_raising_the_limit_wakes_waiters_first_come_first_served():
    limiter = RunLimiter(1)
    await limiter.acquire()
    waiters = [asyncio.ensure_future(limiter.acquire()) for _ in range(3)]
    await asyncio.wait(waiters, timeout=0)
    assert limiter.waiting == 3
    limiter.set_limit(3)
    assert (limiter.held, limiter.waiting) == (3, 1)
    await asyncio.gather(*waiters[:2])  # the first two
    assert not waiters[2].done()
    limiter.set_limit(4)
    assert limiter.waiting == 0
    await waiters[2]
    assert limiter.held == 4


async def test_a_waiter_cancelled_before_or_after_its_grant_loses_no_slot():
    limiter = RunLimiter(1)
    await limiter.acquire()
    before, after, last = (asyncio.ensure_future(limiter.acquire()) for _ in range(3))
    await asyncio.wait({before, after, last}, timeout=0)
    before.cancel()  # still waiting
    await asyncio.gather(before, return_exceptions=True)
    limiter.release()  # granted to `after`, which is cancelled before it resumes: it gives the slot back...
    after.cancel()
    await asyncio.gather(after, return_exceptions=True)
    assert (limiter.held, limiter.waiting) == (1, 0)  # ...to `last`
    await last
    assert (limiter.held, limiter.waiting) == (1, 0)


# -- fallback: servers without usable metrics, behind the real LLM pool ---------------------------------------
@on_virtual_time
async def test_a_server_whose_metrics_404_gets_the_fixed_share_and_the_others_stay_on_their_metrics():
    async with ScriptedLLM() as vllm, ScriptedLLM(protocol="sglang") as sglang, llm_pool([vllm, sglang]) as pool:
        vllm.engine_metrics = vllm_metrics(8, 0)
        run = RunConcurrency(AdaptiveConfig(target_engine_batch=8), 20, pool, queued=lambda: 5)
        await run.poll()
        state = {s.url: s for s in run.describe().servers}
        assert (state[vllm.url].source, state[vllm.url].running, state[vllm.url].share) == ("metrics", 8.0, 8)
        fixed = state[f"sglang+{sglang.url}"] if f"sglang+{sglang.url}" in state else state[sglang.url]
        assert (fixed.source, fixed.share, fixed.running) == ("fixed", 10, None)  # 20 / 2 healthy servers
        assert "404" in fixed.note
        assert run.limiter.limit == 18
        reads = sglang.metrics_reads
        await run.poll()
        assert sglang.metrics_reads == reads  # asked again only after retry_s


@on_virtual_time
async def test_a_server_whose_metrics_hang_keeps_its_share_for_a_while_then_falls_back_and_comes_back():
    async with ScriptedLLM() as llm, llm_pool([llm]) as pool:
        config = AdaptiveConfig(target_engine_batch=8, scrape_timeout_s=2.0, retry_s=30.0, fallback_after=3)
        run = RunConcurrency(config, 64, pool, queued=lambda: 0)
        llm.engine_metrics = vllm_metrics(8, 0)
        await run.poll()
        assert run.limiter.limit == 8
        llm.engine_metrics = HANG
        await run.poll()
        await run.poll()  # two timeouts: a blip, maybe; the share holds
        [server] = run.describe().servers
        assert (server.source, run.limiter.limit) == ("metrics", 8) and "did not answer within 2 s" in server.note
        await run.poll()  # the third: the fixed share, --max-run-workers for the one server
        [server] = run.describe().servers
        assert (server.source, run.limiter.limit) == ("fixed", 64)
        llm.engine_metrics = vllm_metrics(12, 0)
        llm.release()
        await llm.until(lambda: llm.held == 0)
        await asyncio.sleep(config.retry_s)  # virtual: the retry interval passes
        await run.poll()
        [server] = run.describe().servers
        assert (server.source, server.running, server.note) == ("metrics", 12.0, None)
        assert run.limiter.limit == 62  # back on its metrics, from the fixed share: -ceil(0.5 * 4)


@on_virtual_time
async def test_a_server_that_refuses_the_connection_falls_back_and_an_unhealthy_one_counts_for_nothing():
    async with ScriptedLLM() as up, ScriptedLLM() as gone, llm_pool([up, gone]) as pool:
        up.engine_metrics = vllm_metrics(8, 0)
        run = RunConcurrency(AdaptiveConfig(target_engine_batch=8), 32, pool, queued=lambda: 0)
        await gone.stop()  # the pool still takes it for healthy (no health check yet)
        await run.poll()
        state = {s.url: s for s in run.describe().servers}
        assert state[gone.url].source == "fixed" and state[gone.url].share == 16
        assert run.limiter.limit == 8 + 16
        await pool.check_health()  # now the pool knows
        await run.poll()
        state = {s.url: s for s in run.describe().servers}
        assert state[gone.url].source == "unhealthy" and run.limiter.limit == 8


async def test_a_read_that_fails_unexpectedly_is_a_fallback_not_a_crash():
    run = controller(FakeEngines(a=[RuntimeError("a bug")]), max_run=40)
    await run.poll()
    [server] = run.describe().servers
    assert (server.source, run.limiter.limit) == ("fixed", 40) and "RuntimeError: a bug" in server.note


async def test_a_server_back_from_unhealthy_in_its_fallback_interval_is_on_the_fixed_share_again():
    engines = FakeEngines(a=[(0, 0)], b=[aiohttp.ClientConnectionError("refused")])
    run = controller(engines, queued=0, max_run=40)
    await run.poll()
    engines.healthy["http://b"] = False
    await run.poll()
    assert {s.url: s.source for s in run.describe().servers} == {"http://a": "metrics", "http://b": "unhealthy"}
    assert run.limiter.limit == 8
    engines.healthy["http://b"] = True
    await run.poll()
    assert {s.url: (s.source, s.share) for s in run.describe().servers}["http://b"] == ("fixed", 20)
    assert run.limiter.limit == 28 and engines.reads.count("http://b") == 1  # not asked again before retry_s


async def test_with_no_healthy_server_the_limit_stays_where_it_was():
    engines = FakeEngines(a=[(0, 0)])
    run = controller(engines)
    await run.poll()
    before = run.limiter.limit
    engines.healthy["http://a"] = False
    assert await limits(run, 3) == [before] * 3


# -- settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("adaptive", "max_run", "message"),
    [
        ({"target_engine_batch": -1}, 256, "--target-engine-batch"),
        ({"target_engine_batch": 8, "min_run_workers": 0}, 256, "--min-run-workers"),
        ({"target_engine_batch": 8, "min_run_workers": 300}, 256, "--min-run-workers"),
        ({"target_engine_batch": 8, "poll_s": 0}, 256, "--engine-poll-s"),
        ({}, 0, "--max-run-workers"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_flag(adaptive, max_run, message):
    from prorl_adapter.service.pipeline import PipelineConfig

    config = RolloutConfig(
        [], [], "t", pipeline=PipelineConfig(max_run_workers=max_run, adaptive=AdaptiveConfig(**adaptive))
    )
    with pytest.raises(ValueError, match=message):
        config.check()


def test_the_flags_reach_the_pipeline_config(monkeypatch):
    from prorl_adapter.service import cli

    seen = {}
    monkeypatch.setattr("server_kit.webapp.run_forever", lambda coro: coro.close())
    monkeypatch.setattr(
        "prorl_adapter.service.config.RolloutConfig.check", lambda self: seen.setdefault("config", self)
    )
    argv = ["serve", "--tokenizer", "t", "--target-engine-batch", "24", "--min-run-workers", "4"]
    assert cli.main([*argv, "--engine-poll-s", "0.25", "--max-run-workers", "128"]) == 0
    pipeline = seen["config"].pipeline
    assert (pipeline.max_run_workers, pipeline.adaptive.target_engine_batch) == (128, 24)
    assert (pipeline.adaptive.min_run_workers, pipeline.adaptive.poll_s) == (4, 0.25)
    assert cli.build_parser().parse_args(["serve", "--tokenizer", "t"]).target_engine_batch == 0  # off by default


# -- through the service -------------------------------------------------------------------------------------
ADAPTIVE = {"max_run_workers": 6, "adaptive": AdaptiveConfig(target_engine_batch=4, poll_s=0.5, retry_s=5.0)}


@on_virtual_time
async def test_by_default_the_run_stage_holds_max_run_workers_and_reads_no_metrics():
    async with rollout_stack() as stack:
        trajectory = await stack.client.run(shell_job(), wait=60)
        concurrency = (await stack.client.status()).run_concurrency
    assert trajectory.error is None
    assert (concurrency.mode, concurrency.limit, concurrency.max, concurrency.servers) == ("fixed", 8, 8, [])
    assert stack.llm.metrics_reads == 0


@on_virtual_time
async def test_the_service_sizes_its_episodes_in_flight_from_the_engine_and_never_interrupts_one():
    async with rollout_stack(pipeline=ADAPTIVE) as stack:
        pipeline = stack.app[PIPELINE]
        run = pipeline.run_concurrency
        stack.llm.engine_metrics = vllm_metrics(4, 5)  # requests waiting in the engine: down to the minimum
        await stack.llm.until(lambda: run.limiter.limit == 1)
        stack.llm.cue(HANG, HANG, HANG, HANG)  # each episode's first turn waits in the "engine"
        jobs = [await stack.client.submit(shell_job()) for _ in range(4)]
        await stack.llm.until(lambda: pipeline.status()["queues"]["run"] == 3)
        assert stack.llm.held == 1  # one episode in the run stage: the limit gates them

        # Below the target, with episodes queued: it grows, while this service's requests in flight (those held)
        # are fewer than the target too.
        stack.llm.engine_metrics = vllm_metrics(1, 0)
        await stack.llm.until(lambda: stack.llm.held == 4)
        assert 4 <= run.limiter.limit <= 6 and pipeline.status()["queues"]["run"] == 0

        stack.llm.engine_metrics = vllm_metrics(6, 3)  # past the target, and a queue: it shrinks...
        await stack.llm.until(lambda: run.limiter.limit == 1)
        assert stack.llm.held == 4 and run.limiter.held == 4  # ...and the episodes in flight go on
        status = await (await stack.http.get("/v1/status")).json()
        concurrency = status["run_concurrency"]
        assert (concurrency["mode"], concurrency["limit"], concurrency["held"]) == ("adaptive", 1, 4)
        assert (concurrency["target_engine_batch"], concurrency["min"], concurrency["max"]) == (4, 1, 6)
        [server] = concurrency["servers"]
        assert (server["url"], server["source"], server["running"], server["waiting"]) == (
            stack.llm.url,
            "metrics",
            6,
            3,
        )
        metrics = await (await stack.http.get("/metrics")).text()
        assert "prorl_rollout_run_limit 1.0" in metrics and "prorl_rollout_run_target_engine_batch 4.0" in metrics
        assert f'prorl_rollout_llm_engine_requests{{server="{stack.llm.url}",state="waiting"}} 3.0' in metrics

        stack.llm.release()
        trajectories = [await stack.client.result(job.job_id, wait=600) for job in jobs]
    assert all(t.error is None and t.reward == 1.0 for t in trajectories)  # none lost, none failed


@on_virtual_time
async def test_the_service_falls_back_to_the_fixed_limit_when_its_llm_server_has_no_metrics():
    async with rollout_stack(pipeline=ADAPTIVE) as stack:
        run = stack.app[PIPELINE].run_concurrency
        await stack.llm.until(lambda: stack.llm.metrics_reads >= 1)
        trajectories = [await stack.client.run(shell_job(), wait=60) for _ in range(2)]
        status = await stack.client.status()
    assert all(t.error is None for t in trajectories)
    [server] = status.run_concurrency.servers
    assert (server.source, server.share, run.limiter.limit) == ("fixed", 6, 6) and "404" in server.note
