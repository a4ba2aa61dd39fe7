#!/usr/bin/env bash
# The environment agent programs run in inside the sandboxes: a virtualenv of the system's own Python with the
# `openai` and `anthropic` clients and `litellm`, at /opt/prorl-agent (PRORL_AGENT_ENV to put it elsewhere).
# Why there: a bwrap sandbox without an image sees only /usr of the host and the paths its runtime names
# (`prorl-sandbox serve --host-path /opt/prorl-agent`, docs/runtime.md), so neither .venv (its Python lives under
# pyenv in /root here) nor a clone in /tmp would be visible inside; a venv of /usr/bin/python3 in a named path is.
# On a cluster the harness belongs in the image instead.
# Idempotent: a marker file says the venv is complete.
set -euo pipefail
venv="${PRORL_AGENT_ENV:-/opt/prorl-agent}"
packages="openai==3.57.0 anthropic==2.17.0 litellm==1.110.2"
marker="$venv/.agent-installed"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$packages" ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo /usr/bin/python3 -m venv "$venv"
# shellcheck disable=SC2086 # the package list is words
$sudo "$venv/bin/python" -m pip install -q $packages
"$venv/bin/python" -c 'import anthropic, openai, litellm; print("agent env: openai", openai.__version__, "anthropic", anthropic.__version__)'
echo "$packages" | $sudo tee "$marker" >/dev/null
