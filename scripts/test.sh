#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test. The one command CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
