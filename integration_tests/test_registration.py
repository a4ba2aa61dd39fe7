"""Who may register as a sandbox runtime, and what a registered one is sent, against a real rollout service and a
real runtime registering itself as the launchers start them (prorl_adapter.dev.localstack hands both the same
registration token in the environment, as the Ray and Slurm recipes hand them the stack's token).

Whatever registers is sent episodes' files and a token and is believed about their rewards: before, a token-less
service took any local process's word, and every registered runtime was sent the sandbox token, which opens the
runtimes given by URL."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from aiohttp import web

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import REGISTRATION_TOKEN, TINY_MODEL

from .conftest import BACKEND_SKIPS, start_server, stop_server

API_TOKEN = "the-services-api-token-0123456789"
SANDBOX_TOKEN = "the-static-runtimes-token-0123456789"


def heartbeat(url: str) -> dict:
    return {"url": url, "capacity": 4, "sandboxes": 0, "backend": "bwrap", "version": "0", "interval_s": 60}


def register(service: str, name: str, url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.put(f"{service}/v1/runtimes/{name}", json=heartbeat(url), headers=headers, timeout=30)


def registered(service: localstack.Service, headers: dict[str, str]) -> set[str]:
    runtimes = httpx.get(f"{service.url}/v1/runtimes", headers=headers, timeout=30).json()["runtimes"]
    return {r["name"] for r in runtimes if r["source"] == "registered" and r["alive"]}


async def until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        await asyncio.sleep(0.1)  # a poll of a condition, with a bound


@pytest.fixture(scope="module", params=["token-less", "token"])
def service(request) -> Iterator[tuple[localstack.Service, dict[str, str]]]:
    """A service as localstack starts it (the registration token in its environment), with or without an API
    token; and the headers its API wants."""
    token = request.param == "token"
    started = localstack.start_rollout_service([], [], *(["--token", API_TOKEN] if token else []))
    yield started, {"Authorization": f"Bearer {API_TOKEN}"} if token else {}
    started.stop()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {API_TOKEN}"},
        {"Authorization": REGISTRATION_TOKEN},
    ],
    ids=["none", "wrong", "the-api-token", "no-bearer"],
)
def test_a_registration_without_the_registration_token_is_refused(service, headers):
    started, api = service
    refused = register(started.url, "intruder", "http://127.0.0.1:9", headers)
    assert refused.status_code == 401 and "registration token" in refused.json()["error"]
    assert "intruder" not in registered(started, api)


def test_a_registration_with_the_registration_token_is_recorded(service):
    started, api = service
    accepted = register(started.url, "invited", "http://127.0.0.1:9", {"Authorization": f"Bearer {REGISTRATION_TOKEN}"})
    assert accepted.status_code == 200 and accepted.json() == {"name": "invited", "alive": True}
    assert "invited" in registered(started, api)


def test_a_service_given_no_registration_token_takes_no_registration():
    argv = [
        sys.executable,
        "-m",
        "prorl_adapter",
        "serve",
        "--listen-fd",
        "{listen_fd}",
        "--tokenizer",
        str(TINY_MODEL),
    ]
    env = {"PRORL_REGISTRATION_TOKEN": "", "PRORL_SANDBOX_TOKEN": ""}  # neither a registration nor a sandbox token
    started = localstack.start_service("rollout service", [*argv, "--log-level", "WARNING"], "/healthz", 60, env=env)
    try:
        for headers in ({"Authorization": f"Bearer {REGISTRATION_TOKEN}"}, {}):
            refused = register(started.url, "any", "http://127.0.0.1:9", headers)
            assert refused.status_code == 403 and "--registration-token" in refused.json()["error"]
    finally:
        started.stop()


class Recorder:
    """A "runtime" that holds the registration token and records every Authorization it is sent."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        self.called = asyncio.Event()

    async def list_sandboxes(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization", ""))
        self.called.set()
        return web.json_response({"sandboxes": []})


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    recording = Recorder()
    app = web.Application()
    app.router.add_get("/v1/sandboxes", recording.list_sandboxes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield recording, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))
async def test_a_registered_runtime_is_sent_only_the_token_it_registered_with(recorder, tmp_path):
    """A service with a sandbox token for its runtime given by URL and a registration token of its own: a real
    runtime registering itself (its own token the registration token) is swept with that token, and a registered
    "runtime" never sees the sandbox token."""
    recording, recorder_url = recorder
    static = start_server(tmp_path / "static", "bwrap", SANDBOX_TOKEN)
    service = localstack.start_rollout_service([static.url], [], "--sandbox-token", SANDBOX_TOKEN)
    runtime = None
    try:
        runtime = start_server(
            tmp_path / "registering", "bwrap", REGISTRATION_TOKEN, "--register", service.url, "--heartbeat-s", "0.5"
        )
        assert register(
            service.url, "recorder", recorder_url, {"Authorization": f"Bearer {REGISTRATION_TOKEN}"}
        ).is_success
        await until(lambda: len(registered(service, {})) == 2, "both runtimes registered")
        await asyncio.wait_for(recording.called.wait(), 30)  # the service looked for its leftovers there
        assert set(recording.authorizations) == {f"Bearer {REGISTRATION_TOKEN}"}

        def swept() -> bool:  # the real runtime answered the service's own call with its token
            metrics = httpx.get(f"{runtime.url}/metrics", headers={"Authorization": f"Bearer {REGISTRATION_TOKEN}"})
            return 'route="/v1/sandboxes",status="200"' in metrics.text

        await until(swept, "the service called the registered runtime")
        metrics = httpx.get(f"{runtime.url}/metrics", headers={"Authorization": f"Bearer {REGISTRATION_TOKEN}"})
        assert 'status="401"' not in metrics.text
    finally:
        if runtime is not None:
            stop_server(runtime)
        service.stop()
        stop_server(static)
