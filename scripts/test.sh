#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test — the one command CI runs (.ci/run):
#   1. the GoogleTest suite and the README example (Release)
#   2. the same suite under AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer)
#   3. the same suite under ThreadSanitizer (clang, LLVM OpenMP with the Archer tool)
#   4. each libFuzzer target for a short, bounded time on its committed corpus
# MHA_TEST_QUICK=1 runs stage 1 only. MHA_FUZZ_SECONDS sets stage 4's time per target (20).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=${MHA_TEST_QUICK:-0}
jobs=$(nproc)
if [ "$quick" = 1 ]; then scripts/deps.sh; else scripts/deps.sh clang libomp-dev libclang-rt-dev; fi

passed=0
failed=0
# Runs ctest in build dir $1 (extra environment in the rest), adding to the totals.
run_ctest() {
  local dir=$1
  shift
  local log
  log=$(mktemp)
  local status=0
  env "$@" ctest --test-dir "$dir" --output-on-failure -j"$jobs" 2>&1 | tee "$log" || status=1
  local total fails
  total=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' "$log" | tail -1)
  fails=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\1/p' "$log" | tail -1)
  rm -f "$log"
  passed=$((passed + ${total:-0} - ${fails:-0}))
  failed=$((failed + ${fails:-1}))
  return $status
}

echo "== 1/4: tests (Release)"
scripts/build.sh
run_ctest build || true

if [ "$quick" != 1 ]; then
  echo "== 2/4: tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=address,undefined >/dev/null
  cmake --build build-asan -j"$jobs" >/dev/null
  run_ctest build-asan ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 || true

  echo "== 3/4: tests under ThreadSanitizer"
  archer=$(ls /usr/lib/llvm-*/lib/libarcher.so | sort -V | tail -1)
  cmake -S . -B build-tsan -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=thread >/dev/null
  cmake --build build-tsan -j"$jobs" >/dev/null
  run_ctest build-tsan OMP_TOOL_LIBRARIES="$archer" \
    TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp allocator_may_return_null=1 halt_on_error=1" || true

  echo "== 4/4: fuzzers, ${MHA_FUZZ_SECONDS:-20} s each on the committed corpora"
  cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_BUILD_FUZZERS=ON \
    -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_TOOLS=OFF >/dev/null
  cmake --build build-fuzz -j"$jobs" >/dev/null
  for target in safetensors weights attention; do
    work=$(mktemp -d)  # new inputs go here, the committed corpus stays read-only
    if build-fuzz/${target}_fuzz -max_total_time="${MHA_FUZZ_SECONDS:-20}" -print_final_stats=1 \
         -artifact_prefix="$work/" "$work" "fuzz/corpus/$target" >"$work/log" 2>&1; then
      echo "fuzz $target: $(grep -o 'number_of_executed_units: [0-9]*' "$work/log" | cut -d' ' -f2) runs, no failure"
      passed=$((passed + 1))
    else
      tail -40 "$work/log"
      echo "fuzz $target: FAILED (reproducer in $work)"
      failed=$((failed + 1))
    fi
  done
fi

echo "mha: $passed passed, $failed failed"
[ "$failed" = 0 ]
