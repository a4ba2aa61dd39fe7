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
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import REGISTRATION_TOKEN, TINY_MODEL
from sandbox_runtime import cli as runtime_cli

from .conftest import BACKEND_SKIPS, start_server, stop_server

API_TOKEN = "the-services-api-token-0123456789"
SANDBOX_TOKEN = "the-static-runtimes-token-0123456789"


RUNTIME_TOKEN = "the-registering-runtimes-own-token-0123456789"


def heartbeat(url: str, token: str | None = None, leaving: bool = False) -> dict:
    beat = {"url": url, "capacity": 4, "sandboxes": 0, "backend": "bwrap", "version": "0", "interval_s": 60}
    return {**beat, "token": token, "leaving": leaving}


def register(
    service: str, name: str, url: str, headers: dict[str, str], token: str | None = None, leaving: bool = False
) -> httpx.Response:
    body = heartbeat(url, token, leaving)
    return httpx.put(f"{service}/v1/runtimes/{name}", json=body, headers=headers, timeout=30)


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


def test_a_live_runtimes_name_cannot_be_taken_by_another_url(service):
    """A registered node re-registering another runtime's name with its own URL would take that runtime's traffic:
    refused (409) while the runtime lives; once it leaves, the name is free."""
    started, api = service
    bearer = {"Authorization": f"Bearer {REGISTRATION_TOKEN}"}
    assert register(started.url, "bound", "http://127.0.0.1:11", bearer, "own-token-a").is_success
    taken = register(started.url, "bound", "http://127.0.0.1:12", bearer, "own-token-b")
    assert taken.status_code == 409 and "another URL" in taken.json()["error"]
    runtimes = httpx.get(f"{started.url}/v1/runtimes", headers=api, timeout=30).json()["runtimes"]
    assert [r["url"] for r in runtimes if r["name"] == "bound"] == ["http://127.0.0.1:11"]
    assert register(started.url, "bound", "http://127.0.0.1:11", bearer, "own-token-a2").is_success  # a restart
    assert register(started.url, "bound", "http://127.0.0.1:11", bearer, leaving=True).is_success
    assert register(started.url, "bound", "http://127.0.0.1:12", bearer, "own-token-b").is_success


def test_the_registration_token_is_refused_as_a_runtimes_own(service):
    started, _api = service
    bearer = {"Authorization": f"Bearer {REGISTRATION_TOKEN}"}
    refused = register(started.url, "sharing", "http://127.0.0.1:13", bearer, REGISTRATION_TOKEN)
    assert refused.status_code == 400 and "registration token" in refused.json()["error"]


class Recorder:
    """A "runtime" that holds the registration token and records every Authorization it is sent."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        self.called = asyncio.Event()

    async def list_sandboxes(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization", ""))
        self.called.set()
        return web.json_response({"sandboxes": []})


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--token", "same", "--register-token", "same"], "--token must differ from --register-token"),
        (["--register-token", ""], "--register needs the services' registration token"),
    ],
)
def test_a_runtime_that_would_share_the_registration_token_does_not_start(argv, fragment, capsys):
    assert runtime_cli.main(["serve", "--register", "http://127.0.0.1:9", *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))
async def test_each_registered_runtime_is_sent_only_its_own_token(tmp_path):
    """A service with a sandbox token for its runtime given by URL and a registration token: a real runtime
    registering itself with a token of its own is swept with that token; two registered "runtimes" are each sent
    their own token only, never each other's, the registration token, or the sandbox token. Before, every
    registered runtime was called with the registration token, which every one of them holds."""
    recorders = [Recorder(), Recorder()]
    runners, urls = [], []
    for recording in recorders:
        app = web.Application()
        app.router.add_get("/v1/sandboxes", recording.list_sandboxes)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    static = start_server(tmp_path / "static", "bwrap", SANDBOX_TOKEN)
    service = localstack.start_rollout_service([static.url], [], "--sandbox-token", SANDBOX_TOKEN)
    runtime = None
    try:
        runtime = start_server(
            tmp_path / "registering", "bwrap", RUNTIME_TOKEN, "--register", service.url, "--heartbeat-s", "0.5"
        )
        bearer = {"Authorization": f"Bearer {REGISTRATION_TOKEN}"}
        for i, url in enumerate(urls):
            assert register(service.url, f"recorder-{i}", url, bearer, f"recorder-{i}-own-token").is_success
        await until(lambda: len(registered(service, {})) == 3, "all three runtimes registered")
        for recording in recorders:  # the service looked for its leftovers there
            await asyncio.wait_for(recording.called.wait(), 30)
        for i, recording in enumerate(recorders):
            assert set(recording.authorizations) == {f"Bearer recorder-{i}-own-token"}

        def swept() -> bool:  # the real runtime answered the service's own call with its own token
            metrics = httpx.get(f"{runtime.url}/metrics", headers={"Authorization": f"Bearer {RUNTIME_TOKEN}"})
            return 'route="/v1/sandboxes",status="200"' in metrics.text

        await until(swept, "the service called the registered runtime")
        metrics = httpx.get(f"{runtime.url}/metrics", headers={"Authorization": f"Bearer {RUNTIME_TOKEN}"})
        assert 'status="401"' not in metrics.text
    finally:
        if runtime is not None:
            stop_server(runtime)
        service.stop()
        stop_server(static)
        for runner in runners:
            await runner.cleanup()
