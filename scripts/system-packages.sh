#!/usr/bin/env bash
# Install the Debian packages the project needs on this machine, only those missing.
# Usage: scripts/system-packages.sh COMMAND:PACKAGE ...   e.g. bwrap:bubblewrap redis-server:redis-server
set -euo pipefail
missing=()
for pair in "$@"; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing Debian packages: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
