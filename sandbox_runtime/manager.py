"""The sandbox manager: creates, finds and deletes sandboxes, reaps expired ones, and recovers from a crash.

State on disk, under `state_dir`: a lock file (one server per state dir) and one folder per sandbox with
its workspace, its /tmp and `record.json` (pids with start times). A server that was SIGKILLed leaves those
folders behind; the next server on the same state dir kills what the records name, if each pid still has
its recorded start time, and removes the folders.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import time
from collections import OrderedDict
from typing import TextIO

from . import procs
from .backends import make_backend
from .backends.base import Backend, BackendError, SandboxDirs
from .config import ServerConfig
from .metrics import Metrics
from .models import Limits, SandboxSpec
from .sandbox import Sandbox

log = logging.getLogger(__name__)


class SandboxNotFound(Exception):
    status = 404


class CapacityError(Exception):
    status = 429


class SandboxManager:
    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.state_dir = config.state_dir.resolve()
        self.boxes_dir = self.state_dir / "sandboxes"
        self._sandboxes: dict[str, Sandbox] = {}
        self._deleted: OrderedDict[str, None] = OrderedDict()  # recent ids, so DELETE stays idempotent
        self._backends: dict[str, Backend] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._lock_file: TextIO | None = None
        self.default_backend = config.backend or self._pick_default()

    # -- start and stop ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self.boxes_dir.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        if os.geteuid() == 0:
            log.warning(
                "running as root: the kernel does not apply the pids limit (RLIMIT_NPROC) to uid 0, so a fork "
                "bomb is not contained; run the server as an unprivileged user (memory and file limits still hold)"
            )
        reaped = await self.reap_leftovers()
        if reaped:
            log.warning("reaped %d sandboxes left by a previous server in %s", reaped, self.state_dir)
        self._reaper = asyncio.create_task(self._reap_expired_forever())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(*(self.delete(i) for i in list(self._sandboxes)), return_exceptions=True)
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the lock

    def _lock_state_dir(self) -> None:
        lock = open(self.state_dir / "server.lock", "w")  # noqa: SIM115 - held for the server's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(f"another sandbox server is using state dir {self.state_dir}") from None
        self._lock_file = lock

    # -- backends ---------------------------------------------------------------------------------------
    def _pick_default(self) -> str:
        from .backends import BACKENDS

        for name in ("bwrap", "apptainer"):
            if BACKENDS[name].probe()[0]:
                return name
        raise RuntimeError(
            "no isolating backend is available: install bubblewrap (apt-get install bubblewrap) or Apptainer, "
            "or ask for `--backend local` explicitly (no isolation)"
        )

    def backend(self, name: str | None) -> Backend:
        name = name or self.default_backend
        if name not in self._backends:
            self._backends[name] = make_backend(name, self.config)
        return self._backends[name]

    # -- sandboxes --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sandboxes)

    def all(self) -> list[Sandbox]:
        return list(self._sandboxes.values())

    def get(self, sandbox_id: str) -> Sandbox:
        box = self._sandboxes.get(sandbox_id)
        if box is None or box.closing:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        box.touch()
        return box

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if len(self._sandboxes) >= self.config.max_sandboxes:
            raise CapacityError(f"sandbox limit reached ({self.config.max_sandboxes}); delete some first")
        backend = self.backend(spec.backend)
        spec = spec.model_copy(update={"backend": backend.name, "limits": self._limits(spec.limits)})
        sandbox_id = secrets.token_hex(6)
        dirs = SandboxDirs(sandbox_id, self.boxes_dir / sandbox_id)
        dirs.workspace.mkdir(parents=True)
        dirs.tmp.mkdir()
        dirs.tmp.chmod(0o1777)
        box = Sandbox(dirs, spec, backend, self.config.default_output_bytes)
        self._sandboxes[sandbox_id] = box
        try:
            box.write_record()
            await backend.create(dirs, spec)
            await box.session("default")
        except BaseException:
            await self.delete(sandbox_id)
            raise
        self.metrics.sandboxes_created.labels(backend.name).inc()
        return box

    def _limits(self, asked: Limits) -> Limits:
        defaults = self.config.default_limits.model_dump()
        return Limits(**{k: v if v is not None else defaults[k] for k, v in asked.model_dump().items()})

    async def delete(self, sandbox_id: str) -> bool:
        """Delete a sandbox; returns False if it was already deleted. Every process is gone on return."""
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            if sandbox_id in self._deleted:
                return False
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        if box.closing:  # a concurrent delete is under way: wait for the same outcome
            await box.deleted.wait()
            return False
        try:
            await box.close()
        finally:
            del self._sandboxes[sandbox_id]
            self._remember_deleted(sandbox_id)
            await asyncio.to_thread(shutil.rmtree, box.dirs.root, ignore_errors=True)
            self.metrics.sandboxes_deleted.labels(box.backend.name).inc()
            box.deleted.set()
        return True

    def _remember_deleted(self, sandbox_id: str) -> None:
        self._deleted[sandbox_id] = None
        while len(self._deleted) > 100_000:
            self._deleted.popitem(last=False)

    # -- reaping ----------------------------------------------------------------------------------------
    async def _reap_expired_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            await self.reap_expired()

    async def reap_expired(self) -> int:
        now_wall, now_mono = time.time(), time.monotonic()
        expired = [(b.id, why) for b in self.all() if not b.closing and (why := b.expired(now_wall, now_mono))]
        for sandbox_id, why in expired:
            log.info("reaping sandbox %s (%s)", sandbox_id, why)
            self.metrics.sandboxes_reaped.labels(why).inc()
        await asyncio.gather(*(self.delete(i) for i, _ in expired), return_exceptions=True)
        return len(expired)

    async def reap_leftovers(self) -> int:
        """Kill what a crashed server left: only processes whose pid *and* start time match the record."""
        reaped = 0
        for root in sorted(p for p in self.boxes_dir.iterdir() if p.is_dir()):
            record = Sandbox.read_record(root) or {}
            for pid, started in record.get("sessions", {}).values():
                if procs.is_same_process(pid, started):
                    procs.kill_session(pid)
            if record.get("backend") and record["backend"] != "local":
                with contextlib.suppress(BackendError, RuntimeError, ValueError):
                    spec = SandboxSpec.model_validate(record["spec"])
                    await self.backend(record["backend"]).destroy(SandboxDirs(root.name, root), spec)
            await asyncio.to_thread(shutil.rmtree, root, ignore_errors=True)
            reaped += 1
        return reaped
