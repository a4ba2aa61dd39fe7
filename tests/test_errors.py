"""The project's exceptions share one root, and a server answers for its own errors only: an `ApiError` with its
status, a failed call to another server with 502/503 (never that server's status), anything else with 500."""

import importlib
import inspect
import os
import pkgutil

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import prorl_adapter
import prorl_plugins
import sandbox_runtime
import server_kit
from prorl_adapter.trainer.client import RolloutAPIError
from sandbox_runtime.client import SandboxAPIError, SandboxUnreachable
from server_kit.errors import ApiError, DownstreamError, ProrlError
from server_kit.webapp import errors_as_json

PACKAGES = (server_kit, sandbox_runtime, prorl_adapter, prorl_plugins)


def project_modules():
    for package in PACKAGES:
        yield package.__name__
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not info.name.endswith(".__main__"):  # importing one runs its command
                yield info.name


def test_every_exception_the_project_defines_derives_from_one_root():
    outside, unimportable = [], []
    for name in project_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # an optional backend's module, without its extra installed
            if exc.name is None or exc.name.partition(".")[0] in {package.__name__ for package in PACKAGES}:
                raise
            unimportable.append(f"{name} (needs {exc.name})")
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException) and not issubclass(cls, ProrlError):
                outside.append(f"{name}.{cls.__qualname__}")
    assert outside == []
    if unimportable and os.environ.get("PRORL_REQUIRE_BACKENDS"):
        pytest.fail(f"PRORL_REQUIRE_BACKENDS is set but these modules cannot be imported: {unimportable}")


class CarriesAStatus(Exception):
    """Not an ApiError: a `status` attribute alone no longer makes an answer."""

    status = 404


def raising(exc: BaseException):
    async def handler(request: web.Request) -> web.Response:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (SandboxAPIError(404, "no sandbox 'sb-1'"), 502),  # the runtime's 404 is not the caller's
        (RolloutAPIError(409, "job id taken"), 502),
        (SandboxUnreachable("http://127.0.0.1:1", ConnectionRefusedError("refused")), 503),
        (type("Gone", (ApiError,), {"status": 410})("gone"), 410),
        (CarriesAStatus("looks like an answer"), 500),
        (DownstreamError("the other server failed"), 502),
    ],
    ids=["downstream-404", "downstream-409", "unreachable", "api-error", "status-attribute", "downstream"],
)
async def test_a_handler_answers_for_its_own_errors_and_wraps_another_servers(exc, status):
    app = web.Application(middlewares=[errors_as_json(1024)])
    app.router.add_get("/", raising(exc))
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/")
        body = await response.json()
    assert response.status == status
    assert body["status"] == status
    if status != 500:
        assert body["error"] == str(exc)  # the message names the other server's answer
