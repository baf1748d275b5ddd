#!/usr/bin/env bash
# Installs the Debian packages mha builds and tests with, if any is missing. Idempotent and
# quiet when everything is present. Usage: scripts/deps.sh [extra packages...]
set -euo pipefail
# Every package is listed: nothing relies on Recommends (installed with --no-install-recommends)
# or on what a machine happens to have. ocl-icd-opencl-dev: Debian's oneDNN CMake config
# requires OpenCL, though libdnnl-dev only recommends it.
packages=(cmake g++ make pkg-config git ca-certificates
          libdnnl-dev ocl-icd-opencl-dev opencl-c-headers libhwy-dev librandom123-dev nlohmann-json3-dev
          libcli11-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev "$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
