"""Which implementation a contract test runs on: `kind`, "memory" or "redis", a parameter of every test here.

The memory variants run everywhere (`make unit` included). The Redis variants run on one redis-server of the
session, started on first use (integration_tests/redis_server.py, as the Redis integration tests start theirs), and
each test keeps its keys under a prefix of its own (`prefix`), so that tests never see each other's state. Where
redis-server or the redis package is missing the Redis variants skip with the reason, except under
PRORL_REQUIRE_BACKENDS (`make test`, hence CI), where a missing part is a broken install and they fail.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from importlib.util import find_spec

import pytest

from integration_tests.redis_server import REDIS_SKIP, RedisServer
from tests.docs.doc_blocks import missing

from . import KINDS


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    if REDIS_SKIP:
        missing(REDIS_SKIP)
    if find_spec("redis") is None:
        missing("the redis Python package is missing (pip install 'prorl-adapter[redis]'; make test installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis-contracts")).start()
    yield server.url
    server.kill()


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    if request.param == "redis":
        request.getfixturevalue("redis_url")  # skips (or fails) here, before the test builds anything
    return request.param


@pytest.fixture
def prefix() -> str:
    """This test's own Redis key prefix."""
    return f"contract:{uuid.uuid4().hex[:12]}"
