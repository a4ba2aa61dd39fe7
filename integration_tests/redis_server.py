"""A redis-server process of the tests' own (Debian's `redis-server`, which `make test` installs)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from prorl_adapter.dev.localstack import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_SKIP = None if REDIS_SERVER else "redis-server is not installed (apt-get install redis-server; make test does)"


class RedisServer:
    """A redis-server process of our own, on a fixed free port so that it can be restarted in place."""

    def __init__(self, workdir: Path, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.appendonly = appendonly
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> RedisServer:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        argv += ["--save", "", *persistence, "--logfile", str(self.workdir / "redis.log")]
        self.process = subprocess.Popen(argv, cwd=self.workdir, stdin=subprocess.DEVNULL, start_new_session=True)
        import redis  # the tests that start Redis skip where the package is missing

        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited with status {self.process.returncode}: {log}")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):  # LOADING: reading the AOF
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout:g} s")
                time.sleep(0.05)  # polling a starting process, not synchronising the code under test
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL by its own pid: a crash, nothing flushed at exit."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()


class CommandFault:
    """The `at`-th command a redis-py asyncio client sends from now (counted from 0; its pipelines, separate
    clients, are not counted) fails as a connection that dies does: before Redis ran it (`lost="request"`) or
    after (`lost="reply"`). Redis-py's own retries are bypassed: a failure that outlasted them. `hit` says
    whether the fault struck; `remove()` gives the client back as it was."""

    def __init__(self, client, at: int, lost: str) -> None:
        import redis

        assert lost in ("request", "reply")
        self.client, self.hit, sent = client, False, 0
        send = client.execute_command

        async def execute(*args, **options):
            nonlocal sent
            now, sent = sent, sent + 1
            if now == at and lost == "request":
                self.hit = True
                raise redis.ConnectionError(f"injected: the connection died before {args[0]} was sent")
            reply = await send(*args, **options)
            if now == at:
                self.hit = True
                raise redis.ConnectionError(f"injected: the connection died before the reply to {args[0]}")
            return reply

        client.execute_command = execute

    def remove(self) -> None:
        del self.client.execute_command
