#!/usr/bin/env bash
# mha against PyTorch 2.x, OpenVINO and ONNX Runtime in one process (bench/peers.py), on this
# machine's measured fp32 FMA peak. Installs the peers once into build/peer-pkgs (PyPI:
# openvino, onnxruntime, onnx) next to the cached torch 2.x environment of scripts/py-env.sh.
#   bench/peers.sh [--seconds S] [--markdown FILE] [--json FILE] [--plot PNG] [--backward] [--decode]
# --backward: forward + backward through autograd instead (mha vs torch, fp32/bf16/fp16).
# --decode: one decoding step from mha's caches of every type against torch SDPA, OpenVINO's SDPA
# op and ONNX Runtime's GroupQueryAttention.
# --plot draws the --json results (bench/plot_peers.py; matplotlib goes into build/peer-pkgs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(scripts/py-env.sh)
pkgs=build/peer-pkgs
if [ ! -f "$pkgs/.complete" ]; then
  "$venv/bin/pip" install -q --disable-pip-version-check --target "$pkgs" openvino onnxruntime onnx matplotlib
  touch "$pkgs/.complete"
fi
scripts/build.sh >/dev/null
"$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall .
peaks=$(build/mha bench --peak --threads 2)
echo "$peaks"
peak=$(echo "$peaks" | sed -n 's/^fp32 FMA peak: \([0-9.]*\).*/\1/p')
bf16_peak=$(echo "$peaks" | sed -n 's/^bf16 dot-product peak: \([0-9.]*\).*/\1/p')
# Where the CPU has AMX, mha's bfloat16 forward (and torch's) runs tile products: their peak is
# the one a bfloat16 rate is a share of.
amx_peak=$(echo "$peaks" | sed -n 's/^bf16 AMX tile peak: \([0-9.]*\).*/\1/p')
if [ -n "$amx_peak" ] && [ "${amx_peak%.*}" -gt 0 ]; then bf16_peak=$amx_peak; fi
plot="" json=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --plot) plot=$2; shift 2 ;;
    --json) json=$2; args+=(--json "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "$plot" ] && [ -z "$json" ]; then json=build/peers.json; args+=(--json "$json"); fi
PYTHONPATH="$PWD/$pkgs" "$venv/bin/python" bench/peers.py --peak "$peak" --bf16-peak "$bf16_peak" "${args[@]}"
if [ -n "$plot" ]; then
  [ -f "$pkgs/matplotlib/__init__.py" ] || "$venv/bin/pip" install -q --disable-pip-version-check --target "$pkgs" matplotlib
  PYTHONPATH="$PWD/$pkgs" "$venv/bin/python" bench/plot_peers.py "$json" "$plot"
  echo "plot: $plot"
fi
