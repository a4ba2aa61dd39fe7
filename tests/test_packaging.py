"""Every package in the source tree is in pyproject's package list: an editable install finds a forgotten one
anyway, a wheel (what users install) silently lacks it."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: REPO / name for name in ("sandbox_runtime", "prorl_adapter", "prorl_plugins")}
    found = {
        ".".join([name, *init.parent.relative_to(root).parts])
        for name, root in roots.items()
        for init in root.rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
