"""Configuration of the rollout service: one dataclass, filled by the CLI or by code that embeds it."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import TypeAdapter, ValidationError

from sandbox_runtime.config import SERVICE_URL
from sandbox_runtime.models import PortForward
from server_kit.address import advertised_url, check_exposure, check_token
from server_kit.connections import ConnectionLimits

from ..models import LLM_PROTOCOLS, LLMServerURL
from .circuit_breaker import BreakerConfig
from .decoupled import ProducerConfig
from .llm import OUTAGE_WAIT_S
from .pipeline import PipelineConfig
from .replica import BEAT_INTERVAL_S
from .sandboxes import WAIT_FOR_RUNTIME_S
from .warm_sandboxes import WarmConfig

LLM_SERVER_URL = TypeAdapter(LLMServerURL)  # the rule PUT /v1/llm-servers applies


def _host_and_port(url: str) -> bool:
    """Whether the URL's host and port parse (a pattern alone lets `http://h:port` or `http://[::1` through)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        return False
    return bool(parts.hostname)


@dataclass
class RolloutConfig:
    sandbox_urls: list[str]
    llm_urls: list[str]
    tokenizer: str
    host: str = "127.0.0.1"
    port: int = 8766
    token: str | None = None
    sandbox_token: str | None = None
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    plugins: list[str] = field(default_factory=list)  # import paths, beside the `prorl_adapter` entry points
    blocked_plugins: list[str] = field(default_factory=list)
    # Settings of the plugins, by section: {"staleness": {...}, "reward": {...}}; see docs/plugins.md.
    plugin_config: dict[str, Any] = field(default_factory=dict)
    buffer_url: str = "memory://"  # or redis://host:port/db: the experience buffer of decoupled mode
    decoupled: ProducerConfig = field(default_factory=ProducerConfig)
    llm_health_interval_s: float = 5.0
    llm_outage_wait_s: float = OUTAGE_WAIT_S  # how long a turn waits for a healthy LLM server when none is
    # Each generation request's own limit (a stalled server is failed over past it); None: only the job's time budget.
    llm_call_timeout_s: float | None = None
    llm_stream: bool = False  # turns read as streams: the barrier's `keep` mode needs it (weight_barrier.py)
    # Labels every sandbox this service creates, so that the next incarnation of it (same id) deletes what a
    # crash left; None: `prorl-rollout@HOST:PORT`.
    service_id: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    # The LLM gateway's own listener (agent programs reach it through the runtimes' forwards, and only it).
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0  # 0: a free port; pipeline.gateway_address says where the runtimes reach it
    # Replicas (a shared Redis in buffer_url): where the others and operators reach this one, how often it beats,
    # and how long a finished job's result stays readable.
    advertise_url: str | None = None  # None: http://HOST:PORT
    heartbeat_s: float = BEAT_INTERVAL_S
    result_ttl_s: float = 86_400.0
    # Every finished trajectory kept as Parquet shards under this directory (records.py); None: not kept.
    record_dir: Path | None = None
    # Sandboxes created ahead per spec (size 0: none), and the most creations in flight per runtime (0: no limit).
    warm: WarmConfig = field(default_factory=WarmConfig)
    max_concurrent_creates: int = 0
    wait_for_runtime_s: float = WAIT_FOR_RUNTIME_S  # how long an init waits for a sandbox runtime while none is alive
    # The API's socket listening already, given by whoever started the service (--listen-fd); host and port are
    # its own.
    listen_socket: socket.socket | None = None
    # The front door of both the API and the gateway: header and body deadlines, connection caps.
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    # What a runtime presents to register (PUT /v1/runtimes/{name}); None: the sandbox token, and with neither,
    # registration is refused (see `registration_credential`). A registered runtime is called with its own token.
    registration_token: str | None = None
    # The circuit breaker (circuit_breaker.py): off unless a threshold is given.
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    @property
    def registration_credential(self) -> str | None:
        """The token a registering runtime must present: --registration-token, else --sandbox-token. A registered
        runtime is never sent it (every registered runtime holds it), nor --sandbox-token (it may open runtimes
        given by URL): it is called with the token of its own its heartbeats carry."""
        return self.registration_token or self.sandbox_token

    @property
    def sandbox_owner(self) -> str:
        """This replica's id: it labels its sandboxes and names it among the replicas. The default names the
        machine, so replicas on several nodes with the same port differ."""
        host = socket.gethostname() if self.host in ("", "0.0.0.0", "::") else self.host
        return self.service_id or f"prorl-rollout@{host}:{self.port}"

    @property
    def replica_url(self) -> str:
        """Where other machines reach this replica: --advertise-url, else its host (the machine's name for a
        wildcard address) and port."""
        return self.advertise_url or advertised_url(self.host, self.port)

    def check(self) -> None:
        """What start-up refuses, naming the setting: exposure without a token, a token no client can send, URLs
        that name no server, settings that cannot work."""
        check_exposure(self.host, self.token, "PRORL_ROLLOUT_TOKEN")
        check_token(self.token, "--token (or PRORL_ROLLOUT_TOKEN)")
        check_token(self.sandbox_token, "--sandbox-token (or PRORL_SANDBOX_TOKEN)")
        check_token(self.registration_token, "--registration-token (or PRORL_REGISTRATION_TOKEN)")
        for url in self.sandbox_urls:
            if not SERVICE_URL.fullmatch(url) or not _host_and_port(url):
                raise ValueError(f"--sandbox-url {url!r} is not a sandbox runtime's URL such as http://node-7:8765")
        for url in self.llm_urls:
            try:
                LLM_SERVER_URL.validate_python(url)
            except ValidationError:
                raise ValueError(
                    f"--llm-url {url!r} is not an LLM server's URL such as http://gpu-0:8000 (a protocol may lead it: "
                    f"{', '.join(f'{name}+http://...' for name in LLM_PROTOCOLS)})"
                ) from None
        if not 0 <= self.gateway_port <= 65535:
            raise ValueError(f"--gateway-port {self.gateway_port} is not a port: give one in 1-65535 (0: a free one)")
        if self.pipeline.gateway_address is not None:
            try:
                PortForward(port=1, target=self.pipeline.gateway_address)  # what the runtimes are sent
            except ValidationError:
                raise ValueError(
                    f"--gateway-address {self.pipeline.gateway_address!r} is not HOST:PORT ([::1]:PORT for IPv6), "
                    "the address at which the sandbox runtimes reach the LLM gateway"
                ) from None
        if not self.result_ttl_s > 0:
            raise ValueError(f"--result-ttl-s {self.result_ttl_s:g} must be > 0")
        # os.path's tests: a directory on the way this user may not enter is Records' to report, naming --record.
        if self.record_dir is not None and os.path.exists(self.record_dir) and not os.path.isdir(self.record_dir):
            raise ValueError(f"--record {self.record_dir}: it is a file; give a directory (made if it is missing)")
        if not 0 < self.heartbeat_s <= 3600:
            raise ValueError(f"the replica heartbeat {self.heartbeat_s:g} s must be in (0, 3600]")
        self.warm.check()
        self.breaker.check()
        if not isinstance(self.pipeline.max_run_workers, int) or self.pipeline.max_run_workers < 1:
            raise ValueError(f"--max-run-workers {self.pipeline.max_run_workers!r} must be an integer >= 1")
        self.pipeline.adaptive.check(self.pipeline.max_run_workers)
        if not isinstance(self.max_concurrent_creates, int) or self.max_concurrent_creates < 0:
            raise ValueError(
                f"--max-concurrent-creates {self.max_concurrent_creates!r} must be an integer >= 0 (0: no limit)"
            )
        if self.advertise_url is not None and not SERVICE_URL.fullmatch(self.advertise_url):
            raise ValueError(f"--advertise-url {self.advertise_url!r} is not a URL such as http://rollout-host:8766")
