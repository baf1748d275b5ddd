#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test — the one command CI runs (.ci/run):
#   1. the GoogleTest suite and the README examples (Release)
#   2. the Python package: `pip install .` into the cached virtual environment of
#      scripts/py-env.sh (PyPI's torch 2.x), then the pytest/hypothesis differential tests
#      against torch 2.x
#   3. the C++ suite under AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer)
#   4. the C++ suite under ThreadSanitizer (clang, LLVM OpenMP with the Archer tool)
#   5. each libFuzzer target for a short, bounded time on its committed corpus
#   6. the installed package used by a separate C++ project (scripts/test-install.sh)
#   7. with MHA_TEST_FRESH_DEMO=1 (set by .ci/run): the demo command in a clean Debian 12 root
#      (scripts/fresh-machine.sh)
# Stages 3–5 build the kernels for two targets only, the portable one and the best this CPU
# runs (AVX3 where it has AVX-512, else AVX2; stage 1 tests all of them): the sanitizers look for
# memory and thread errors, and the code of the target that runs here is where this CPU's users
# would meet them (on an AVX2-only CPU, skipping AVX2 left only the portable target). Stages
# 3–4 leave out Cli.DemoRuns and Cli.TrainReachesTheTargetAccuracy: both run the training loop
# that TrainExample.LearnsToReverseSequences runs under the sanitizers too (stage 1 runs all).
# Compilation goes through ccache (installed here), so a rerun recompiles only what changed.
# MHA_TEST_QUICK=1 runs stage 1 only. MHA_FUZZ_SECONDS sets stage 5's time per target (20).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=${MHA_TEST_QUICK:-0}
jobs=$(nproc)
if [ "$quick" = 1 ]; then
  scripts/deps.sh
else
  scripts/deps.sh clang libomp-dev libclang-rt-dev ccache
  # CMake reads these from the environment; BASEDIR and NOHASHDIR let clones at other paths hit.
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
fi
if grep -qw avx512f /proc/cpuinfo; then
  skip_target=-DMHA_SKIP_SIMD_TARGETS=HWY_AVX2
else
  skip_target=-DMHA_SKIP_SIMD_TARGETS=HWY_AVX3
fi
sanitizer_skip='^Cli\.(DemoRuns|TrainReachesTheTargetAccuracy)$'

passed=0
failed=0
# Runs ctest in build dir $1, leaving out the tests matching regex $2 (none if empty), with
# extra environment in the rest, adding to the totals.
run_ctest() {
  local dir=$1 exclude=$2
  shift 2
  local log
  log=$(mktemp)
  local status=0
  env "$@" ctest --test-dir "$dir" --output-on-failure -j"$jobs" ${exclude:+-E "$exclude"} 2>&1 | tee "$log" ||
    status=1
  local total fails
  total=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' "$log" | tail -1)
  fails=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\1/p' "$log" | tail -1)
  rm -f "$log"
  passed=$((passed + ${total:-0} - ${fails:-0}))
  failed=$((failed + ${fails:-1}))
  return $status
}

# Installs the package into the cached torch 2.x environment and runs tests/python, adding to
# the totals.
run_python() {
  local venv
  if ! venv=$(scripts/py-env.sh); then
    echo "python: the torch 2.x environment (scripts/py-env.sh) could not be created: FAILED"
    failed=$((failed + 1))
    return 1
  fi
  if ! "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall .; then
    echo "python: pip install . FAILED"
    failed=$((failed + 1))
    return 1
  fi
  local log status=0
  log=$(mktemp)
  (cd build && "$venv/bin/python" -m pytest -q -p no:cacheprovider ../tests/python) 2>&1 | tee "$log" || status=1
  local ok bad
  # The counts from pytest's summary line only ("1 failed, 247 passed, 2 warnings in 39.35s"):
  # a failure's message may hold words such as "float32 error".
  local summary
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped)[ ,].* in [0-9.]+s' "$log" | tail -1 || true)
  ok=$(grep -Eo '[0-9]+ passed' <<<"$summary" | cut -d' ' -f1 || true)
  bad=$(grep -Eo '[0-9]+ (failed|errors?)' <<<"$summary" | awk '{s += $1} END {print s + 0}' || true)
  rm -f "$log"
  passed=$((passed + ${ok:-0}))
  if [ "$status" != 0 ] && [ "${bad:-0}" = 0 ]; then bad=1; fi
  failed=$((failed + ${bad:-0}))
  return $status
}

echo "== 1/7: tests (Release)"
scripts/build.sh
run_ctest build "" || true

if [ "$quick" != 1 ]; then
  echo "== 2/7: Python package and its differential tests against torch"
  run_python || true

  echo "== 3/7: tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=address,undefined "$skip_target" >/dev/null
  cmake --build build-asan -j"$jobs" >/dev/null
  run_ctest build-asan "$sanitizer_skip" ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 || true

  echo "== 4/7: tests under ThreadSanitizer"
  archer=$(ls /usr/lib/llvm-*/lib/libarcher.so | sort -V | tail -1)
  cmake -S . -B build-tsan -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=thread "$skip_target" >/dev/null
  cmake --build build-tsan -j"$jobs" >/dev/null
  run_ctest build-tsan "$sanitizer_skip" OMP_TOOL_LIBRARIES="$archer" \
    TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp allocator_may_return_null=1 halt_on_error=1" || true

  echo "== 5/7: fuzzers, ${MHA_FUZZ_SECONDS:-20} s each on the committed corpora"
  cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_BUILD_FUZZERS=ON \
    -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_TOOLS=OFF "$skip_target" >/dev/null
  cmake --build build-fuzz -j"$jobs" >/dev/null
  for target in safetensors weights attention cache; do
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

if [ "$quick" != 1 ]; then
  echo "== 6/7: install, then build the README's C++ example against the installed package"
  if scripts/test-install.sh build; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
fi

if [ "${MHA_TEST_FRESH_DEMO:-0}" = 1 ]; then
  echo "== 7/7: the demo command from a fresh clone in a clean Debian 12 root"
  if scripts/fresh-machine.sh ./scripts/demo.sh; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
fi

echo "mha: $passed passed, $failed failed"
[ "$failed" = 0 ]
