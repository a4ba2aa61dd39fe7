"""Partitions: a part of the stack put behind a network link that the test cuts, the way a node vanishes from a real
cluster (no TCP reset: packets dropped, not refused), then restored.

The chaos suite (test_chaos.py) kills processes, and a killed process's peers hear of it at once (a reset, a
refused connection). Here the part runs in a network namespace of the test's own, joined to the host by a veth pair
(`netns.py`), and the cut sets the namespace's end down: requests in flight to it wait for answers that never
come, and new connections time out. Real processes throughout: bwrap runtimes under root, the rollout service,
the scripted LLM stand-in (`scripted_llm.py`, the tiny model's tokenizer).

- a registered sandbox runtime cut off while its episodes' tool calls (`sleep 600`, a 15-minute tool timeout) run:
  the service takes it for gone once its heartbeats have been silent SEVER_AFTER_S, ends the calls, and the
  episodes start again on the other runtime; once the link is back the runtime is used again, and the sandboxes
  left there meanwhile are deleted;
- an LLM server cut off mid-turn (a scripted answer that takes ten minutes): after SILENT_SERVER_S of failed
  health checks the turn is ended and answered by the other server;
- a replica of two (sharing one Redis) cut off from Redis, with its own runtime and LLM server beside it: it fences
  itself (its episodes stop) before the other replica takes its jobs and prompts over and runs them; once the link
  is back, the cut-off one learns at its next beat that it was taken over, and writes nothing of those jobs;
- a lone replica cut off from Redis: nobody can take it over, it runs its episodes to their end during the cut,
  and writes their results once the link is back.

The figures are printed (`-s`) and recorded in docs/reliability.md ("Partitions").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.hooks import hookimpl
from prorl_adapter.launch.process import free_port, listening_socket
from prorl_adapter.models import JobRequest, JobState, Trajectory
from prorl_adapter.service.llm import SILENT_SERVER_S
from prorl_adapter.service.sandboxes import SEVER_AFTER_S
from prorl_adapter.trainer.client import RolloutClient
from prorl_plugins.tasks.shell import ShellTask
from sandbox_runtime import procs
from sandbox_runtime.client import SandboxClient

from . import netns, scripted_llm
from .conftest import BACKEND_SKIPS, reachable, start_server
from .redis_server import REDIS_SERVER, REDIS_SKIP
from .scripted_llm import bash_call

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))]

LIVENESS_S = 180.0  # a bound on waiting for what must happen, never a measurement
EPISODES = 3  # episodes cut off at once, in (a) and (c)
PROMPTS = 2  # decoupled prompts cut off besides, in (c)
LONE_TOOL_S = 12  # the tool call in (d): longer than the short lease (5 s), shorter than a lone replica's (59 s)
SLEEP_ARGV = b"sleep\x00600\x00"  # their tool call, as its process's command line


@pytest.fixture(scope="module", autouse=True)
def namespaces_usable() -> None:
    """Skip the module where namespaces and links cannot be made (not root, no `ip netns`). Asked here, not at
    import: the services these tests start import this module as their plugin."""
    reason = netns.unusable()
    if reason:
        pytest.skip(reason)


class LongShellTask(ShellTask):
    """`shell` with a 15-minute tool timeout: a tool call that hangs behind a cut link must be ended by the partition's
    handling, and the test's liveness bound (minutes) tells that from the tool call's own timeout."""

    name = "long_shell"
    tool_timeout_s = 900.0


@hookimpl
def prorl_register_tasks():
    """This module is also a plugin of the services it starts (`--plugin integration_tests.test_partitions`)."""
    return [LongShellTask()]


# -- helpers --------------------------------------------------------------------------------------------------------
async def until(condition: Callable[[], Awaitable[bool]], timeout: float = LIVENESS_S, what: str = "it") -> float:
    """Poll `condition()` until it holds; the seconds it took. Fails the test past `timeout`."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what} did not hold within {timeout:g} s")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


def uid_block() -> tuple[range, range]:
    """Two blocks of 100 sandbox uids, one per runtime, apart from the defaults and from other runs of this test:
    a sandbox's uid tells the runtime it ran on, and the processes left at the end are counted per block."""
    first = 2_100_100_000 + 1000 * secrets.randbelow(10_000)
    return range(first, first + 100), range(first + 100, first + 200)


def uids_arg(uids: range) -> str:
    return f"{uids.start}-{uids.stop - 1}"


def processes_of(uids: range, argv: bytes | None = None) -> int:
    """Live processes running as one of `uids` (with the command line `argv`, NUL-separated, where given)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if (procs._real_uid(pid) or -1) not in uids or (procs._stat_fields(pid) or ["Z"])[0] == "Z":
            continue
        if argv is not None:
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() != argv:
                    continue
            except OSError:
                continue
        count += 1
    return count


def start_service(link: netns.Link, llm_urls: list[str], token: str, service_id: str, log: Path):
    """The rollout service on the host's end of the link (registered runtimes in the namespace reach it there): a
    non-loopback address, so with an API token. Runtimes register with localstack's registration token."""
    argv = [sys.executable, "-m", "prorl_adapter", "serve", "--listen-fd", "{listen_fd}"]
    argv += ["--tokenizer", str(localstack.TINY_MODEL), f"--token={token}", "--service-id", service_id]
    argv += [arg for url in llm_urls for arg in ("--llm-url", url)]
    argv += ["--plugin", __name__, "--log-level", "INFO"]
    return netns.start_bound(
        "rollout service",
        argv,
        "/healthz",
        listening_socket(link.host_address),
        log=log,
        env=localstack.REGISTRATION_ENV,
    )


async def alive_runtimes(url: str, token: str) -> set[str]:
    async with RolloutClient(url, token=token) as client:
        return {r.url for r in (await client.status()).runtimes if r.alive}


async def sandboxes_of(url: str, token: str | None, owner: str | None = None) -> list:
    async with SandboxClient(url, token=token, timeout=10) as client:
        boxes = await client.list_sandboxes()
    return [b for b in boxes if owner is None or b.labels.get("prorl_service") == owner]


async def eventually_none(url: str, token: str | None, seconds: float = 30.0) -> list:
    """The runtime's sandboxes once none is left, or what is left after `seconds` (deletes run late)."""
    deadline = time.monotonic() + seconds
    while (left := await sandboxes_of(url, token)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return left


async def llm_stats(url: str) -> dict[str, int]:
    """The scripted LLM's answers held now (`in_flight`) and given (`answered`)."""
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url + "/stats")).json()


async def _equals(value: Awaitable, expected) -> bool:
    return await value == expected


async def _sleeping(uids: range, count: int) -> bool:
    return processes_of(uids, SLEEP_ARGV) == count


async def _held(url: str, count: int) -> bool:
    return (await llm_stats(url))["in_flight"] == count


async def _alive_replicas(client: RolloutClient, expected: set[str]) -> bool:
    return {r.id for r in (await client.status()).replicas if r.alive} == expected


async def _told_of_others(client: RolloutClient, replica_id: str) -> bool:
    return any(r.id == replica_id and r.figures.get("others_alive") for r in (await client.status()).replicas)


async def _fences(client: RolloutClient, replica_id: str) -> int:
    return sum(r.figures.get("fences", 0) for r in (await client.status()).replicas if r.id == replica_id)


@pytest.fixture
def link() -> Iterator[netns.Link]:
    with netns.link() as made:
        yield made


class Parts:
    """Services a test started, stopped in reverse order at its end whatever happened (`kill`: at once, for a
    stand-in that holds answers: a clean stop would wait for them)."""

    def __init__(self) -> None:
        self.started: list[tuple[localstack.Service, bool]] = []

    def add(self, service: localstack.Service, kill: bool = False) -> localstack.Service:
        self.started.append((service, kill))
        return service

    def stop_all(self) -> None:
        for service, kill in reversed(self.started):
            with contextlib.suppress(Exception):
                if kill:
                    service.kill()
                else:
                    service.stop(timeout=30)


@pytest.fixture
def parts() -> Iterator[Parts]:
    made = Parts()
    try:
        yield made
    finally:
        made.stop_all()


# -- (a) a sandbox runtime behind the link ----------------------------------------------------------------------------
async def test_a_runtime_cut_off_mid_tool_call_loses_no_episode(link, parts, tmp_path):
    """Two registered runtimes, one in the namespace, which holds every episode (`sleep 600` there, an instant
    command on the other: a sandbox's uid says where it ran). Cut while the tool calls run: every episode ends done
    on the other runtime in its second attempt, each turn asked of the policy once; restored: the runtime beats
    again, what the service left there is deleted, and new sandboxes go there (it has the most room)."""
    ns_uids, host_uids = uid_block()
    stuck = f"u=$(id -u); if [ $u -lt {ns_uids.stop} ]; then sleep 600; fi; echo ran as $u"
    scripts = {"stuck": [bash_call(stuck)], "quick": [bash_call("echo ran as $(id -u)")]}
    (tmp_path / "llm").mkdir()
    llm = parts.add(scripted_llm.start(scripts, tmp_path / "llm"))
    token, owner = secrets.token_urlsafe(24), f"partition-{secrets.token_hex(3)}"
    service = parts.add(start_service(link, [llm.url], token, owner, tmp_path / "rollout.log"))

    # The runtime in the namespace registers first, alone: the episodes go there.
    ns_token = secrets.token_urlsafe(24)
    sock = link.listening_socket()
    ns_url = f"http://{link.ns_address}:{sock.getsockname()[1]}"
    argv = [*localstack.runtime_argv(reachable(tmp_path / "ns-state")), "--backend", "bwrap", f"--token={ns_token}"]
    argv += ["--register", service.url, "--advertise-url", ns_url]  # heartbeats every 2 s, the default
    argv += ["--sandbox-uids", uids_arg(ns_uids), "--max-sandboxes", "64", "--log-level", "INFO"]
    parts.add(
        netns.start_bound(
            "runtime in the namespace",
            argv,
            "/healthz",
            sock,
            inside=link,
            log=tmp_path / "ns-runtime.log",
            env=localstack.REGISTRATION_ENV,
        )
    )
    host_runtime = None
    figures: dict[str, object] = {"episodes": EPISODES}
    try:
        await until(
            lambda: _equals(alive_runtimes(service.url, token), {ns_url}), what="the namespaced runtime registered"
        )
        async with RolloutClient(service.url, token=token) as client:
            jobs = [
                await client.submit(
                    JobRequest(task="long_shell", instance={"goal": "[script:stuck]", "check": "true"}, max_turns=3)
                )
                for _ in range(EPISODES)
            ]
            ids = [job.job_id for job in jobs]

            await until(lambda: _sleeping(ns_uids, EPISODES), what=f"{EPISODES} tool calls running in the namespace")
            # Fewer sandboxes' room than the namespaced runtime's: once that one is back, new sandboxes go there.
            host_runtime = start_server(
                tmp_path / "host-state",
                "bwrap",
                secrets.token_urlsafe(24),
                "--register",
                service.url,
                "--sandbox-uids",
                uids_arg(host_uids),
                "--max-sandboxes",
                "16",
            )
            parts.add(host_runtime.service)
            both = {ns_url, host_runtime.url}
            await until(lambda: _equals(alive_runtimes(service.url, token), both), what="both runtimes registered")
            assert all(s.attempts == 1 and s.state is JobState.running for s in [await client.job(i) for i in ids])

            link.cut()
            cut_at = time.monotonic()
            restarted: dict[str, float] = {}
            finished: dict[str, float] = {}

            async def all_finished() -> bool:
                for job_id in ids:
                    status = await client.job(job_id)
                    now = round(time.monotonic() - cut_at, 1)
                    if status.attempts >= 2:
                        restarted.setdefault(job_id, now)
                    if status.state.finished:
                        finished.setdefault(job_id, now)
                return len(finished) == len(ids)

            await until(all_finished, what="every episode finished after the cut")
            results: list[Trajectory] = [await client.result(job_id, wait=30) for job_id in ids]
            statuses = [await client.job(job_id) for job_id in ids]
            cut_status = await client.status()
            figures.update(
                {
                    "severed after (SEVER_AFTER_S)": SEVER_AFTER_S,
                    "seconds from the cut to each episode restarted": sorted(restarted.values()),
                    "seconds from the cut to each episode done": sorted(finished.values()),
                    "attempts": [s.attempts for s in statuses],
                }
            )

            # Every episode done, once, on the host's runtime, in its second attempt: its first ended by the cut
            # (the 15-minute tool timeout was never reached), none run a third time.
            assert [s.state for s in statuses] == [JobState.done] * EPISODES, [s.error for s in statuses]
            assert [s.attempts for s in statuses] == [2] * EPISODES
            for result in results:
                assert result.error is None and not result.filter and result.reward == 1.0
                assert result.num_turns == 2 and [t.tool_calls[0].name for t in result.turns] == ["bash", "finish"]
                ran_as = int(result.turns[0].observation.split()[2])
                assert ran_as in host_uids, result.turns[0].observation
            assert cut_status.finished.get("done") == EPISODES and not cut_status.finished.get("failed")
            # The policy was asked once per turn: the lost attempts' first turns, the reruns' two each.
            assert (await llm_stats(llm.url))["answered"] == 3 * EPISODES
            assert not any(r.alive or r.placed for r in cut_status.runtimes if r.url == ns_url)
            # Their sandboxes are still there: the runtime never heard of a delete (the tool calls still run).
            assert processes_of(ns_uids, SLEEP_ARGV) == EPISODES

            # The link back: the runtime beats again, what this service left there is deleted, and it is used again.
            link.restore()
            restored_at = time.monotonic()

            async def ns_clean_and_alive() -> bool:
                if ns_url not in await alive_runtimes(service.url, token):
                    return False
                return not await sandboxes_of(ns_url, ns_token, owner) and processes_of(ns_uids, SLEEP_ARGV) == 0

            await until(ns_clean_and_alive, what="the namespaced runtime back, and the leftovers there deleted")
            figures["seconds from the restore to the runtime used again, its leftovers deleted"] = round(
                time.monotonic() - restored_at, 1
            )
            again = [
                await client.run(JobRequest(task="shell", instance={"goal": "[script:quick]", "check": "true"}), 120)
                for _ in range(2)
            ]
            assert [r.error for r in again] == [None, None]
            assert all(int(r.turns[0].observation.split()[2]) in ns_uids for r in again), [
                r.turns[0].observation for r in again
            ]
    finally:
        if link.cut_now:
            link.restore()  # the leak check below reaches the namespaced runtime
        left = {}
        with contextlib.suppress(Exception):
            left["namespaced runtime"] = await eventually_none(ns_url, ns_token)
        if host_runtime is not None:
            with contextlib.suppress(Exception):
                left["host runtime"] = await eventually_none(host_runtime.url, host_runtime.token)
        figures["sandboxes left"] = {name: len(boxes) for name, boxes in left.items()}
        figures["sandbox processes left"] = processes_of(ns_uids) + processes_of(host_uids)
        print("\nruntime partition figures:", json.dumps(figures, indent=1))
    assert figures["sandboxes left"] == {"namespaced runtime": 0, "host runtime": 0}
    assert figures["sandbox processes left"] == 0


# -- (b) an LLM server behind the link --------------------------------------------------------------------------------
LLM_EPISODES = 2


async def test_an_llm_server_cut_off_mid_turn_hands_the_turn_to_another(link, parts, tmp_path):
    """Two scripted LLM servers with the same script, the far one in the namespace and holding its answers ten
    minutes. Cut while every episode's first turn waits there: the turns are ended once the far server has failed
    its health checks SILENT_SERVER_S and answered by the near one; the episodes are done and correct. Restored:
    the far server is healthy again."""
    scripts = {"talk": [bash_call("echo hello")]}
    (tmp_path / "far").mkdir()
    (tmp_path / "near").mkdir()
    # The server in the namespace holds every answer ten minutes: the cut finds the turn in flight there.
    far = parts.add(
        netns.start_bound(
            "scripted LLM in the namespace",
            scripted_llm.command(scripts, tmp_path / "far", delay_s=600),
            "/v1/models",
            link.listening_socket(),
            inside=link,
            log=tmp_path / "far-llm.log",
        ),
        kill=True,
    )
    near = parts.add(scripted_llm.start(scripts, tmp_path / "near"))
    uids, _ = uid_block()
    runtime = start_server(tmp_path / "state", "bwrap", None, "--sandbox-uids", uids_arg(uids))
    parts.add(runtime.service)
    # Only the far server at first: each new episode goes to the healthy server with the fewest requests in flight.
    service = parts.add(localstack.start_rollout_service([runtime.url], [far.url], log=tmp_path / "rollout.log"))
    figures: dict[str, object] = {"episodes": LLM_EPISODES, "silent server (SILENT_SERVER_S)": SILENT_SERVER_S}
    try:
        async with RolloutClient(service.url) as client:
            request = JobRequest(task="shell", instance={"goal": "[script:talk]", "check": "true"}, max_turns=3)
            ids = [(await client.submit(request)).job_id for _ in range(LLM_EPISODES)]
            await until(lambda: _held(far.url, LLM_EPISODES), what="every first turn in flight at the far server")
            await client.add_llm_server(near.url)

            link.cut()
            cut_at = time.monotonic()
            done_after: list[float] = []

            async def result(job_id: str) -> Trajectory:
                trajectory = await client.result(job_id, wait=LIVENESS_S)
                done_after.append(round(time.monotonic() - cut_at, 1))
                return trajectory

            results = await asyncio.wait_for(asyncio.gather(*map(result, ids)), LIVENESS_S)
            figures["seconds from the cut to each episode done"] = sorted(done_after)
            servers = {s.url: s for s in await client.llm_servers()}
            figures["far server"] = servers[far.url].model_dump()
            figures["near server"] = servers[near.url].model_dump()

            # Each episode done and correct, every turn answered by the near server: the far one's turn was ended,
            # not lost into a failed episode, nor waited for until the job's budget (30 minutes) ran out.
            for result in results:
                assert result.error is None and not result.filter and result.reward == 1.0, result.error
                assert result.num_turns == 2 and [t.tool_calls[0].name for t in result.turns] == ["bash", "finish"]
                assert result.turns[0].tool_calls[0].arguments == {"command": "echo hello"}
                assert result.turns[0].observation == "hello\n[exit code 0]"
                assert {t.llm_server for t in result.turns} == {near.url}
            assert (await llm_stats(near.url))["answered"] == 2 * LLM_EPISODES
            assert not servers[far.url].healthy and servers[far.url].failures >= LLM_EPISODES

            link.restore()
            restored_at = time.monotonic()

            async def far_healthy() -> bool:
                return any(s.url == far.url and s.healthy for s in await client.llm_servers())

            await until(far_healthy, what="the far server healthy again once the link is back")
            figures["seconds from the restore to the far server healthy"] = round(time.monotonic() - restored_at, 1)
    finally:
        if link.cut_now:
            link.restore()
        async with runtime.client() as sandboxes:
            deadline = time.monotonic() + 30
            while (left := await sandboxes.list_sandboxes()) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        figures["sandboxes left"] = len(left)
        figures["sandbox processes left"] = processes_of(uids)
        print("\nLLM partition figures:", json.dumps(figures, indent=1))
    assert figures["sandboxes left"] == 0 and figures["sandbox processes left"] == 0


# -- (c) Redis behind the link, for one replica of two ----------------------------------------------------------------
def start_redis(workdir: Path, link: netns.Link) -> localstack.Service:
    """redis-server on loopback and on the host's end of the link, where the replica in the namespace reaches it."""
    import redis

    port = free_port()
    argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", link.host_address, "--protected-mode", "no"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / "redis.log")]
    process = subprocess.Popen(argv, cwd=workdir, stdin=subprocess.DEVNULL, start_new_session=True)
    server = localstack.Service("redis-server", f"redis://127.0.0.1:{port}/0", process)
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    try:
        while True:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                if client.ping():
                    return server
            if process.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"redis-server did not answer PING: {(workdir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)  # polling a starting process
    finally:
        client.close()


@dataclass
class NamespacedReplica:
    """A replica of the service in the link's namespace, with its own LLM server and runtime there: cut off from
    Redis, it can still run what it holds."""

    service: localstack.Service
    llm: localstack.Service
    runtime: localstack.Service
    token: str
    runtime_token: str

    @property
    def url(self) -> str:
        return self.service.url


def replica_in_namespace(
    link: netns.Link, parts: Parts, tmp_path: Path, scripts: dict, uids: range, redis: localstack.Service, name: str
) -> NamespacedReplica:
    token, runtime_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    (tmp_path / f"{name}-llm").mkdir()
    llm = parts.add(
        netns.start_bound(
            "scripted LLM in the namespace",
            scripted_llm.command(scripts, tmp_path / f"{name}-llm"),
            "/v1/models",
            link.listening_socket(),
            inside=link,
        )
    )
    argv = [*localstack.runtime_argv(reachable(tmp_path / f"{name}-state")), "--backend", "bwrap"]
    # `--flag=value`: a random token may begin with "-", which argparse would take for a flag.
    argv += [f"--token={runtime_token}", "--sandbox-uids", uids_arg(uids), "--log-level", "WARNING"]
    runtime = parts.add(
        netns.start_bound("runtime in the namespace", argv, "/healthz", link.listening_socket(), inside=link)
    )
    redis_port = redis.url.rsplit(":", 1)[1].split("/")[0]
    argv = [sys.executable, "-m", "prorl_adapter", "serve", "--listen-fd", "{listen_fd}"]
    argv += ["--tokenizer", str(localstack.TINY_MODEL), f"--token={token}", "--service-id", name]
    argv += ["--buffer", f"redis://{link.host_address}:{redis_port}/0", "--llm-url", llm.url]
    argv += ["--sandbox-url", runtime.url, f"--sandbox-token={runtime_token}", "--plugin", __name__]
    service = parts.add(
        netns.start_bound(
            "replica in the namespace",
            [*argv, "--log-level", "INFO"],
            "/healthz",
            link.listening_socket(),
            inside=link,
            log=tmp_path / f"{name}.log",
        )
    )
    return NamespacedReplica(service, llm, runtime, token, runtime_token)


async def test_a_replica_cut_off_from_redis_is_taken_over_and_drops_what_it_held(link, parts, tmp_path):
    """Two replicas on one Redis; the one in the namespace, with its own runtime and LLM server there, holds every
    job (`sleep 600` at its runtime, an instant command at the other's). Cut: the cut-off replica fences itself
    (its episodes end, their sandboxes go) before the other may take it over; the other takes it over and runs
    the jobs, so no job runs at both at once. Restored: the cut-off replica learns at its next beat that it was
    taken over and acts again, writing nothing of those jobs, and every replica answers each job with the
    survivor's result."""
    if REDIS_SKIP:
        pytest.skip(REDIS_SKIP)
    cut_uids, survivor_uids = uid_block()
    stuck = f"u=$(id -u); if [ $u -lt {cut_uids.stop} ]; then sleep 600; fi; echo ran as $u"
    scripts = {"stuck": [bash_call(stuck)]}
    for name in ("redis", "survivor-llm"):
        (tmp_path / name).mkdir()
    redis = parts.add(start_redis(tmp_path / "redis", link))

    # The replica in the namespace, with its own LLM server and runtime there: cut off from Redis (and the other
    # replica), it can still run what it holds.
    cut_id, survivor_id = f"cut-{secrets.token_hex(3)}", f"survivor-{secrets.token_hex(3)}"
    cut = replica_in_namespace(link, parts, tmp_path, scripts, cut_uids, redis, cut_id)
    cut_llm, cut_runtime, token, runtime_token = cut.llm, cut.runtime, cut.token, cut.runtime_token
    survivor = runtime = None
    figures: dict[str, object] = {"episodes": EPISODES}
    try:
        async with RolloutClient(cut.url, token=token) as client:
            request = JobRequest(task="long_shell", instance={"goal": "[script:stuck]", "check": "true"}, max_turns=3)
            ids = [(await client.submit(request)).job_id for _ in range(EPISODES)]
            # Decoupled prompts besides the jobs: each must reach the buffer exactly once.
            prompt_ids = [f"prompt-{i}" for i in range(PROMPTS)]
            await client.enqueue_prompts([request.model_copy(update={"job_id": i}) for i in prompt_ids])
            await until(
                lambda: _sleeping(cut_uids, EPISODES + PROMPTS), what="every episode's tool call running at the replica"
            )
            assert {(await client.job(i)).replica for i in ids} == {cut_id}

        # The survivor starts once the other holds every job: it takes them only by taking that replica over.
        survivor_llm = parts.add(scripted_llm.start(scripts, tmp_path / "survivor-llm"))
        runtime = start_server(tmp_path / "survivor-state", "bwrap", None, "--sandbox-uids", uids_arg(survivor_uids))
        parts.add(runtime.service)
        survivor = parts.add(
            localstack.start_rollout_service(
                [runtime.url],
                [survivor_llm.url],
                *("--buffer", redis.url, "--service-id", survivor_id, "--plugin", __name__),
                log=tmp_path / "survivor.log",
            )
        )
        async with RolloutClient(survivor.url) as client:
            both = {cut_id, survivor_id}
            await until(lambda: _alive_replicas(client, both), what="both replicas beating")
            # ...and the one to be cut off told of the other by a beat: its lease is the short one (replica.py).
            await until(lambda: _told_of_others(client, cut_id), what="the replica told of the other")

            link.cut()
            cut_at = time.monotonic()
            taken_over_at: float | None = None
            fenced_at: float | None = None
            running_at_takeover: int | None = None
            finished: dict[str, float] = {}

            async def all_finished() -> bool:
                nonlocal taken_over_at, fenced_at, running_at_takeover
                if fenced_at is None and processes_of(cut_uids, SLEEP_ARGV) == 0:
                    fenced_at = round(time.monotonic() - cut_at, 1)
                if taken_over_at is None and cut_id not in {r.id for r in (await client.status()).replicas}:
                    taken_over_at = round(time.monotonic() - cut_at, 1)  # forgotten once taken over
                    running_at_takeover = processes_of(cut_uids, SLEEP_ARGV)
                for job_id in ids:
                    if (await client.job(job_id)).state.finished:
                        finished.setdefault(job_id, round(time.monotonic() - cut_at, 1))
                return len(finished) == len(ids)

            await until(all_finished, what="every job finished at the survivor")
            still_running = processes_of(cut_uids, SLEEP_ARGV)
            figures.update(
                {
                    "seconds from the cut to the cut-off replica's tool calls ended by its fence": fenced_at,
                    "seconds from the cut to the takeover": taken_over_at,
                    "tool calls the cut-off replica still ran when it was taken over": running_at_takeover,
                    "seconds from the cut to each job done at the survivor": sorted(finished.values()),
                    "tool calls the cut-off replica still ran when the survivor had finished every job": still_running,
                }
            )
            # Fenced before the takeover: no job's tool call ran at both replicas at once.
            assert running_at_takeover == 0 and still_running == 0, figures
            # The prompts ran at the survivor, and reached the buffer once each.
            delivered: list[Trajectory] = []

            async def all_delivered() -> bool:
                batch = (await client.take_batch(PROMPTS, timeout=1)).items
                delivered.extend(item.trajectory for item in batch)
                await client.ack([item.id for item in batch])
                return len(delivered) >= PROMPTS

            await until(all_delivered, what="every prompt's trajectory in the buffer")
            assert sorted(t.job_id for t in delivered) == prompt_ids
            assert all(t.error is None and t.reward == 1.0 and t.num_turns == 2 for t in delivered)
            statuses = [await client.job(job_id) for job_id in ids]
            results = [await client.result(job_id, wait=30) for job_id in ids]
            assert [(s.state, s.replica) for s in statuses] == [(JobState.done, survivor_id)] * EPISODES
            for result in results:
                assert result.error is None and result.reward == 1.0 and result.num_turns == 2
                assert int(result.turns[0].observation.split()[2]) in survivor_uids, result.turns[0].observation

            link.restore()
            restored_at = time.monotonic()

            # Back in touch, the cut-off replica learns at its next beat that it was taken over, and acts again:
            # it runs nothing of those jobs, and writes nothing of them.
            async with RolloutClient(cut.url, token=token) as cut_client:
                await until(lambda: _alive_replicas(client, both), what="the cut-off replica beating again")
                figures["seconds from the restore to the cut-off replica beating again"] = round(
                    time.monotonic() - restored_at, 1
                )
                # Its figures travel with its beats: the fence shows from a beat sent after it.
                await until(lambda: _fences(cut_client, cut_id), what="the fence in the cut-off replica's figures")
                cut_status = await cut_client.status()
                assert not any(cut_status.active.values()) and processes_of(cut_uids) == 0
                [fences] = [r.figures["fences"] for r in cut_status.replicas if r.id == cut_id]
                assert fences == 1, cut_status.replicas
                # Nothing of the prompts came from the cut-off replica once back: each is in the buffer once.
                buffer = await client.buffer()
                assert (buffer.ready, buffer.pending, buffer.acked) == (0, 0, PROMPTS), buffer
                for reader in (client, cut_client):  # every replica answers the same: the survivor's results
                    assert [(s.state, s.replica) for s in [await reader.job(i) for i in ids]] == [
                        (JobState.done, survivor_id)
                    ] * EPISODES
                    again = [await reader.result(job_id, wait=30) for job_id in ids]
                    assert [r.model_dump() for r in again] == [r.model_dump() for r in results]
            # The policy was asked the first turn of each job at the cut-off replica, and both turns at the survivor.
            assert (await llm_stats(cut_llm.url))["answered"] == EPISODES + PROMPTS
            assert (await llm_stats(survivor_llm.url))["answered"] == 2 * (EPISODES + PROMPTS)
    finally:
        if link.cut_now:
            link.restore()
        left = {}
        with contextlib.suppress(Exception):
            left["cut-off replica's runtime"] = await eventually_none(cut_runtime.url, runtime_token)
        if runtime is not None:
            with contextlib.suppress(Exception):
                left["survivor's runtime"] = await eventually_none(runtime.url, None)
        figures["sandboxes left"] = {name: len(boxes) for name, boxes in left.items()}
        figures["sandbox processes left"] = processes_of(cut_uids) + processes_of(survivor_uids)
        print("\nRedis partition figures:", json.dumps(figures, indent=1))
    assert figures["sandboxes left"] == {"cut-off replica's runtime": 0, "survivor's runtime": 0}
    assert figures["sandbox processes left"] == 0


def results_in_redis(url: str, ids: list[str]) -> int:
    """How many of the jobs have their result recorded in Redis (redis_job_board.py's keys)."""
    import redis

    with redis.Redis.from_url(url) as client:
        return sum(client.hexists(f"prorl:jobs:job:{job_id}", "result") for job_id in ids)


# -- (d) a lone replica behind the link --------------------------------------------------------------------------------
async def test_a_lone_replica_cut_off_from_redis_runs_on_and_writes_its_results_once_back(link, parts, tmp_path):
    """One replica on Redis, with its own runtime and LLM server in the namespace, holding every job in a tool call
    that outlasts the short lease (5 s). Alone at its last beat, nobody can take it over but a replica started
    since, and only after ALONE_MISSED_BEATS: it does not fence itself, its episodes run to their end during the
    cut, and once the link is back it writes their results, each job done once."""
    if REDIS_SKIP:
        pytest.skip(REDIS_SKIP)
    uids, _ = uid_block()
    scripts = {"slow": [bash_call(f"sleep {LONE_TOOL_S}; echo ran as $(id -u)")]}
    (tmp_path / "redis").mkdir()
    redis = parts.add(start_redis(tmp_path / "redis", link))
    name = f"lone-{secrets.token_hex(3)}"
    replica = replica_in_namespace(link, parts, tmp_path, scripts, uids, redis, name)
    sleeping = f"sleep\x00{LONE_TOOL_S}\x00".encode()
    figures: dict[str, object] = {"episodes": EPISODES}
    async with RolloutClient(replica.url, token=replica.token) as client:
        request = JobRequest(task="long_shell", instance={"goal": "[script:slow]", "check": "true"}, max_turns=3)
        ids = [(await client.submit(request)).job_id for _ in range(EPISODES)]
        await until(lambda: _equals(asyncio.to_thread(processes_of, uids, sleeping), EPISODES), what="the tool calls")

        link.cut()
        cut_at = time.monotonic()
        try:
            # Each episode runs to its end at the replica (its runtime and LLM server are in the namespace with it)
            # and its sandbox is deleted: no process of its uids is left.
            await until(lambda: _equals(asyncio.to_thread(processes_of, uids), 0), what="every episode ended")
            figures["seconds from the cut to every episode ended, cut off"] = round(time.monotonic() - cut_at, 1)
        finally:
            link.restore()
        restored_at = time.monotonic()

        # Written to Redis (where every replica reads them), not only kept in the replica's memory.
        await until(lambda: _equals(asyncio.to_thread(results_in_redis, redis.url, ids), len(ids)), what="results")
        figures["seconds from the restore to every result in Redis"] = round(time.monotonic() - restored_at, 1)
        results = [await client.result(job_id, wait=60) for job_id in ids]
        print("\nLone replica partition figures:", json.dumps(figures, indent=1))
        # The cut outlasted a beat's bound (3 intervals, past the short lease): the replica gave beats up, and ran on.
        assert f"replica {name} cannot beat" in (tmp_path / f"{name}.log").read_text()
        for result in results:
            assert result.error is None and result.reward == 1.0 and result.num_turns == 2
        assert [(s.state, s.replica) for s in [await client.job(i) for i in ids]] == [(JobState.done, name)] * EPISODES
        [me] = [r for r in (await client.status()).replicas if r.id == name]
        assert me.figures["fences"] == 0
        assert (await llm_stats(replica.llm.url))["answered"] == 2 * EPISODES
    assert await eventually_none(replica.runtime.url, replica.runtime_token) == []
