"""The rollout stack on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and
two worker nodes that carry the `prorl_runtime` resource): Redis, two rollout service replicas and a sandbox
runtime on each runtime node, each started by its actor, answering on its node's address with the stack's
token, and nothing of it left after `down()`. `ray_cluster()` is the cluster for the chaos tests too.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[verl]'")

from ray.cluster_utils import Cluster  # noqa: E402 - after the skip

from prorl_adapter.dev.localstack import TINY_MODEL  # noqa: E402
from prorl_adapter.launch.process import redis_ready  # noqa: E402
from prorl_adapter.launch.ray_stack import RECORD_NAME, RayStack, StackError, StackExists  # noqa: E402

from .redis_server import REDIS_SKIP  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REDIS_SKIP is not None, reason=REDIS_SKIP or ""),
    pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
    ),
    pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason=f"no tokenizer at {TINY_MODEL}"),
]

RUNTIME_RESOURCE = "prorl_runtime"
NAMESPACE = "prorl-it"
START_S = 240.0  # two cores for three raylets and five servers


@contextlib.contextmanager
def ray_cluster(runtime_nodes: int = 2, num_cpus: int = 2, resource: str = RUNTIME_RESOURCE) -> Iterator[Cluster]:
    """A head node and `runtime_nodes` worker nodes with `resource`, all on this machine, and this process
    connected to it as a driver; `cluster.remove_node(node)` takes a node down as a machine failure would."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus})
    try:
        for _ in range(runtime_nodes):
            cluster.add_node(num_cpus=num_cpus, resources={resource: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="prorl-test-driver", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with ray_cluster() as cluster:
        yield cluster


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:g} s")
        time.sleep(0.2)  # polling a condition with a deadline


def gone(pid: int) -> bool:
    """No such process, or a zombie (the container's init may be slow to reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def named_actors(namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def runtime_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(RUNTIME_RESOURCE)}


def answers(part: dict, token: str) -> bool:
    if part["part"] == "redis":
        return redis_ready(part["ip"], part["port"], token)()
    return httpx.get(part["url"] + "/healthz", timeout=5).status_code == 200


def registered(service_url: str, token: str) -> set[str]:
    reply = httpx.get(f"{service_url}/v1/runtimes", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    reply.raise_for_status()
    return {r["url"] for r in reply.json()["runtimes"] if r["alive"]}


def test_the_stack_runs_on_its_nodes_and_down_leaves_nothing(cluster):
    stack = RayStack.up(
        tokenizer=str(TINY_MODEL),
        replicas=2,
        runtime_resource=RUNTIME_RESOURCE,
        namespace=NAMESPACE,
        runtime_args=["--log-level", "WARNING"],
        service_args=["--log-level", "WARNING"],
        timeout_s=START_S,
    )
    try:
        description = json.loads(json.dumps(stack.describe()))  # JSON-able
        parts = description["parts"]
        assert [p["part"] for p in parts] == ["redis", "service", "service", "runtime", "runtime"]
        assert {p["node_id"] for p in parts if p["part"] == "runtime"} == runtime_node_ids()
        assert len(stack.service_urls) == 2 and len(stack.runtime_urls) == 2 and stack.token
        for part in parts:
            assert answers(part, stack.token), f"{part['name']} does not answer at {part['url']}"
            # Secrets reach the servers through their environment and stdin: `ps` shows none of them.
            assert stack.token not in Path(f"/proc/{part['pid']}/cmdline").read_text(), part["name"]
        headers = {"Authorization": f"Bearer {stack.token}"}
        for url in stack.service_urls:
            assert httpx.get(f"{url}/v1/status", headers=headers, timeout=10).status_code == 200
            assert httpx.get(f"{url}/v1/status", timeout=10).status_code == 401  # the token is asked
            wait_for(lambda url=url: registered(url, stack.token) == set(stack.runtime_urls), 60, "runtimes register")

        with pytest.raises(StackExists):
            RayStack.up(tokenizer=str(TINY_MODEL), namespace=NAMESPACE)
        assert RayStack.attach(NAMESPACE).describe() == stack.describe()

        # An actor that dies (as with its node) takes its server with it.
        runtime = parts[-1]
        ray.kill(ray.get_actor(runtime["name"], namespace=NAMESPACE))
        wait_for(lambda: gone(runtime["pid"]), 30, f"{runtime['name']} (pid {runtime['pid']}) dies with its actor")
        assert not RayStack.attach(NAMESPACE).status()["parts"][-1]["reachable"]
    finally:
        stopped = stack.down()
    assert {p["name"] for p in stopped} == {p["name"] for p in parts[:-1]}  # the killed one was gone already
    for part in parts:
        assert gone(part["pid"]), f"{part['name']} (pid {part['pid']}) outlived down()"
    assert not any(Path(p["log"]).exists() for p in stopped)  # a stopped part's folders go with it
    for folder in (Path(runtime["log"]).parent, Path(runtime["state_dir"])):  # a killed one's stay
        shutil.rmtree(folder, ignore_errors=True)
    wait_for(lambda: not named_actors(NAMESPACE), 30, "the stack's actors are gone")


def test_a_part_that_fails_takes_the_start_down_and_says_why(cluster):
    with pytest.raises(StackError) as failure:
        RayStack.up(
            tokenizer=str(TINY_MODEL),
            runtime_resource=RUNTIME_RESOURCE,
            namespace=NAMESPACE,
            service_args=["--no-such-flag"],
            timeout_s=START_S,
        )
    message = str(failure.value)
    assert "prorl-rollout-0 on node" in message and "exited with status 2" in message
    assert "--no-such-flag" in message  # the log's tail: argparse's complaint
    wait_for(lambda: not named_actors(NAMESPACE), 30, "the failed start's actors are gone")
    assert RECORD_NAME not in named_actors(NAMESPACE)  # so that the user can start again


@ray.remote(num_cpus=0)
class Worker:
    """Stands in for a verl agent loop worker: each starts the run's stack, or attaches to it."""

    def stack(self, namespace: str, runtime_node: str) -> dict:
        self.held = RayStack.up_or_attach(  # held, as the verl worker holds it: the stack lives while it does
            namespace, tokenizer=str(TINY_MODEL), runtime_nodes=[runtime_node], detached=False, timeout_s=START_S
        )
        return self.held.describe()


def test_racing_workers_share_one_stack_that_ends_with_them(cluster):
    namespace = "prorl-it-run"
    workers = [Worker.remote() for _ in range(3)]
    node = sorted(runtime_node_ids())[0]
    described = ray.get([w.stack.remote(namespace, node) for w in workers], timeout=START_S + 180)
    assert all(d == described[0] for d in described)  # one stack: the first to create its record started it
    parts = described[0]["parts"]
    assert [p["part"] for p in parts] == ["redis", "service", "runtime"]
    for worker in workers:  # the run ends: its workers go, and the stack, not detached, with them
        ray.kill(worker)
    for part in parts:
        wait_for(lambda part=part: gone(part["pid"]), 60, f"{part['name']} (pid {part['pid']}) ends with the run")
    wait_for(lambda: not named_actors(namespace), 30, "the run's stack actors are gone")
    for part in parts:  # killed, not stopped: their folders stay
        shutil.rmtree(Path(part["log"]).parent, ignore_errors=True)
        if part.get("state_dir"):
            shutil.rmtree(part["state_dir"], ignore_errors=True)
