"""The backend seam: a plugin set drives one training backend (the backend hooks are firstresult, so a second
would silently answer for the first), and each built-in backend is a `Backend`."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_adapter.hooks import Backend, PluginLoadError, PluginSet, hookimpl
from prorl_adapter.models import BatchItem, JobRequest


class ListBackend:
    """A backend of lists: one job per row."""

    @hookimpl
    def prorl_backend_requests(self, batch: list[dict[str, Any]]) -> list[JobRequest]:
        return [JobRequest(task="shell", instance=row) for row in batch]

    @hookimpl
    def prorl_backend_batch(self, items: list[BatchItem]) -> list[float]:
        return [item.trajectory.reward for item in items]


class VersionOnly:
    """Implements only the optional backend hook: still a second backend."""

    @hookimpl
    def prorl_backend_policy_version(self, batch: Any) -> int:
        return 7


def test_a_second_backend_is_refused_at_load_naming_both():
    with pytest.raises(PluginLoadError, match=r"more than one training backend is loaded \(.*ListBackend.*VersionOnly"):
        PluginSet.load(objects=[ListBackend(), VersionOnly()], entry_points=False)


def test_a_second_backend_registered_later_is_refused_and_not_kept():
    plugins = PluginSet.load(objects=[ListBackend()], entry_points=False)
    second = VersionOnly()
    with pytest.raises(PluginLoadError, match="more than one training backend"):
        plugins.register(second, name="second")
    assert not plugins.manager.is_registered(second)
    assert plugins.hooks.prorl_backend_policy_version(batch=[]) is None  # the refused one answers nothing


def test_one_backend_with_the_installed_plugins_loads():
    plugins = PluginSet.load(objects=[ListBackend()])
    assert plugins.hooks.prorl_backend_requests(batch=[{"goal": "g"}], config={})[0].instance == {"goal": "g"}


def test_the_built_in_backends_are_backends():
    pytest.importorskip("skyrl", reason="SkyRL is not installed: pip install -e '.[torch,skyrl]'")
    pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")
    from prorl_plugins.cpu_trainer.train import CpuTrainerBackend
    from prorl_plugins.skyrl import compat  # noqa: F401  (SkyRL on Python 3.11: before any skyrl import)
    from prorl_plugins.skyrl.hooks import SkyRLBackend
    from prorl_plugins.verl.backend import VerlBackend

    for backend in (CpuTrainerBackend, SkyRLBackend, VerlBackend, ListBackend):
        assert issubclass(backend, Backend), backend
    assert not issubclass(VersionOnly, Backend)  # a backend turns batches into jobs and back
