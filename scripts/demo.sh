#!/usr/bin/env bash
# Builds mha and runs its demo: the three seed modules on built-in inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec build/mha demo "$@"
