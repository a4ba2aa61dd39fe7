"""Sandboxes for episodes, spread over the sandbox runtimes: those given at start (`--sandbox-url`) and
those that register themselves (heartbeats, `sandbox_runtime.registration`), as the coordination records them.

A new sandbox goes to the live runtime with the most free room (its capacity less the larger of what it last
reported and what this replica holds there); a runtime that failed to create one is skipped for the next
attempt of the same episode, which is how init retries elsewhere. A registered runtime whose heartbeats stop is
no longer used; with no runtime at all, an init waits a while for one to register before it fails.

Nothing is leaked: every sandbox carries the replica's label (`prorl_service`) and a TTL from the caller (the
job's budget plus a margin), so the runtime reaps it even if this service dies; an episode cancelled while its
sandbox is being created deletes the sandbox once the creation returns; a replica deletes whatever sandboxes an
earlier incarnation of it (same id) left on a runtime the first time it sees that runtime; and the replica that
takes over a dead one deletes the dead one's sandboxes (`delete_owned_by`).

Optionally (`warm`, off by default), sandboxes are created ahead for the specs episodes ask for, and an acquire
takes one of those when there is one: see `warm_sandboxes`, whose sandboxes this pool places, counts and deletes
like any other (a warm one is used once; `release` deletes it). At most `max_concurrent_creates` creations are
in flight on one runtime (0: no limit), an episode's before any refill's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sandbox_runtime.client import SandboxAPIError, SandboxClient
from sandbox_runtime.images import UNPACK_TIMEOUT_S
from sandbox_runtime.models import SandboxInfo
from server_kit.errors import DownstreamError

from ..models import RuntimeState, WarmSandboxState
from ..tasks import Environment
from .storage.buffer import ExperienceBufferError
from .storage.coordination import Coordination, MemoryCoordination
from .warm_sandboxes import CreateGate, WarmBox, WarmConfig, WarmSandboxes

log = logging.getLogger(__name__)
OWNER_LABEL = "prorl_service"
STATIC_CAPACITY = 1024  # a runtime given by URL does not say its capacity: the runtime's default
REFRESH_S = 1.0  # how old the view of the registered runtimes may be when a sandbox is placed
WAIT_FOR_RUNTIME_S = 30.0  # how long an init waits for a runtime when none is alive
HEALTH_CHECK_S = 5.0  # how long a runtime suspected lost has to answer its health check
SWEEP_S = 30.0  # how long a new runtime has to list its sandboxes before it is used all the same
# A registered runtime silent this long (and at least two of its heartbeat intervals) is taken for gone: its calls
# in flight end. Longer than the registry's three missed beats, after which it only gets no new sandbox: a runtime
# starved of CPU for a few seconds must not lose every episode it runs.
SEVER_AFTER_S = 10.0
# How long a sandbox's creation may take where no job's budget says (a warm one): the runtime's own bound on an
# image's unpack, and a minute for the rest. An episode's creation is bounded by its job's time budget instead.
CREATE_TIMEOUT_S = UNPACK_TIMEOUT_S + 60.0


class RuntimeFailed(DownstreamError):
    """A runtime could not create or prepare a sandbox; `url` names it so a retry can avoid it."""

    def __init__(self, url: str, message: str):
        super().__init__(f"{url}: {message}")
        self.url = url


@dataclass
class Runtime:
    """A sandbox runtime (a `prorl-sandbox` server) as this replica places sandboxes on it."""

    name: str
    url: str
    client: SandboxClient
    static: bool
    active: int = 0  # this replica's sandboxes on it
    failures: int = 0
    alive: bool = True
    capacity: int = STATIC_CAPACITY
    reported: int = 0  # sandboxes it held at its last heartbeat (all replicas')
    seen_at: float | None = None
    created: set[str] = field(default_factory=set)  # ids of this incarnation's sandboxes on it
    swept: bool = True  # a registered one: no sandbox goes there before an earlier run's leftovers are gone
    gate: CreateGate = field(default_factory=CreateGate)  # its creations in flight from this replica
    token: str | None = None  # a registered one's own, as its heartbeats carry it
    severed: bool = False  # taken for gone: its client's calls end at once (SandboxClient.sever)

    def free(self) -> int:
        return self.capacity - max(self.reported, self.active)


class SandboxPool:
    def __init__(
        self,
        urls: list[str],
        token: str | None = None,
        owner: str = "prorl-rollout",
        coordination: Coordination | None = None,
        wait_for_runtime_s: float = WAIT_FOR_RUNTIME_S,
        warm: WarmConfig | None = None,
        max_concurrent_creates: int = 0,
    ) -> None:
        self.owner = owner
        self._token = token  # for the runtimes given by URL only; a registered one is called with its own
        self.coordination = coordination or MemoryCoordination(owner)
        self.wait_for_runtime_s = wait_for_runtime_s
        self.max_concurrent_creates = max_concurrent_creates
        self.runtimes: dict[str, Runtime] = {}
        for url in urls:
            url = url.rstrip("/")
            self.runtimes[url] = self._runtime(url, url, static=True)
        self.warm: WarmSandboxes | None = None
        if warm is not None and warm.size > 0:
            self.warm = WarmSandboxes(warm, self._create_warm, self._delete_warm, self._serves)
        self._refreshed = 0.0
        self._now = 0.0  # the coordination's clock at the last refresh
        self._late_deletes: set[asyncio.Task[None]] = set()  # awaited at close: a sandbox must not leak
        self._sweeps: set[asyncio.Task[None]] = set()  # cancelled at close: looks for an earlier run's leftovers
        self._creations: set[asyncio.Future[SandboxInfo]] = set()  # awaited at close: their sandboxes are deleted
        self._refresh_lock = asyncio.Lock()

    def _runtime(self, name: str, url: str, static: bool, swept: bool = True, token: str | None = None) -> Runtime:
        """A runtime and its client. A registered one is sent only its own token, the one its (authenticated)
        heartbeats carry: never the runtimes' token given for the static ones, nor the registration token, which
        every registered runtime holds. Whatever registers (at whatever URL it names) learns no credential that
        opens another runtime."""
        gate = CreateGate(self.max_concurrent_creates or None)
        client = SandboxClient(url, token=self._token if static else token, timeout=120)
        return Runtime(name, url, client, static=static, swept=swept, gate=gate, token=token)

    # -- the runtimes -----------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the registered runtimes again: new ones are added (this replica's leftovers there deleted
        first), lapsed ones stop being used."""
        async with self._refresh_lock:
            try:
                now, records = await self.coordination.runtimes()
            except ExperienceBufferError as exc:  # Redis away: keep the last view
                log.warning("cannot read the registered runtimes: %s", exc)
                return
            self._now, self._refreshed = now, time.monotonic()
            heard = {record.heartbeat.url.rstrip("/"): record for record in records}
            for url, record in heard.items():
                runtime = self.runtimes.get(url)
                if runtime is None:
                    runtime = self._runtime(record.name, url, static=False, swept=False, token=record.heartbeat.token)
                    self.runtimes[url] = runtime
                    self._in_background(self._delete_leftovers_on(runtime), self._sweeps)
                elif not runtime.static and runtime.token != record.heartbeat.token:  # restarted with a new token
                    old, runtime.token = runtime.client, record.heartbeat.token
                    runtime.client = SandboxClient(url, token=runtime.token, timeout=120)
                    self._in_background(old.aclose())
                if not runtime.static:
                    runtime.capacity, runtime.reported = record.heartbeat.capacity, record.heartbeat.sandboxes
                    runtime.seen_at = record.seen_at
                    silent_s = now - record.seen_at
                    gone = record.heartbeat.leaving or silent_s > max(SEVER_AFTER_S, 2 * record.heartbeat.interval_s)
                    self._set_alive(runtime, record.alive(now), gone)
            for url, runtime in list(self.runtimes.items()):
                if not runtime.static and url not in heard:
                    self._set_alive(runtime, False, gone=True)
                    if runtime.active == 0:  # forgotten by the registry and unused here: let it go
                        del self.runtimes[url]
                        self._in_background(runtime.client.aclose())

    def _set_alive(self, runtime: Runtime, alive: bool, gone: bool) -> None:
        """A registered runtime whose heartbeats lapsed gets no new sandbox. One `gone` (it left, the registry
        forgot it, or it has been silent SEVER_AFTER_S) has every call in flight to it ended at once, since a node
        that vanished without a reset would hold them until their own timeouts: the episodes there start again
        elsewhere. One that beats again is used again, once what this replica left there meanwhile (sandboxes
        whose deletes failed fast while it was cut off) is deleted."""
        if alive and (runtime.severed or not runtime.alive):
            log.info("sandbox runtime %s (%s) beats again", runtime.name, runtime.url)
            if runtime.severed:
                runtime.severed = False
                runtime.client.revive()
                runtime.swept = False
                self._in_background(self._delete_leftovers_on(runtime), self._sweeps)
        elif not alive and gone and not runtime.severed:
            log.warning("sandbox runtime %s (%s) is gone: its calls in flight end now", runtime.name, runtime.url)
            runtime.severed = True
            runtime.client.sever(f"the runtime {runtime.name} is taken for gone (it left, or beats no more)")
        runtime.alive = alive

    def start_watching(self) -> None:
        self._in_background(self.watch_forever(), self._sweeps)  # cancelled at close, like the sweeps

    async def watch_forever(self) -> None:
        """While episodes hold sandboxes on registered runtimes, read the registry every REFRESH_S: a runtime that
        dies mid-episode is noticed within its heartbeats' lapse, not at the next placement."""
        while True:
            await asyncio.sleep(REFRESH_S)
            if any(not runtime.static and runtime.active for runtime in self.runtimes.values()):
                try:
                    await self._refresh_if_stale()
                except Exception:  # the watch must outlive a bug of its own
                    log.exception("watching the sandbox runtimes failed")

    async def _refresh_if_stale(self) -> None:
        if time.monotonic() - self._refreshed >= REFRESH_S:
            await self.refresh()

    def describe(self) -> list[RuntimeState]:
        return [
            RuntimeState(
                name=s.name,
                url=s.url,
                source="static" if s.static else "registered",
                alive=s.alive,
                capacity=None if s.static else s.capacity,
                sandboxes=None if s.static else s.reported,
                placed=s.active,
                failures=s.failures,
                seen_s_ago=None if s.seen_at is None else round(max(self._now - s.seen_at, 0.0), 3),
                creating=s.gate.in_flight,
                creations_waiting=s.gate.waiting(True) + s.gate.waiting(False),
                max_concurrent_creates=s.gate.limit,
            )
            for s in self.runtimes.values()
        ]

    async def _choose(self, exclude: set[str]) -> Runtime:
        """The live runtime with the most room, avoiding `exclude`; with none alive, or every one full, wait for
        one to register or for room (up to `wait_for_runtime_s`; then a full one is tried all the same)."""
        deadline = time.monotonic() + self.wait_for_runtime_s
        while True:
            await self._refresh_if_stale()
            alive = [s for s in self.runtimes.values() if s.alive and s.swept]
            candidates = [s for s in alive if s.url not in exclude] or alive
            roomy = [s for s in candidates if s.free() > 0]
            waited_out = time.monotonic() >= deadline
            if roomy or (candidates and waited_out):
                return max(roomy or candidates, key=lambda s: (s.free(), -s.active, -s.failures))
            if waited_out:
                raise RuntimeFailed("(none)", f"no sandbox runtime is alive (waited {self.wait_for_runtime_s:g} s)")
            await asyncio.sleep(REFRESH_S)  # a period: a runtime may register, or room free up, meanwhile

    # -- sandboxes --------------------------------------------------------------------------------------
    async def acquire(self, spec: dict[str, Any], exclude: set[str], timeout_s: float | None = None) -> Environment:
        """A sandbox for an episode: a warm one, or one made now, whose creation may take `timeout_s` (default
        CREATE_TIMEOUT_S): the pipeline gives the job's time budget, which bounds the init stage anyway."""
        if self.warm is not None and (box := self.warm.take(spec, exclude)) is not None:
            runtime = self.runtimes[box.server_url]  # counted in `active` since it was created
            return Environment(runtime.client, box.sandbox_id, runtime.url, box.workdir)
        runtime = await self._choose(exclude)
        info = await self._create(runtime, spec, urgent=True, timeout_s=timeout_s)
        return Environment(runtime.client, info.id, runtime.url, info.workdir)

    async def _create(
        self, runtime: Runtime, spec: dict[str, Any], urgent: bool, timeout_s: float | None = None
    ) -> SandboxInfo:
        """A sandbox on `runtime`, counted there; through its gate (an episode's creation is `urgent`)."""
        spec = {**spec, "labels": {**spec.get("labels", {}), OWNER_LABEL: self.owner}}
        runtime.active += 1  # counted before the request, so concurrent inits spread over the runtimes
        try:
            await runtime.gate.enter(urgent)
        except asyncio.CancelledError:
            runtime.active -= 1
            raise
        timeout = CREATE_TIMEOUT_S if timeout_s is None else timeout_s
        creation = asyncio.ensure_future(runtime.client.create_sandbox(timeout=timeout, **spec))
        creation.add_done_callback(lambda _: runtime.gate.leave())
        self._creations.add(creation)
        creation.add_done_callback(self._creations.discard)
        try:
            # Shielded: a cancel here must not abandon a sandbox the runtime goes on creating.
            info = await asyncio.shield(creation)
        except asyncio.CancelledError:
            runtime.active -= 1
            creation.add_done_callback(lambda done: self._delete_when_created(runtime, done))
            raise
        except SandboxAPIError as exc:
            runtime.active -= 1
            runtime.failures += 1
            raise RuntimeFailed(runtime.url, f"cannot create a sandbox: {exc}") from exc
        runtime.created.add(info.id)
        return info

    # -- warm sandboxes (see warm_sandboxes) ----------------------------------------------------------------
    def _serves(self, url: str) -> bool:
        runtime = self.runtimes.get(url)
        return runtime is not None and runtime.alive

    async def _create_warm(self, spec: dict[str, Any]) -> WarmBox | None:
        """A warm sandbox on the live runtime with the most room, None when none has room; it does not wait."""
        await self._refresh_if_stale()
        roomy = [s for s in self.runtimes.values() if s.alive and s.swept and s.free() > 0]
        if not roomy:
            return None
        runtime = max(roomy, key=lambda s: (s.free(), -s.active, -s.failures))
        info = await self._create(runtime, spec, urgent=False)
        return WarmBox(info.id, runtime.url, info.workdir, started=0.0, ttl_s=spec["ttl_s"])

    async def _delete_warm(self, box: WarmBox) -> None:
        await self._delete_placed(box.server_url, box.sandbox_id)

    def describe_warm(self) -> dict[str, WarmSandboxState]:
        return {} if self.warm is None else self.warm.describe()

    def _in_background(self, work, tasks: set[asyncio.Task[None]] | None = None) -> None:
        tasks = self._late_deletes if tasks is None else tasks
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _delete_when_created(self, runtime: Runtime, creation: asyncio.Future[SandboxInfo]) -> None:
        if creation.cancelled() or creation.exception() is not None:
            return
        self._in_background(self._delete_quietly(runtime, creation.result().id))

    async def _delete_quietly(self, runtime: Runtime, sandbox_id: str) -> None:
        with contextlib.suppress(SandboxAPIError):
            await runtime.client.delete_sandbox(sandbox_id)

    async def _delete_owned(self, runtime: Runtime, owner: str) -> int:
        """Delete the sandboxes labelled with `owner` on one runtime, but for this incarnation's own."""
        try:
            boxes = [
                box
                for box in await runtime.client.list_sandboxes()
                if box.labels.get(OWNER_LABEL) == owner and box.id not in runtime.created
            ]
        except SandboxAPIError as exc:  # a runtime that is down took its sandboxes with it (or reaps them)
            log.warning("could not look for sandboxes of %s on %s: %s", owner, runtime.url, exc)
            return 0
        await asyncio.gather(*(self._delete_quietly(runtime, box.id) for box in boxes))
        return len(boxes)

    async def _delete_leftovers_on(self, runtime: Runtime) -> None:
        deleted = 0
        try:
            async with asyncio.timeout(SWEEP_S):  # one that does not answer has nothing of ours worth waiting for
                deleted = await self._delete_owned(runtime, self.owner)
        except TimeoutError:
            log.warning("no answer from %s within %g s while looking for leftovers", runtime.url, SWEEP_S)
        finally:
            runtime.swept = True
        if deleted:
            log.warning(
                "deleted %d sandboxes of %s on %s that no episode holds (an earlier run's, or this one's while the "
                "runtime was cut off)",
                deleted,
                self.owner,
                runtime.url,
            )

    async def delete_leftovers(self) -> int:
        """Delete every sandbox labelled with this replica's id on the runtimes given by URL (the registered
        ones are cleaned when first seen): a previous incarnation's, left by a crash."""
        counts = await asyncio.gather(*(self._delete_owned(s, self.owner) for s in self.runtimes.values() if s.static))
        if sum(counts):
            log.warning("deleted %d sandboxes left by an earlier run of %s", sum(counts), self.owner)
        return sum(counts)

    async def delete_owned_by(self, owner: str) -> int:
        """Delete a dead replica's sandboxes on every runtime alive (its episodes run again elsewhere)."""
        await self.refresh()
        alive = [runtime for runtime in self.runtimes.values() if runtime.alive]
        return sum(await asyncio.gather(*(self._delete_owned(runtime, owner) for runtime in alive)))

    async def lost(self, url: str) -> bool:
        """Whether the runtime at `url` is gone (not merely slow to answer one call): a registered one that is
        no longer alive, or one that does not answer its health check either."""
        await self.refresh()
        runtime = self.runtimes.get(url)
        if runtime is None or not runtime.alive:
            return True
        return not await runtime.client.healthy(HEALTH_CHECK_S)

    async def release(self, env: Environment) -> None:
        """Delete the episode's sandbox. A runtime that is gone took its sandboxes with it."""
        await self._delete_placed(env.server_url, env.sandbox_id)

    async def _delete_placed(self, url: str, sandbox_id: str) -> None:
        runtime = self.runtimes.get(url)
        if runtime is None:  # forgotten meanwhile: gone, with its sandboxes
            return
        runtime.active -= 1
        runtime.created.discard(sandbox_id)
        await self._delete_quietly(runtime, sandbox_id)

    async def close(self) -> None:
        if self.warm is not None:
            await self.warm.close()
        for sweep in self._sweeps:
            sweep.cancel()
        # A creation whose caller was cancelled deletes its sandbox once it returns (a callback that runs before
        # this gather's): wait for both.
        await asyncio.gather(*self._sweeps, *self._creations, return_exceptions=True)
        await asyncio.gather(*self._late_deletes, return_exceptions=True)
        for runtime in self.runtimes.values():
            await runtime.client.aclose()
