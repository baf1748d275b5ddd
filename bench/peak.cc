// The machine's fp32 FMA peak, measured: independent FMA chains on every thread, with the
// widest vectors this CPU has (AVX-512, else AVX2+FMA, else scalar).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bench/suite.h"
#include "kernels/cpu/amx_config.h"
#include "kernels/cpu/flash.h"

namespace mha::bench {
namespace {

// Independent chains per loop: more than latency × throughput (4 × 2 FMAs per cycle), so the
// loop is bound by throughput, and few enough that they and the two constants stay in the
// registers: 16 of AVX-512's 32, 12 of AVX2's 16. (16 chains on AVX2 spilled three of them to
// the stack, whose store-to-load round trips in their chains took the measured peak to 116
// GFLOP/s on a Zen 3 that does ~200: docs/benchmarks.md.)
constexpr int kChains = 16;
constexpr int kChainsAvx2 = 12;

#if defined(__x86_64__)
// The loops keep their chains in a local array that must live in registers. AddressSanitizer puts
// such arrays in instrumented stack memory and UBSan checks each index, which made `bench --peak`
// take minutes in CI's sanitizer build (its CLI test ran 280 s there against 12 s in Release).
// They touch nothing but that array and their constants, so both are left out.
#define MHA_PEAK_LOOP(isa) __attribute__((target(isa), no_sanitize("address", "undefined")))
MHA_PEAK_LOOP("avx512f") float fma_loop_avx512(long iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.99999f), b = _mm512_set1_ps(1e-6f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
MHA_PEAK_LOOP("avx2,fma") float fma_loop_avx2(long iters) {
  __m256 acc[kChainsAvx2];
  for (int i = 0; i < kChainsAvx2; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.99999f), b = _mm256_set1_ps(1e-6f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChainsAvx2; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < kChainsAvx2; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}
// vdpbf16ps: each of the 16 fp32 lanes accumulates a dot product of 2 bf16 pairs, 4 flops.
MHA_PEAK_LOOP("avx512f,avx512bf16") float bf16_loop_avx512(long iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);  // 1, ~6e-8
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
// TDPBF16PS: one tile product adds 16 × 16 dot products of 32 bfloat16 pairs, 16·16·32·2 flops.
// Four independent result tiles (0-3) against two left (4, 5) and two right (6, 7) operands,
// the way the forward's AmxBlocks runs them. The tile configuration is per thread.
MHA_PEAK_LOOP("amx-tile,amx-bf16") float amx_loop(long iters) {
  kernels::AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&config) : "memory");  // as in flash_amx-inl.h: ldtilecfg reads it
  _tile_loadconfig(&config);
  alignas(64) static const uint16_t kOperand[16 * 32] = {};
  _tile_loadd(4, kOperand, 64);
  _tile_loadd(5, kOperand, 64);
  _tile_loadd(6, kOperand, 64);
  _tile_loadd(7, kOperand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#undef MHA_PEAK_LOOP
#endif

// The best of several ~0.1 s runs of `loop` on every thread: on a shared VM a run can lose a
// core to the hypervisor, which would understate the peak (and overstate every % of it).
double best_rate(float (*loop)(long), double flops_per_iter, int threads, long iters = 50'000'000) {
  double best = 0;
  for (int rep = 0; rep < 7; ++rep) {
    float sink = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += loop(iters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, flops_per_iter * iters * threads / s / 1e9);
    if (sink == 12345.0f) best += 0;  // keep the result alive
  }
  return best;
}

}  // namespace

double measure_bf16_peak_gflops(int threads) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512bf16")) return best_rate(bf16_loop_avx512, 4.0 * 16 * kChains, threads);
#endif
  return 0.0;
}

double measure_amx_bf16_peak_gflops(int threads) {
#if defined(__x86_64__)
  // forward_amx_bf16() asks Linux for the tile state (once per process) where the CPU has AMX.
  if (kernels::forward_amx_bf16()) return best_rate(amx_loop, 4.0 * 16 * 16 * 32 * 2, threads, 1'000'000);
#endif
  return 0.0;
}

double measure_peak_gflops(int threads) {
  int lanes = 1, chains = 0;
  float (*loop)(long) = nullptr;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) {
    loop = fma_loop_avx512, lanes = 16, chains = kChains;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    loop = fma_loop_avx2, lanes = 8, chains = kChainsAvx2;
  }
#endif
  if (!loop) return 0.0;
  return best_rate(loop, 2.0 * lanes * chains, threads);
}

namespace {

#if defined(__x86_64__)
// Sums n floats with AVX-512 (4 independent accumulators), so the loop is bound by memory.
__attribute__((target("avx512f"))) float read_avx512(const float* a, size_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(a + i));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(a + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(a + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(a + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
#endif

float read_portable(const float* a, size_t n) {
  float acc[16] = {};
  for (size_t i = 0; i + 16 <= n; i += 16)
    for (size_t k = 0; k < 16; ++k) acc[k] += a[i + k];  // 16 independent sums: vectorisable
  float s = 0;
  for (float x : acc) s += x;
  return s;
}

}  // namespace

namespace {

// Seconds of one read sweep of `threads` threads over a[0, n), each thread summing its share.
double read_sweep(const float* a, size_t n, int threads) {
  float (*read)(const float*, size_t) = read_portable;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) read = read_avx512;
#endif
  float sum = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sum)
  {
    const size_t parts = static_cast<size_t>(omp_get_num_threads()), me = static_cast<size_t>(omp_get_thread_num());
    const size_t chunk = (n / parts) / 64 * 64;
    sum += read(a + me * chunk, me + 1 == parts ? n - me * chunk : chunk);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sum;  // the sums must be computed
  (void)keep;
  return s;
}

constexpr size_t kSweepFloats = (size_t{256} << 20) / sizeof(float);

// n floats of value x, on transparent huge pages (Tensor allocates 2 MiB or more that way).
Tensor filled(size_t n, float x) {
  Tensor t(DType::kF32, {static_cast<int64_t>(n)});
  std::fill_n(t.data<float>(), n, x);
  return t;
}

}  // namespace

Bandwidth measure_bandwidth(int threads) {
  const size_t n = kSweepFloats;
  Tensor ta = filled(n, 1.0f), tb = filled(n, 2.0f), tc = filled(n, 3.0f);
  float* a = ta.data<float>();
  const float* b = tb.data<float>();
  const float* c = tc.data<float>();
  Bandwidth best{0, 0};
  for (int rep = 0; rep < 5; ++rep) {
    best.read = std::max(best.read, n * sizeof(float) / read_sweep(a, n, threads) / 1e9);
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best.triad = std::max(best.triad, 3.0 * n * sizeof(float) / s / 1e9);
  }
  return best;
}

ReadProbe::ReadProbe(int threads) : threads_(threads), a_(filled(kSweepFloats, 1.0f)) {}

double ReadProbe::gbps() const {
  return static_cast<double>(kSweepFloats * sizeof(float)) / read_sweep(a_.data<float>(), kSweepFloats, threads_) / 1e9;
}

}  // namespace mha::bench
