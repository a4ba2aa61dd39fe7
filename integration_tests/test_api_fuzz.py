"""Both servers fuzzed from their own OpenAPI documents (schemathesis), running as deployed: the sandbox runtime as
root with bwrap and a token, the rollout service with a token in front of it and a real vLLM server.

Every documented operation gets generated valid and invalid inputs (stateless), and sequences that follow the
documents' links (stateful: create a sandbox, exec in it, delete it; submit a job, poll it, cancel it, fetch its
result). The checks: no 5xx, every status, content type and body as documented, what the document calls invalid
is refused, a request without the token is refused, and at the end no sandbox, no sandbox process and no
sandbox folder is left.

One check is off: `positive_data_acceptance`, which counts any 4xx to a request that fits the schema as a
failure. These APIs refuse such requests by design and document it: limits the operator set (a timeout above
the server's maximum), state (a session that runs no command, a job id taken by another request) and the file
system (a path that does not exist). And on ProRL Agent's legacy calls (tag `prorl`), whose 503 before
POST /start and 500 after /stop are their contract, "no 5xx" is "only the documented 5xx" (`excluded_checks`).

Bounded for CI: PRORL_FUZZ_EXAMPLES examples per operation (default 10) and as many stateful scenarios; the
longer run is `PRORL_FUZZ_EXAMPLES=200 pytest integration_tests/test_api_fuzz.py`. Calls that may block (a long
poll, a batch take) have their waits clamped to a second, and jobs their budgets to BUDGET_S: the fuzzing is of
the inputs, not of the clock.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error

from prorl_adapter.dev.localstack import Service
from prorl_adapter.service.gateway import GATEWAY_API
from prorl_adapter.service.server import ROLLOUT_API
from sandbox_runtime.server import RUNTIME_API

from .conftest import BACKEND_SKIPS, RunningRuntime, start_rollout, start_server, stop_server

EXAMPLES = int(os.environ.get("PRORL_FUZZ_EXAMPLES", "10"))
RUNTIME_TOKEN, ROLLOUT_TOKEN = "fuzz-runtime-token", "fuzz-rollout-token"
BUDGET_S = 15.0  # a fuzzed job's whole budget (the service's --timeout and the cap of a job's own timeout_s)
BLOCKING_S = 1.0  # the most a long poll or a batch take may wait here
COMMAND_S = 5.0  # the most a generated command may run
OFF = ("positive_data_acceptance",)

pytestmark = pytest.mark.skipif(BACKEND_SKIPS["bwrap"] is not None, reason=str(BACKEND_SKIPS["bwrap"]))


@schemathesis.serializer("application/x-tar")
def tar_bytes(ctx, value: Any) -> bytes:
    """A generated archive body: bytes as they are (mostly not a tar: the server must say so), else a real tar."""
    if isinstance(value, bytes):
        return value
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = str(value).encode()
        member = tarfile.TarInfo("generated.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def config(token: str | None, **more: Any) -> schemathesis.Config:
    auth = {"auth": {"openapi": {"bearer": {"bearer": token}}}} if token else {}  # the documents' scheme, by name
    return schemathesis.Config.from_dict(
        {
            "seed": 20261201,
            **auth,
            "generation": {
                "max-examples": EXAMPLES,
                "mode": "all",
                "database": "none",
                "with-security-parameters": False,
            },
            "checks": {name: {"enabled": False} for name in OFF},
            "request-timeout": 120,
            **more,
        }
    )


def excluded_checks(case: schemathesis.Case) -> list:
    """ProRL Agent's legacy calls answer 5xx by contract (503 before POST /start, 500 for a call that /stop
    cancelled), as ProRL's clients expect: there, "no 5xx" gives way to "only the documented 5xx, with their
    documented bodies" (status and schema conformance). Everywhere else no 5xx passes."""
    return [not_a_server_error] if "prorl" in (case.operation.tags or []) else []


def _bounded(body: dict, key: str, most: float) -> None:
    """`body[key]` at most `most`, and `most` where it is left out; a value of the wrong type stays (invalid)."""
    value = body.get(key)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        body[key] = most if value is None else min(value, most)


def clamp(case: schemathesis.Case) -> None:
    """Bound what a generated request may make the server wait for (see the module's docstring)."""
    if isinstance(case.query, dict) and isinstance(case.query.get("wait"), (int, float)):
        case.query["wait"] = min(case.query["wait"], BLOCKING_S)
    body = case.body
    if not isinstance(body, dict):
        return
    if "size" in body:  # a batch take waits up to timeout_s, an hour when it is left out
        _bounded(body, "timeout_s", BLOCKING_S)
    if {"command", "argv", "script"} & body.keys():  # a command may wait (`cat` reads the terminal)
        _bounded(body, "timeout", COMMAND_S)
    for job in body["requests"] if isinstance(body.get("requests"), list) else [body]:
        if isinstance(job, dict) and isinstance(job.get("timeout_s"), (int, float)) and "task" in job:
            job["timeout_s"] = min(job["timeout_s"], BUDGET_S)


def fuzz_stateful(schema: schemathesis.BaseSchema, base_url: str, clean: Callable[[], None]) -> None:
    """Scenarios that follow the document's links, each starting from a server with nothing in it (`clean`).

    Which rule may run next depends on what the server answered (a link is followed only from a reply that
    carries it), and a server's answers depend on time (a job finished or not yet). Hypothesis sees that as
    inconsistent data generation and raises `Flaky`. Like schemathesis' own runner, a Flaky run is a pass unless a
    check failed in it: every failure is recorded as it happens, and the first one fails the test."""
    failures: list[Exception] = []

    class Machine(schema.as_state_machine()):
        def setup(self):
            try:
                clean()
            except Exception as exc:  # something the last scenario left behind
                failures.append(exc)
                raise

        def before_call(self, case):
            clamp(case)
            super().before_call(case)

        def get_call_kwargs(self, case):
            return {"base_url": base_url}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            try:
                case.validate_response(
                    response,
                    additional_checks=additional_checks,
                    excluded_checks=excluded_checks(case),
                    transport_kwargs=kwargs or None,
                    recorder=self.recorder,  # what the stateful checks read (a deleted resource still there)
                )
            except Exception as exc:
                failures.append(exc)
                raise

    try:
        Machine.run(
            settings=hypothesis.settings(
                max_examples=EXAMPLES,
                stateful_step_count=6,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(hypothesis.HealthCheck),
                phases=[hypothesis.Phase.generate],
            )
        )
    except hypothesis.errors.Flaky:
        if failures:
            raise failures[0] from None
    finally:
        clean()


def state_processes(state_dir: Path, server_pid: int) -> list[int]:
    """Processes other than the server whose command line names its state dir (bwrap and what it binds)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            pid = int(entry.name) if entry.name.isdigit() else server_pid
            if pid != server_pid and str(state_dir).encode() in (entry / "cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass  # gone meanwhile
    return found


def delete_all_and_check_nothing_is_left(runtime: RunningRuntime) -> None:
    headers = {"Authorization": f"Bearer {RUNTIME_TOKEN}"}
    listed = requests.get(f"{runtime.url}/v1/sandboxes", headers=headers, timeout=30).json()["sandboxes"]
    for box in listed:
        assert requests.delete(f"{runtime.url}/v1/sandboxes/{box['id']}", headers=headers, timeout=60).ok
    assert requests.get(f"{runtime.url}/v1/sandboxes", headers=headers, timeout=30).json()["sandboxes"] == []
    assert list((runtime.state_dir / "sandboxes").iterdir()) == []
    assert state_processes(runtime.state_dir, runtime.process.pid) == []


# -- the sandbox runtime --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzzed_runtime(tmp_path_factory) -> Iterator[RunningRuntime]:
    server = start_server(tmp_path_factory.mktemp("fuzz-runtime"), "bwrap", RUNTIME_TOKEN, "--max-sandboxes", "64")
    yield server
    stop_server(server)


# The documents the servers serve at /openapi.json are these (tests/test_openapi.py); loaded here at import,
# because schemathesis' loader from a pytest fixture reads pytest internals that pytest 9 no longer has.
runtime_api = schemathesis.openapi.from_dict(RUNTIME_API.document(), config=config(RUNTIME_TOKEN))


def test_the_runtime_serves_the_document_fuzzed_here(fuzzed_runtime):
    served = requests.get(f"{fuzzed_runtime.url}/openapi.json", timeout=30)
    assert served.json() == json.loads(json.dumps(RUNTIME_API.document()))


@runtime_api.parametrize()
def test_every_runtime_operation_answers_as_documented(case, fuzzed_runtime):
    clamp(case)
    case.call_and_validate(base_url=fuzzed_runtime.url, excluded_checks=excluded_checks(case))


def test_runtime_sequences_follow_the_links(fuzzed_runtime):
    fuzz_stateful(runtime_api, fuzzed_runtime.url, lambda: delete_all_and_check_nothing_is_left(fuzzed_runtime))


def test_the_runtime_leaves_nothing_behind(fuzzed_runtime):
    delete_all_and_check_nothing_is_left(fuzzed_runtime)


# -- the rollout service --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout_runtime(tmp_path_factory) -> Iterator[RunningRuntime]:
    server = start_server(tmp_path_factory.mktemp("fuzz-rollout-sandboxes"), "bwrap", RUNTIME_TOKEN)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def fuzzed_rollout(rollout_runtime, vllm) -> Iterator[Service]:
    service = start_rollout(
        [rollout_runtime.url],
        [vllm.url],
        "--token",
        ROLLOUT_TOKEN,
        "--sandbox-token",
        RUNTIME_TOKEN,
        "--timeout",
        str(BUDGET_S),
        "--max-run-workers",
        "16",
    )
    yield service
    service.stop()


# Cancelling a job (DELETE /v1/jobs/{id}) keeps it readable, in state `cancelled`, as documented: not a deleted
# resource that is still there.
rollout_api = schemathesis.openapi.from_dict(
    ROLLOUT_API.document(),
    config=config(ROLLOUT_TOKEN, checks={name: {"enabled": False} for name in (*OFF, "use_after_free")}),
)


def test_the_rollout_service_serves_the_document_fuzzed_here(fuzzed_rollout):
    served = requests.get(f"{fuzzed_rollout.url}/openapi.json", timeout=30)
    assert served.json() == json.loads(json.dumps(ROLLOUT_API.document()))


@rollout_api.parametrize()
def test_every_rollout_operation_answers_as_documented(case, fuzzed_rollout):
    clamp(case)
    case.call_and_validate(base_url=fuzzed_rollout.url, excluded_checks=excluded_checks(case))


def test_rollout_sequences_follow_the_links(fuzzed_rollout):
    # The service's jobs stay (finished ones are forgotten in time, not through the API): its scenarios start
    # from whatever the earlier ones left, which is the Flaky case fuzz_stateful describes.
    fuzz_stateful(rollout_api, fuzzed_rollout.url, clean=lambda: None)


# The LLM gateway, on its own port: what a sandbox's code reaches. Its keys are random, so a generated call is
# refused (404) or, with a bad body, a 400; what it checks is that no input breaks it, and that it says so as
# documented.
gateway_api = schemathesis.openapi.from_dict(GATEWAY_API.document(), config=config(None))


@pytest.fixture(scope="module")
def fuzzed_gateway(fuzzed_rollout) -> str:
    headers = {"Authorization": f"Bearer {ROLLOUT_TOKEN}"}
    status = requests.get(f"{fuzzed_rollout.url}/v1/status", headers=headers, timeout=30).json()
    return f"http://{status['gateway_address']}"


@gateway_api.parametrize()
def test_every_gateway_operation_answers_as_documented(case, fuzzed_gateway):
    case.call_and_validate(base_url=fuzzed_gateway)


def test_the_rollout_service_leaves_no_sandbox_behind(fuzzed_rollout, rollout_runtime):
    """Stopped after the fuzzing, with whatever is still queued or running (the generated prompts may be many),
    the service deletes every sandbox it made: none, no sandbox process and no sandbox folder is left."""
    headers = {"Authorization": f"Bearer {ROLLOUT_TOKEN}"}
    figures = requests.get(f"{fuzzed_rollout.url}/v1/buffer", headers=headers, timeout=30).json()
    status = requests.get(f"{fuzzed_rollout.url}/v1/status", headers=headers, timeout=30).json()
    fuzzed_rollout.stop()  # SIGTERM: a graceful stop, as an operator's
    runtime_headers = {"Authorization": f"Bearer {RUNTIME_TOKEN}"}
    left = requests.get(f"{rollout_runtime.url}/v1/sandboxes", headers=runtime_headers, timeout=30).json()
    assert left == {"sandboxes": []}, f"left behind; the service had {status} and {figures}"
    assert list((rollout_runtime.state_dir / "sandboxes").iterdir()) == []
    assert state_processes(rollout_runtime.state_dir, rollout_runtime.process.pid) == []
