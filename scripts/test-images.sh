#!/usr/bin/env bash
# The test suite's real images (a root directory, an OCI layout, a docker archive, a SIF file, all with the same
# Debian bookworm root and its /testbed repository), built offline from the host's Debian mirror and cached by
# a hash of their recipe; `.test-images` in the repository root points at them. Idempotent: with nothing
# changed it only hashes the recipe. What and why: scripts/build_test_images.py, scripts/test_images/README.md.
# Usage: scripts/test-images.sh [--rebuild] [--check] [--print-key]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The system's Python: the build needs nothing but the standard library.
python="$(command -v /usr/bin/python3 || command -v python3)"
exec "$python" "$here/build_test_images.py" "$@"
