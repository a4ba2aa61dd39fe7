#!/usr/bin/env bash
# Serve a model with vLLM on the CPU, from .venv-vllm (scripts/vllm-env.sh builds it), on loopback.
# Usage: scripts/serve-vllm.sh MODEL_DIR PORT [extra vllm args...]
# The served model name is "tiny". VLLM_SERVER_DEV_MODE=1 exposes the dev endpoints (weight reload,
# sleep/wake). Findings and pitfalls: docs/vllm-cpu.md.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 MODEL_DIR PORT [extra vllm args...]" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
[ -x "$venv/bin/python" ] || { echo "no vLLM venv at $venv: run scripts/vllm-env.sh" >&2; exit 1; }
model="$1" port="$2"; shift 2
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"   # GiB of KV cache; the default takes far more
export VLLM_SERVER_DEV_MODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# --logprobs-mode processed_logprobs: each sampled token's logprob under the distribution it was drawn from
# (after temperature and top-p), not the raw model's; a trainer's importance ratio needs the sampling policy.
# `python -m ...api_server`, not the `vllm` CLI: the CLI looks up the wrong distribution name (vllm-cpu).
exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$model" --served-model-name tiny \
  --host 127.0.0.1 --port "$port" \
  --dtype float32 --max-model-len 4096 \
  --logprobs-mode processed_logprobs \
  "$@"
