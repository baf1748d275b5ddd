#!/usr/bin/env bash
# Prints the path of a Python virtual environment holding what the Python package's build and
# tests need — PyPI's torch 2.x with all its dependencies (the truth the differential tests
# compare against), numpy, pytest, hypothesis, scikit-build-core, nanobind, and transformers
# (the models' own attention formulas the score-variant tests compare against) — creating it first
# if missing. It lives outside the clone, in ${MHA_CACHE:-~/.cache/mha}, so repeated runs on one
# machine do not download torch (about 5 GB with its dependencies) again; a fresh machine does.
# The environment's name carries a hash of the requirements below: changing them makes a new one.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=(
  "torch==2.15.0" "numpy>=1.26" "pytest>=8" "hypothesis>=6.100"
  "scikit-build-core>=0.10" "nanobind>=2.0" "transformers==5.24.0"
)
scripts/deps.sh python3 python3-dev python3-venv >&2
key=$(printf '%s\n' "${requirements[@]}" "$(/usr/bin/python3 -V 2>&1)" | sha256sum | cut -c1-12)
venv=${MHA_CACHE:-$HOME/.cache/mha}/py-venv-$key
if [ ! -f "$venv/.complete" ]; then
  echo "py-env: creating $venv (downloads torch 2.x with its dependencies, ~5 GB)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "${requirements[@]}" >&2
  touch "$venv/.complete"
fi
echo "$venv"
