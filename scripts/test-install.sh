#!/usr/bin/env bash
# Installs mha into a temporary prefix and builds the README's C++ example as a separate
# project three ways: find_package(mha 0.1 CONFIG) on the installed package, pkg-config's
# mha.pc, and add_subdirectory() of the source tree (what FetchContent does). Runs each.
# Prints "install: N passed, M failed". Usage: scripts/test-install.sh [build dir to install from]
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
from=${1:-build}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
check() {  # check NAME COMMAND...: runs the command quietly, counts and reports the result
  local name=$1
  shift
  if "$@" >"$work/log" 2>&1; then
    echo "install: $name: ok"
    passed=$((passed + 1))
  else
    tail -30 "$work/log"
    echo "install: $name: FAILED"
    failed=$((failed + 1))
  fi
}
check "cmake --install" cmake --install "$from" --prefix "$work/prefix"
check "find_package(mha 0.1 CONFIG)" bash -c "
  cmake -S '$root/tests/install' -B '$work/find' -DCMAKE_PREFIX_PATH='$work/prefix' -DCMAKE_BUILD_TYPE=Release &&
  cmake --build '$work/find' -j$(nproc) && '$work/find/usage'"
check "pkg-config mha" bash -c "
  export PKG_CONFIG_PATH='$work/prefix/lib/pkgconfig:$work/prefix/lib/x86_64-linux-gnu/pkgconfig'
  test \"\$(pkg-config --modversion mha)\" = \"\$(sed -n 's/^project(mha VERSION \([0-9.]*\).*/\1/p' '$root/CMakeLists.txt')\" &&
  g++ -std=c++17 -O1 '$root/examples/usage.cc' -o '$work/usage-pc' \$(pkg-config --cflags --libs mha) &&
  '$work/usage-pc'"
check "add_subdirectory(mha)" bash -c "
  cmake -S '$root/tests/install' -B '$work/sub' -DMHA_SOURCE_DIR='$root' -DCMAKE_BUILD_TYPE=Release &&
  cmake --build '$work/sub' -j$(nproc) && '$work/sub/usage'"
echo "install: $passed passed, $failed failed"
[ "$failed" = 0 ]
