#!/usr/bin/env bash
# Runs the full benchmark against PyTorch in the same process (forward, memory, decoding,
# training tables) and draws the plot:
#   bench/run.sh [extra mha_bench flags]
# Needs network access to PyPI once: it installs torch (the PyPI wheel carries libtorch; only
# libtorch_cpu is used, so the CUDA dependencies are skipped) and matplotlib into build/bench-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh python3-venv
venv=build/bench-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c "import matplotlib" 2>/dev/null || "$venv/bin/pip" install -q matplotlib
torch_dir=$("$venv/bin/python" - <<'PY' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("torch")
print(os.path.dirname(spec.origin) if spec else "")
PY
)
if [ -z "$torch_dir" ] || [ ! -f "$torch_dir/lib/libtorch_cpu.so" ]; then
  "$venv/bin/pip" install -q --no-deps torch
  torch_dir=$("$venv/bin/python" -c "import importlib.util,os; print(os.path.dirname(importlib.util.find_spec('torch').origin))")
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_BENCH=ON -DMHA_TORCH_DIR="$torch_dir" >/dev/null
cmake --build build -j"$(nproc)" --target mha_bench
mkdir -p build/bench
build/mha_bench --threads 2 --sweep --csv build/bench/results.csv --json build/bench/results.json "$@" | tee build/bench/results.txt
build/mha_bench --threads 2 --memory | tee -a build/bench/results.txt
build/mha_bench --threads 2 --decode --csv build/bench/decode.csv | tee -a build/bench/results.txt
build/mha_bench --threads 2 --train --csv build/bench/train.csv | tee -a build/bench/results.txt
"$venv/bin/python" bench/plot.py build/bench/results.json build/bench/attention_sweep.png
