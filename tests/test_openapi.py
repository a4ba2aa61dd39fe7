"""The OpenAPI documents: valid OpenAPI 3.1, the committed copies in docs/openapi/ are what the code writes, every
route a server has is in its document, and the document is served without a token while the rest needs one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openapi_spec_validator import validate

from prorl_adapter.service.config import RolloutConfig
from prorl_adapter.service.gateway import GATEWAY_API
from prorl_adapter.service.server import ROLLOUT_API
from prorl_adapter.service.server import create_app as create_rollout_app
from sandbox_runtime.config import ServerConfig
from sandbox_runtime.server import RUNTIME_API
from sandbox_runtime.server import create_app as create_runtime_app
from server_kit.openapi import API, AUTH_ERRORS, render_markdown

from .fakes.rigs import rollout_stack

DOCS = Path(__file__).resolve().parents[1] / "docs" / "openapi"
APIS = pytest.mark.parametrize("api", [RUNTIME_API, ROLLOUT_API, GATEWAY_API], ids=lambda api: api.name)


@APIS
def test_the_document_is_valid_openapi_3_1(api: API):
    document = api.document()
    assert document["openapi"] == "3.1.0"
    validate(document)


@APIS
def test_the_committed_reference_is_what_the_code_writes(api: API):
    stale = "docs/openapi is out of date: run `make openapi` and commit the result"
    assert json.loads((DOCS / f"{api.name}.json").read_text()) == api.document(), stale
    assert (DOCS / f"{api.name}.md").read_text() == render_markdown(api), stale


@APIS
def test_every_operation_has_an_error_body_and_links_name_real_operations(api: API):
    document = api.document()
    operations = {op["operationId"] for path in document["paths"].values() for op in path.values()}
    assert len(operations) == len(api.all_operations()), "operation ids must be unique"
    for path in document["paths"].values():
        for op in path.values():
            statuses = {int(s) for s in op["responses"]}
            assert any(s < 400 for s in statuses) and 403 in statuses
            if op.get("security") != []:  # the bearer token's 401
                assert 401 in statuses
            else:  # a public operation's 401 is its own credential's (the gateway's key in a header), never the token's
                assert 401 not in statuses or op["responses"]["401"]["description"] != AUTH_ERRORS[401]
            for reply in op["responses"].values():
                for link in reply.get("links", {}).values():
                    assert link["operationId"] in operations


def route_table(app) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def document_table(api: API) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in api.document()["paths"].items() for method in ops}


def test_every_route_of_both_servers_is_in_its_document(tmp_path):
    runtime = create_runtime_app(ServerConfig(state_dir=tmp_path))
    rollout = create_rollout_app(RolloutConfig(sandbox_urls=["http://127.0.0.1:1"], llm_urls=[], tokenizer="x"))
    assert route_table(runtime) == document_table(RUNTIME_API)
    assert route_table(rollout) == document_table(ROLLOUT_API)


async def test_the_document_is_served_without_the_token_and_nothing_else_is():
    async with rollout_stack(token="secret") as stack:
        http = stack.http
        served = await http.get("/openapi.json", headers={"Authorization": ""})
        assert served.status == 200
        assert await served.json() == json.loads(json.dumps(ROLLOUT_API.document()))
        assert (await http.get("/v1/status", headers={"Authorization": ""})).status == 401
        assert (await http.get("/v1/status", headers={"Authorization": "Bearer secret"})).status == 200
