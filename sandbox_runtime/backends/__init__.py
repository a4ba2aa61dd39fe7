"""Sandbox backends by name. `local` exists but is never a default: it isolates nothing."""

from __future__ import annotations

from ..config import ServerConfig
from ..models import BackendInfo
from .apptainer import ApptainerBackend
from .base import Backend, BackendError
from .bwrap import BwrapBackend
from .local import LocalBackend

BACKENDS: dict[str, type[Backend]] = {
    "bwrap": BwrapBackend,
    "apptainer": ApptainerBackend,
    "singularity": ApptainerBackend,
    "local": LocalBackend,
}


def make_backend(name: str, config: ServerConfig) -> Backend:
    cls = BACKENDS.get(name)
    if cls is None:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}", 400)
    # --apptainer-binary names the operator's Apptainer wherever PATH looks (start-up checked it is one).
    available, detail = (True, "") if cls is ApptainerBackend and config.apptainer_binary else cls.probe()
    if not available:
        raise BackendError(f"backend {name!r} is not available here: {detail}", 400)
    if cls is BwrapBackend:
        return BwrapBackend(config.state_dir, host_paths=config.host_paths)
    if cls is ApptainerBackend:
        binary = config.apptainer_binary or ("singularity" if name == "singularity" else None)
        return ApptainerBackend(binary=binary, fakeroot=config.apptainer_fakeroot, cgroups=config.apptainer_cgroups)
    return LocalBackend()


def describe_backends() -> list[BackendInfo]:
    infos = []
    for name, cls in BACKENDS.items():
        available, detail = cls.probe()
        infos.append(BackendInfo(name=name, available=available, isolated=cls.isolated, detail=detail))
    return infos


__all__ = ["BACKENDS", "Backend", "BackendError", "describe_backends", "make_backend"]
