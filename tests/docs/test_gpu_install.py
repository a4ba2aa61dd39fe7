"""docs/verl.md's GPU install steps, checked against verl 0.9.1's own requirements (its package metadata, read
from the verl installed here): the versions the doc's table and its pip lines name are the ones verl pins."""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
SECTION = DOC.read_text().split("## GPU install", 1)[1].split("\n## ", 1)[0]
VERL = "0.9.1"


def verl_requirements(extra: str | None) -> list[Requirement]:
    """What verl requires with `extra` (None: without any), its own nested extras (`verl[verl-core]`) expanded."""
    found: list[Requirement] = []
    for line in importlib.metadata.requires("verl") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        wanted = marker is None if extra is None else marker is not None and marker.evaluate({"extra": extra})
        if wanted:
            if requirement.name == "verl":
                found += [r for nested in requirement.extras for r in verl_requirements(nested)]
            else:
                found.append(requirement)
    return found


def pinned_by(requirement: Requirement, requirements: list[Requirement]) -> bool:
    """Whether verl requires `requirement`'s package with at least the doc's version bounds (the doc may leave an
    exclusion such as `!=0.9.0` to its prose) and extras."""
    return any(
        r.name == requirement.name and set(requirement.specifier) <= set(r.specifier) and requirement.extras <= r.extras
        for r in requirements
    )


def table_row(extra: str) -> list[Requirement]:
    """The requirements in backticks on the table row of `extra`."""
    [row] = [line for line in SECTION.splitlines() if line.startswith(f"| {extra} |")]
    return [Requirement(text) for text in re.findall(r"`([A-Za-z][\w.-]*(?:\[[\w,-]+\])?[<>=!][^`]*)`", row)]


def test_the_installed_verl_is_the_one_the_doc_is_for():
    assert importlib.metadata.version("verl") == VERL
    assert f"verl[vllm,fsdp]=={VERL}" in SECTION


@pytest.mark.parametrize("extra", ["vllm", "fsdp"])
def test_each_pin_of_the_table_is_verls_own(extra):
    pins = table_row(f"`{extra}`")
    assert pins, f"no pins read from the row of {extra}"
    requirements = verl_requirements(extra)
    assert [str(pin) for pin in pins if not pinned_by(pin, requirements)] == []


def test_the_pins_every_extra_shares_and_the_python_range_are_verls():
    pins = table_row("(all)")
    assert pins and [str(pin) for pin in pins if not pinned_by(pin, verl_requirements(None))] == []
    python = importlib.metadata.metadata("verl")["Requires-Python"]
    assert SpecifierSet(python) == SpecifierSet(">=3.10,<3.13"), python
    assert "Python >= 3.10 and < 3.13" in SECTION


def test_the_pip_lines_install_the_torch_that_verl_pins():
    torch_line = next(line for line in SECTION.splitlines() if line.startswith("pip install torch=="))
    pins = [Requirement(word) for word in torch_line.split() if "==" in word]
    assert {pin.name for pin in pins} == {"torch", "torchvision", "torchaudio"}
    requirements = verl_requirements("vllm") + verl_requirements("fsdp")
    assert [str(pin) for pin in pins if not pinned_by(pin, requirements)] == []
