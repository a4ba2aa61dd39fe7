"""Makes SkyRL 0.3.0 importable on Python 3.11 (the project's floor); import it before any `skyrl` module.

`skyrl.tinker.types` (imported by everything under `skyrl.backends`, so by `skyrl.train.generators.base`) puts a
`typing.TypedDict` inside a pydantic model, which pydantic >= 2 refuses on Python < 3.12 ("Please use
`typing_extensions.TypedDict`"). SkyRL declares `Requires-Python >=3.11` all the same. While that one module is
imported, `typing.TypedDict` is `typing_extensions.TypedDict` (the same class on 3.12+), and it is put back
right after; nothing else in SkyRL is changed.
"""

from __future__ import annotations

import sys
import typing


def _import_tinker_types() -> None:
    import typing_extensions

    stdlib = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        import skyrl.tinker.types  # noqa: F401
    finally:
        typing.TypedDict = stdlib


if sys.version_info < (3, 12) and "skyrl.tinker.types" not in sys.modules:
    try:
        _import_tinker_types()
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"the SkyRL backend needs SkyRL: pip install 'prorl-adapter[skyrl]' ({exc})", name=exc.name
        ) from exc
