#!/usr/bin/env bash
# Regenerates tests/data/parity/ with PyTorch: Debian's python3-torch (light) plus the
# safetensors package in a virtual environment that sees the system site-packages.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  ${SUDO:-$( [ "$(id -u)" = 0 ] || echo sudo )} apt-get install -y -q python3-torch python3-venv
fi
venv=build/parity-venv
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -c "import safetensors" 2>/dev/null || "$venv/bin/pip" install -q safetensors
"$venv/bin/python" scripts/parity/make_parity_vectors.py
