"""The rollout stack on a running Ray cluster: Redis, N rollout service replicas, one sandbox runtime per node.

Each part is a small actor pinned to its node (`NodeAffinitySchedulingStrategy(soft=False)`, no CPU asked) that
starts one server process there, on a free port of the node's address, waits until it answers and reports its
URL (`process.ServerProcess`: the process dies with the actor). The parts start in order, Redis, the replicas,
then the runtimes, which register themselves with every replica, so nothing is configured twice.

The stack is named: a record actor `prorl-stack` in the stack's namespace holds what runs where, and is created
before anything starts, so it is also the lock: of several drivers (verl's agent loop workers) starting a
stack in one namespace, the first creates it and the others wait and attach. With `detached=True` (the CLI)
the actors outlive the driver until `RayStack.attach(namespace).down()`; without (verl), they end with the
`RayStack` object that started them (Ray collects an actor no handle refers to, named or not), and so with
the process that holds it.

This module is the only one of the project that imports Ray.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from server_kit.errors import ProrlError

from . import commands
from .commands import REDIS, RUNTIME, SERVICE
from .process import (
    PartFailed,
    ServerProcess,
    free_port,
    fresh_dir,
    http_ready,
    listening_socket,
    redis_ready,
    remove_dirs,
)

RECORD_NAME = "prorl-stack"
PART_PREFIX = "prorl-"
DEFAULT_NAMESPACE = "prorl"
STARTING, UP, FAILED = "starting", "up", "failed"


class StackError(ProrlError, RuntimeError):
    """The stack could not start, or is not there; the message says which part and why."""


class StackExists(StackError):
    """A stack (or its start) is already recorded in the namespace."""


class NoStack(StackError):
    """No stack is recorded in the namespace."""


# -- the actors ----------------------------------------------------------------------------------------------
@ray.remote(num_cpus=0, max_restarts=0)
class PartActor:
    """One part on its node: starts its server process, says where it is, stops it. A plain (one-threaded)
    actor: the process's death signal follows the thread that started it, and that thread lives as long as
    the actor."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name
        self.server: ServerProcess | None = None
        self.info: dict[str, Any] = {"part": part, "name": name}
        self.workdir: Path | None = None
        self.state_dir: Path | None = None

    def start(self, params: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        ip, node_id = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        self.workdir = fresh_dir(f"{self.name}-")
        # Our servers are handed their socket bound (no other process can take the port first); Redis binds its own.
        listener = None if self.part == REDIS else listening_socket(ip)
        port = listener.getsockname()[1] if listener else free_port(ip)
        self.info |= {"node_id": node_id, "ip": ip, "port": port, "log": str(self.workdir / "log")}
        try:
            argv, env, stdin, ready, url = self._command(ip, port, params, listener and listener.fileno())
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        log = self.workdir / "log"
        self.server = ServerProcess(self.name, argv, log, env=env, stdin_text=stdin, listener=listener).start()
        self.info |= {"url": url, "pid": self.server.pid}
        where = f" on node {node_id} ({ip})"
        self.server.wait_ready(ready, f"{'PING' if self.part == REDIS else 'GET /healthz'} at {url}", timeout_s, where)
        return dict(self.info)

    def _command(self, ip: str, port: int, params: dict[str, Any], listen_fd: int | None):
        token = params["token"]
        if self.part == REDIS:
            binary = shutil.which("redis-server")
            if binary is None:
                raise PartFailed(
                    f"{self.name}: redis-server is not installed on node {ip}; install it or give a redis URL"
                )
            url = commands.redis_url(ip, port, token)
            argv = commands.redis_argv(binary, ip, port)
            return argv, {}, commands.redis_config(token), redis_ready(ip, port, token), url
        url = commands.http_url(ip, port)
        if self.part == SERVICE:
            service = dict(params["service"])
            env = commands.service_env(token, service.pop("buffer_url"))
            argv = commands.service_argv(sys.executable, ip, port, listen_fd=listen_fd, **service)
        else:
            self.state_dir = fresh_dir("prorl-runtime-state-", 0o711)  # the sandboxes' uids traverse it
            self.info["state_dir"] = str(self.state_dir)
            env = commands.runtime_env(token)
            runtime = params["runtime"]
            argv = commands.runtime_argv(
                sys.executable, ip, port, state_dir=self.state_dir, listen_fd=listen_fd, **runtime
            )
        return argv, env, None, http_ready(url + "/healthz"), url

    def describe(self) -> dict[str, Any]:
        server = self.server
        return {**self.info, "running": bool(server and server.running), "returncode": server and server.returncode}

    def stop(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """SIGTERM to the process group, a wait, SIGKILL; then its folders go."""
        returncode = self.server.stop(timeout_s) if self.server else None
        remove_dirs(self.workdir, self.state_dir)
        return {**self.info, "running": False, "returncode": returncode}


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=16)
class StackRecord:
    """What the stack is: its status, the names of its part actors (recorded before each starts, so that a
    failed or abandoned start can still be taken down) and, once up, its description."""

    def __init__(self, namespace: str) -> None:
        self.state: dict[str, Any] = {"namespace": namespace, "status": STARTING, "parts": [], "error": None}

    def add_parts(self, names: list[str]) -> None:
        self.state["parts"] += [n for n in names if n not in self.state["parts"]]

    def finish(self, status: str, description: dict[str, Any] | None = None, error: str | None = None) -> None:
        self.state |= {"status": status, "description": description, "error": error}

    def get(self) -> dict[str, Any]:
        return dict(self.state)


# -- the stack -----------------------------------------------------------------------------------------------
def _require_ray() -> None:
    if not ray.is_initialized():
        raise StackError("not connected to a Ray cluster: call ray.init(address=...) first")


def _actor(name: str, namespace: str):
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _error(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the actor's own exception
    return str(cause if isinstance(cause, Exception) else exc)


@dataclass(frozen=True)
class _Settings:
    """What every part of one start is given."""

    token: str
    tokenizer: str
    llm_urls: list[str]
    redis_url: str | None  # None: start one
    service_args: list[str]
    runtime_args: list[str]
    lifetime: str | None  # "detached", or None: the actors end with the process that started them
    timeout_s: float


@dataclass
class _Part:
    name: str
    part: str
    node_id: str
    params: dict[str, Any]


class RayStack:
    """A stack in one namespace; `up` starts one, `attach` finds the one another driver started."""

    def __init__(self, namespace: str, record, description: dict[str, Any] | None = None) -> None:
        self.namespace = namespace
        self.record = record
        self.description = description or {}
        self.actors: list[Any] = []  # the handles of the parts this object started: they keep them alive

    # -- what it is
    @property
    def token(self) -> str:
        return self.description["token"]

    @property
    def redis_url(self) -> str:
        return self.description["redis_url"]

    @property
    def service_urls(self) -> list[str]:
        return list(self.description["service_urls"])

    @property
    def runtime_urls(self) -> list[str]:
        return list(self.description["runtime_urls"])

    def describe(self) -> dict[str, Any]:
        """JSON-able: the namespace, token, URLs, and per part its node, address, pid and log."""
        return dict(self.description)

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The description, with each part as its actor sees it now (`running`, `returncode`), or
        `reachable: false` where the actor is gone (its node died)."""
        parts = []
        for part in self.description.get("parts", []):
            parts.append(self._live(part, timeout_s))
        return {**self.description, "parts": parts}

    def _live(self, part: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        actor = _actor(part["name"], self.namespace)
        try:
            return {**ray.get(actor.describe.remote(), timeout=timeout_s), "reachable": True}
        except (RayActorError, GetTimeoutError, AttributeError):  # AttributeError: no such actor (None)
            return {**part, "reachable": False, "running": None}

    # -- starting
    @classmethod
    def up(
        cls,
        *,
        tokenizer: str,
        llm_urls: Sequence[str] = (),
        replicas: int = 1,
        runtime_resource: str | None = None,
        runtime_nodes: Sequence[str] | None = None,
        runtime_label: str | None = None,
        service_nodes: Sequence[str] | None = None,
        redis_url: str | None = None,
        token: str | None = None,
        service_args: Sequence[str] = (),
        runtime_args: Sequence[str] = (),
        namespace: str = DEFAULT_NAMESPACE,
        detached: bool = True,
        timeout_s: float = 300.0,
    ) -> RayStack:
        """Start the stack; `StackExists` if the namespace has one. A part that fails takes the whole start
        down with it, and the error names the part, its node and its log's tail."""
        _require_ray()
        try:
            placement = commands.place(
                ray.nodes(),
                replicas=replicas,
                with_redis=redis_url is None,
                service_nodes=service_nodes,
                runtime_resource=runtime_resource,
                runtime_node_ids=runtime_nodes,
                runtime_label=runtime_label,
            )
        except commands.PlacementError as exc:
            raise StackError(str(exc)) from exc
        lifetime = "detached" if detached else None
        try:
            record = StackRecord.options(name=RECORD_NAME, namespace=namespace, lifetime=lifetime).remote(namespace)
        except ValueError as exc:  # the name is taken: another driver started (or is starting) one here
            raise StackExists(f"a rollout stack is already recorded in Ray namespace {namespace!r}") from exc
        stack = cls(namespace, record)
        settings = _Settings(
            token=token or secrets.token_urlsafe(32),
            tokenizer=tokenizer,
            llm_urls=list(llm_urls),
            redis_url=redis_url,
            service_args=list(service_args),
            runtime_args=list(runtime_args),
            lifetime=lifetime,
            timeout_s=timeout_s,
        )
        try:
            stack._start(placement, settings)
        except BaseException as exc:
            stack._abandon(exc, detached)
            if isinstance(exc, Exception):
                raise StackError(f"the rollout stack in namespace {namespace!r} did not start: {_error(exc)}") from exc
            raise
        ray.get(record.finish.remote(UP, description=stack.description))
        return stack

    def _abandon(self, exc: BaseException, detached: bool) -> None:
        """A failed start: say why in the record (for the drivers waiting on it), stop what started, and free
        the name where the user will start again (detached); a verl run that failed ends with its owner."""
        ray.get(self.record.finish.remote(FAILED, error=_error(exc)))
        self._stop_parts()
        if detached:
            ray.kill(self.record)

    def _start(self, placement: commands.Placement, settings: _Settings) -> None:
        """Redis, then the replicas (they need its URL), then the runtimes (they need the replicas' URLs)."""
        parts: list[dict[str, Any]] = []
        redis_url = settings.redis_url
        if redis_url is None:
            (redis,) = self._start_parts([_Part(f"{PART_PREFIX}redis", REDIS, placement.redis, {})], settings)
            parts.append(redis)
            redis_url = redis["url"]
        service = {"buffer_url": redis_url, "tokenizer": settings.tokenizer, "llm_urls": settings.llm_urls}
        service["extra"] = settings.service_args
        replicas = [
            _Part(commands.service_id(i), SERVICE, node, {"service": {**service, "index": i}})
            for i, node in enumerate(placement.services)
        ]
        services = self._start_parts(replicas, settings)
        runtime = {"service_urls": [s["url"] for s in services], "extra": settings.runtime_args}
        on_nodes = [
            _Part(f"{PART_PREFIX}runtime-{n[:12]}", RUNTIME, n, {"runtime": runtime}) for n in placement.runtimes
        ]
        runtimes = self._start_parts(on_nodes, settings)
        self.description = {
            "namespace": self.namespace,
            "token": settings.token,
            "redis_url": redis_url,
            "service_urls": [s["url"] for s in services],
            "runtime_urls": [r["url"] for r in runtimes],
            "parts": [*parts, *services, *runtimes],
        }

    def _start_parts(self, parts: list[_Part], settings: _Settings) -> list[dict[str, Any]]:
        """Create the parts' actors (recorded first), then start them all at once and wait for every one."""
        ray.get(self.record.add_parts.remote([p.name for p in parts]))
        actors = [
            PartActor.options(
                name=p.name,
                namespace=self.namespace,
                lifetime=settings.lifetime,
                scheduling_strategy=NodeAffinitySchedulingStrategy(p.node_id, soft=False),
            ).remote(p.part, p.name)
            for p in parts
        ]
        self.actors += actors
        starts = [
            a.start.remote({"token": settings.token, **p.params}, settings.timeout_s) for a, p in zip(actors, parts)
        ]
        wait_s = settings.timeout_s + 120  # and the time to place the actors and start their workers
        try:
            return ray.get(starts, timeout=wait_s)
        except GetTimeoutError as exc:
            names = ", ".join(p.name for p in parts)
            raise StackError(f"{names} did not start within {wait_s:g} s(could Ray place them?)") from exc

    # -- attaching
    @classmethod
    def attach(cls, namespace: str = DEFAULT_NAMESPACE, wait_s: float = 0.0) -> RayStack:
        """The stack recorded in `namespace`; with `wait_s`, wait that long for one that is still starting."""
        _require_ray()
        record = _actor(RECORD_NAME, namespace)
        if record is None:
            raise NoStack(f"no rollout stack in Ray namespace {namespace!r} (`prorl-rollout ray up` starts one)")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                state = ray.get(record.get.remote())
            except RayActorError as exc:
                raise NoStack(f"the rollout stack in namespace {namespace!r} went away while starting") from exc
            if state["status"] == UP:
                return cls(namespace, record, state["description"])
            if state["status"] == FAILED:
                raise StackError(f"the rollout stack in namespace {namespace!r} failed to start: {state['error']}")
            if time.monotonic() > deadline:
                return cls(namespace, record, {"namespace": namespace, "status": state["status"], "parts": []})
            time.sleep(0.5)  # polling another driver's start

    @classmethod
    def up_or_attach(cls, namespace: str = DEFAULT_NAMESPACE, wait_s: float = 600.0, **up: Any) -> RayStack:
        """Start the stack, or, where another driver won the race to start it, wait for that one."""
        try:
            return cls.up(namespace=namespace, **up)
        except StackExists:
            pass  # another driver is starting it
        stack = cls.attach(namespace, wait_s=wait_s)
        if not stack.description.get("service_urls"):
            raise StackError(f"the rollout stack in namespace {namespace!r} did not come up within {wait_s:g} s")
        return stack

    # -- taking it down
    def down(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Stop every part (runtimes first, Redis last), kill their actors, then the record. Returns what each
        part's stop reported (a part whose actor is gone already is left out)."""
        stopped = self._stop_parts(timeout_s)
        if self.record is not None:
            ray.kill(self.record)
        return stopped

    def _stop_parts(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        names = _recorded_parts(self.record, self.namespace)
        return stop_actors(self.namespace, list(reversed(names)), timeout_s)


def _recorded_parts(record, namespace: str) -> list[str]:
    """The part names the record holds, else (no record) every actor of ours named in the namespace."""
    try:
        return ray.get(record.get.remote())["parts"]
    except (RayActorError, AttributeError):
        named = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith(PART_PREFIX)]


def stop_actors(namespace: str, names: Sequence[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Stop each named part actor's process and kill the actor; the ones already gone are skipped."""
    stopped = []
    for name in names:
        actor = _actor(name, namespace)
        if actor is None or name == RECORD_NAME:
            continue
        # RayActorError: its node is gone, and its process with it; a timeout: it hangs, and the kill ends it
        with contextlib.suppress(RayActorError, GetTimeoutError):
            stopped.append(ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + 30))
        ray.kill(actor, no_restart=True)
    return stopped


def down(namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Take down the stack in `namespace`, whoever started it; also what a failed start left without a record."""
    _require_ray()
    record = _actor(RECORD_NAME, namespace)
    stack = RayStack(namespace, record)
    return stack.down(timeout_s)
