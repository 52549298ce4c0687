#!/usr/bin/env bash
# Set up (idempotent) and start an interactive chat with the default model (SmolLM2-135M-Instruct).
# Builds only the `fathom` binary; the test suites are built by scripts/test.sh.
# Extra arguments go to `fathom chat`, e.g. scripts/chat.sh -m gemma3
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh" --target fathom >&2
exec "$repo/build/fathom" chat "$@"
