"""Chaos on a real multi-node Ray cluster on this machine: the rollout stack (Redis, two replicas, a runtime on
each of two nodes) serving a decoupled batch while one runtime node is removed and one replica is killed.
A module of its own: it takes a node away, and wants a cluster (and a Ray driver) of its own for that.
"""

from __future__ import annotations

import json
import time

import httpx

from prorl_adapter.dev.localstack import TINY_MODEL
from prorl_adapter.launch.ray_stack import RayStack
from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient

from .test_ray_cluster import RUNTIME_RESOURCE, START_S, gone, ray, ray_cluster, registered, wait_for
from .test_ray_cluster import pytestmark as cluster_needs
from .test_rollout import shell_job

pytestmark = cluster_needs  # Ray, Redis, bwrap and the tokenizer, as the cluster module says


CHAOS_PROMPTS = 24
CAPACITY = 4  # episodes each replica's workers run at once (init and run workers)


def head_node_id() -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and not n["Resources"].get(RUNTIME_RESOURCE))


async def test_a_decoupled_batch_survives_a_dead_node_and_a_dead_replica(vllm, tmp_path):
    """Runtimes on two nodes, two replicas (on the head) and Redis; prompts in decoupled mode, taken and
    acknowledged through either replica; then one runtime node is removed (its raylet, actor, runtime and
    sandboxes die) and one replica's actor is killed with episodes in hand. Every prompt is delivered at least
    once, and no sandbox is left on the runtime that survives.

    Each replica's own workers (CAPACITY episodes) bind, not the shared room (max_buffered = both together):
    under a shared bound alone, the replica that frees room (the one acknowledged through) may take all of it,
    and which replica runs what would be chance."""
    config = tmp_path / "plugins.json"
    config.write_text(json.dumps({"staleness": {"mode": "off"}}))
    with ray_cluster() as cluster:
        stack = RayStack.up(
            tokenizer=str(TINY_MODEL),
            llm_urls=[vllm.url],
            replicas=2,
            runtime_resource=RUNTIME_RESOURCE,
            service_nodes=[head_node_id()],
            namespace="prorl-it-chaos",
            service_args=[
                *("--log-level", "WARNING", "--plugin-config", str(config), "--max-buffered", str(2 * CAPACITY)),
                *("--max-init-workers", str(CAPACITY // 2), "--max-run-workers", str(CAPACITY // 2)),
            ],
            runtime_args=["--log-level", "WARNING", "--heartbeat-s", "0.5"],
            timeout_s=START_S,
        )
        parts = stack.describe()["parts"]
        token = stack.token
        seen: dict[str, int] = {}
        try:
            for url in stack.service_urls:
                wait_for(lambda url=url: registered(url, token) == set(stack.runtime_urls), 60, "runtimes register")
            first, second = (RolloutClient(url, token=token, timeout=30) for url in stack.service_urls)
            first_half = CHAOS_PROMPTS // 2
            prompts = [shell_job("pwd", "ls", max_turns=2, labels={"prompt": str(i)}) for i in range(first_half)]
            # Half through each replica: the room (2 * CAPACITY) is free, so each admits its CAPACITY at once.
            await first.enqueue_prompts(prompts[: first_half // 2])
            await second.enqueue_prompts(prompts[first_half // 2 :])

            async def consume(until: int, takers: list[RolloutClient]) -> None:
                """Take and acknowledge until `until` prompts were seen."""
                deadline = time.monotonic() + 600
                turn = 0
                while len(seen) < until:
                    if time.monotonic() >= deadline:  # what each replica was doing, for the failure to explain
                        states = [(await t.status()).model_dump(include={"active", "finished"}) for t in takers]
                        raise AssertionError(f"{len(seen)} of {until} prompts delivered in time; {states}")
                    taker, acker = takers[turn % len(takers)], takers[(turn + 1) % len(takers)]
                    turn += 1
                    try:
                        batch = await taker.take_batch(4, timeout=2, lease_s=20)
                        for item in batch.items:
                            key = item.trajectory.labels["prompt"]
                            seen[key] = seen.get(key, 0) + 1
                        if batch.items:  # acknowledged through the other replica: they share the buffer
                            await acker.ack([item.id for item in batch.items])
                    except (RolloutAPIError, httpx.TransportError):
                        continue  # a replica going down under the trainer: the next turn takes from the other

            await consume(6, [first, second])
            victim_runtime = next(p for p in parts if p["part"] == "runtime")
            node = next(n for n in cluster.worker_nodes if n.node_id == victim_runtime["node_id"])
            cluster.remove_node(node)  # the machine goes: raylet, actor, runtime and its sandboxes

            await consume(first_half, [first, second])  # everything acknowledged: the room is free again
            # Slow episodes through the second replica: it admits CAPACITY of them at once (the first cannot take
            # more than its own CAPACITY), and they are still running when it is killed.
            slow = [
                shell_job("sleep 2", max_turns=2, labels={"prompt": str(i)}) for i in range(first_half, CHAOS_PROMPTS)
            ]
            await second.enqueue_prompts(slow)
            wait_for(lambda: running_on(stack.service_urls[1], token) > 0, 60, "the second replica runs episodes")
            victim_replica = [p for p in parts if p["part"] == "service"][1]
            ray.kill(ray.get_actor(victim_replica["name"], namespace="prorl-it-chaos"))
            await consume(CHAOS_PROMPTS, [first])
            # The survivor sees the dead replica's beats lapse and takes it over (then forgets it).
            wait_for(lambda: replicas(stack.service_urls[0], token) == {"prorl-rollout-0": 1}, 60, "the takeover")
            survivor = next(p for p in parts if p["part"] == "runtime" and p["name"] != victim_runtime["name"])
            # The dead replica's sandboxes are deleted by the replica that took over, and the survivor's own
            # were deleted as its episodes ended: nothing is left on the runtime that lives on.
            left = lambda: sandboxes_on(stack.service_urls[0], token, survivor["url"])  # noqa: E731
            wait_for(lambda: left() == 0, 60, "no sandbox left on the survivor")
            status = await first.status()
            await first.aclose()
            await second.aclose()
        finally:
            stack.down()
        assert set(seen) == {str(i) for i in range(CHAOS_PROMPTS)}
        assert gone(victim_runtime["pid"]) and gone(victim_replica["pid"])
        assert {r.url for r in status.runtimes if r.alive} == {survivor["url"]}


def replicas(url: str, token: str) -> dict[str, int]:
    """Each replica /v1/status lists, with how many dead ones it took over (its figures, as of its last beat)."""
    reply = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    reply.raise_for_status()
    return {r["id"]: r["figures"].get("taken_over", 0) for r in reply.json()["replicas"]}


def running_on(url: str, token: str) -> int:
    """The replica's unfinished jobs (its /v1/status)."""
    reply = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    reply.raise_for_status()
    return sum(reply.json()["active"].values())


def sandboxes_on(service_url: str, token: str, runtime_url: str) -> int | None:
    """How many sandboxes the runtime at `runtime_url` holds, as its last heartbeat told the replica at
    `service_url` (a registered runtime's API token is its own: the stack's token does not open it)."""
    reply = httpx.get(f"{service_url}/v1/runtimes", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    reply.raise_for_status()
    return next((r["sandboxes"] for r in reply.json()["runtimes"] if r["url"] == runtime_url), None)
