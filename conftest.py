"""With PRORL_REQUIRE_BACKENDS set (`make test`, hence CI), every optional part the Makefile installs must be
importable: a missing one is a broken install to report, not a reason for its tests to skip quietly."""

import os
from importlib.util import find_spec

import pytest

REQUIRED = ("torch", "verl", "skyrl", "ray", "loguru", "matplotlib", "redis")


def pytest_configure(config):
    if os.environ.get("PRORL_REQUIRE_BACKENDS"):
        missing = [name for name in REQUIRED if find_spec(name) is None]
        if missing:
            raise pytest.UsageError(f"PRORL_REQUIRE_BACKENDS is set but {', '.join(missing)} is not installed")


# The code blocks of the README and the docs, run as tests against real servers (Sybil): tests/docs/doc_blocks.py.
pytest_plugins = ["tests.docs.doc_blocks"]
