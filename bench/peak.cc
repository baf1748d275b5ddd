// The machine's fp32 FMA peak, measured: independent FMA chains on every thread, with the
// widest vectors this CPU has (AVX-512, else AVX2+FMA, else scalar).
#include <omp.h>

#include <algorithm>
#include <chrono>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bench/suite.h"

namespace mha::bench {
namespace {

constexpr int kChains = 16;  // > latency × throughput, so the loop is throughput-bound

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float fma_loop_avx512(long iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.99999f), b = _mm512_set1_ps(1e-6f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx2,fma"))) float fma_loop_avx2(long iters) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.99999f), b = _mm256_set1_ps(1e-6f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}
#endif

}  // namespace

double measure_peak_gflops(int threads) {
  int lanes = 1;
  float (*loop)(long) = nullptr;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) {
    loop = fma_loop_avx512, lanes = 16;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    loop = fma_loop_avx2, lanes = 8;
  }
#endif
  if (!loop) return 0.0;
  // The best of several ~0.1 s runs: on a shared VM a run can lose a core to the hypervisor,
  // which would understate the peak (and overstate every % of it).
  const long iters = 50'000'000;
  double best = 0;
  for (int rep = 0; rep < 7; ++rep) {
    float sink = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += loop(iters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 2.0 * lanes * kChains * iters * threads / s / 1e9);
    if (sink == 12345.0f) best += 0;  // keep the result alive
  }
  return best;
}

}  // namespace mha::bench
