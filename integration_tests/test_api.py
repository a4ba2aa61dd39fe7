"""The HTTP API's contract: bad input gets a 4xx JSON error that says what is wrong, auth, limits, metrics."""

from __future__ import annotations

import httpx
import pytest

from sandbox_runtime.cli import main as cli_main
from sandbox_runtime.client import SandboxAPIError

from .conftest import BACKEND_SKIPS, start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    backend = "bwrap" if not BACKEND_SKIPS["bwrap"] else "local"
    server = start_server(tmp_path_factory.mktemp("api-state"), backend, "s3cret", "--max-sandboxes", "3")
    yield server
    stop_server(server)


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer s3cret"}) as http:
        yield http


@pytest.fixture
async def box_id(http):
    created = await http.post("/v1/sandboxes", json={})
    assert created.status_code == 201
    yield created.json()["id"]
    await http.delete(f"/v1/sandboxes/{created.json()['id']}")


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["status"] == status
    return body["error"]


async def test_token_is_required_everywhere_but_healthz(server):
    async with httpx.AsyncClient(base_url=server.url) as anonymous:
        assert (await anonymous.get("/healthz")).status_code == 200
        for method, path in [("GET", "/v1/info"), ("POST", "/v1/sandboxes"), ("GET", "/metrics")]:
            assert "bearer token" in error_of(await anonymous.request(method, path), 401)
        wrong = await anonymous.get("/v1/info", headers={"Authorization": "Bearer nope"})
        error_of(wrong, 401)


async def test_malformed_and_invalid_bodies(http, box_id):
    as_json = {"Content-Type": "application/json"}
    malformed = await http.post(f"/v1/sandboxes/{box_id}/exec", content=b"{bad", headers=as_json)
    assert "Invalid JSON" in error_of(malformed, 400)
    untyped = await http.post(f"/v1/sandboxes/{box_id}/exec", content=b'{"command": "true"}')
    assert "application/json" in error_of(untyped, 415)
    assert "command" in error_of(await http.post(f"/v1/sandboxes/{box_id}/exec", json={}), 400)
    typo = await http.post(f"/v1/sandboxes/{box_id}/exec", json={"command": "true", "timout": 3})
    assert "timout" in error_of(typo, 400)
    bad_session = await http.post(f"/v1/sandboxes/{box_id}/exec", json={"command": "true", "session": "../x"})
    assert "session" in error_of(bad_session, 400)
    negative = await http.post(f"/v1/sandboxes/{box_id}/exec", json={"command": "true", "timeout": -1})
    assert "timeout" in error_of(negative, 400)
    too_long = await http.post(f"/v1/sandboxes/{box_id}/exec", json={"command": "true", "timeout": 1e9})
    assert "maximum" in error_of(too_long, 400)
    both = await http.post(f"/v1/sandboxes/{box_id}/sessions/default/input", json={"text": "x", "keys": ["C-c"]})
    assert "exactly one" in error_of(both, 400)
    assert "path" in error_of(await http.get(f"/v1/sandboxes/{box_id}/files"), 400)
    garbage_tar = await http.put(f"/v1/sandboxes/{box_id}/archive", params={"path": "x"}, content=b"not a tar")
    error_of(garbage_tar, 400)


async def test_bad_sandbox_specs(http):
    for spec, field in [
        ({"workdir": "relative"}, "workdir"),
        ({"workdir": "/etc"}, "workdir"),
        ({"limits": {"pids": 0}}, "pids"),
        ({"limits": {"memory": 5}}, "memory"),
        ({"backend": "docker"}, "docker"),
        ({"network": "bridge"}, "network"),
        ({"image": "/does/not/exist"}, "image"),
    ]:
        assert field in error_of(await http.post("/v1/sandboxes", json=spec), 400)
    assert (await http.get("/v1/sandboxes")).json()["sandboxes"] == []  # nothing half-made was left


async def test_unknown_ids(http, box_id):
    assert "no sandbox" in error_of(await http.get("/v1/sandboxes/feedface0000"), 404)
    assert "no sandbox" in error_of(await http.post("/v1/sandboxes/feedface0000/exec", json={"command": "x"}), 404)
    assert error_of(await http.delete("/v1/sandboxes/feedface0000"), 404)
    assert error_of(await http.get(f"/v1/sandboxes/{box_id}/sessions/ghost/output"), 404)
    assert error_of(await http.delete(f"/v1/sandboxes/{box_id}/sessions/ghost"), 404)
    assert error_of(await http.get("/v1/nothing-here"), 404)


async def test_delete_is_idempotent(http):
    box = (await http.post("/v1/sandboxes", json={})).json()["id"]
    first = await http.delete(f"/v1/sandboxes/{box}")
    second = await http.delete(f"/v1/sandboxes/{box}")
    assert first.json()["already_deleted"] is False and second.json()["already_deleted"] is True


async def test_oversize_body_is_refused(server, http, box_id):
    info = (await http.get("/v1/info")).json()
    too_big = b"x" * (info["max_body_bytes"] + 1)
    response = await http.put(f"/v1/sandboxes/{box_id}/files", params={"path": "big"}, content=too_big)
    assert "too large" in error_of(response, 413)


async def test_max_sandboxes(server):
    async with server.client() as client:
        boxes = [await client.create_sandbox() for _ in range(3)]
        with pytest.raises(SandboxAPIError) as full:
            await client.create_sandbox()
        assert full.value.status == 429 and "limit" in full.value.message
        for box in boxes:
            await client.delete_sandbox(box.id)


async def test_info_and_metrics(http, box_id):
    info = (await http.get("/v1/info")).json()
    names = {b["name"]: b for b in info["backends"]}
    assert names["local"]["isolated"] is False and "NOT ISOLATED" in names["local"]["detail"]
    assert info["sandboxes"] >= 1
    await http.post(f"/v1/sandboxes/{box_id}/exec", json={"command": "true"})
    metrics = (await http.get("/metrics")).text
    assert "prorl_sandbox_created_total" in metrics
    assert 'prorl_sandbox_exec_seconds_count{status="completed"}' in metrics


def test_cli_refuses_a_public_bind_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("PRORL_SANDBOX_TOKEN", raising=False)
    assert cli_main(["serve", "--host", "0.0.0.0"]) == 2
    assert "without a token" in capsys.readouterr().err


async def test_a_non_utf8_authorization_header_is_a_401(server):
    async with httpx.AsyncClient(base_url=server.url) as raw:
        answer = await raw.get("/v1/info", headers={"Authorization": b"Bearer \xff\xfe s3cret"})
    assert answer.status_code == 401 and "bearer token" in answer.json()["error"]
