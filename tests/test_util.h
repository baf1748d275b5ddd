// Helpers shared by the tests: seeded random tensors, an independent naive attention, error
// measures. Every randomized test prints its seed; MHA_TEST_SEED=<n> reruns with another.
#ifndef MHA_TESTS_TEST_UTIL_H_
#define MHA_TESTS_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/tensor.h"

namespace mha::test {

// The base seed of randomized tests: MHA_TEST_SEED if set, else a fixed value.
uint64_t base_seed();

// Puts back the kernels' run-time switches that a test changed (kernels/cpu/flash.h): the SIMD
// target, the decode kernel's dot products, VNNI, byte values, bfloat16 values, AMX (decode,
// forward, backward).
// RestoreKernelSwitches does it when it goes out of scope, also when an assertion ends the test
// early, so that no later test runs on a switch left off.
void restore_kernel_switches();
struct RestoreKernelSwitches {
  RestoreKernelSwitches() = default;
  RestoreKernelSwitches(const RestoreKernelSwitches&) = delete;
  RestoreKernelSwitches& operator=(const RestoreKernelSwitches&) = delete;
  ~RestoreKernelSwitches() { restore_kernel_switches(); }
};

// What the decode kernel rounds, beyond float32, on an int8 or int4 cache, on `target` (default:
// the best compiled in and supported here) as the kernel switches now stand (dot products, VNNI,
// byte values), each as a bound of its effect on the output relative to its terms' scale
// (docs/numerics.md); 0 where nothing is rounded.
struct DecodeRounding {
  // The query of the integer key products, rounded to 8 bits for int4 keys, to 16 bits for int8
  // keys. Its effect grows with the keys' size: 2^-4 and 2^-12 hold for unit-normal keys without
  // an outlier channel at D ≤ 64 (the fixed problems of the tests that use them);
  // kv_cache_quant_test.cc's QuantDecode derives its own from each trial's keys.
  double query = 0;
  // The value pass: int4 values or their weights rounded to bfloat16 (AVX3, AVX-512 BF16) or the
  // weights to bytes (AVX2; AVX3 with VNNI and VBMI), 2^-6; int8 values' weights rounded to 16-bit
  // words (AVX2; AVX3 with VNNI), 2^-9.
  double values = 0;
  double either() const { return std::max(query, values); }
};
DecodeRounding decode_rounding(CacheType type);
DecodeRounding decode_rounding(CacheType type, const std::string& target);

// A small deterministic generator (splitmix64) for test data.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double uniform();                  // [0, 1)
  float normal();                    // N(0, 1)
  int64_t range(int64_t lo, int64_t hi);  // [lo, hi]
  bool coin(double p = 0.5) { return uniform() < p; }

 private:
  uint64_t state_;
};

Tensor random_tensor(Rng& rng, std::vector<int64_t> shape, float scale = 1.0f);
Tensor random_mask(Rng& rng, std::vector<int64_t> shape, double keep_probability);
// A shape that broadcasts to `full` (such as (B, Hq, Tq, Tk)): its last 1 to 4 dims, each set to 1
// with probability 0.4.
std::vector<int64_t> broadcast_shape(Rng& rng, const std::vector<int64_t>& full);
// Key lengths (B,) int64, each uniform in [0, Tk].
Tensor random_lengths(Rng& rng, int64_t B, int64_t Tk);

// max |a - b| / max(max |b|, tiny): the norm-wise relative error used throughout (numerics.md).
double rel_error(const View<const float>& got, const View<const float>& want);
double max_abs(const View<const float>& v);
// Float32 tensors: max |got - ref| over the finite entries of ref, infinite unless got has the
// same NaN and infinities where ref does; and max |t| over t's finite entries.
double abs_error(const Tensor& got, const Tensor& ref);
double finite_max_abs(const Tensor& t);

// Same memory layout, NaN-aware: true if both are NaN at the same places and equal elsewhere.
bool bitwise_equal(const Tensor& a, const Tensor& b);
// Runs f and checks that it throws mha::Error mentioning every one of `words`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& words);

// The score variants of issue 14 (mha/attention.h), each with probability `chance`: a softcap
// of the order of O(1) scores (so tanh bends them), ALiBi slopes in [0, 0.5) per head or per
// (batch, head), sinks uniform in ±sink_range. The tensors the inputs view go to *alibi, *sinks.
void add_score_variants(Rng& rng, double chance, int64_t B, int64_t Hq, float sink_range, AttentionInputs& in,
                        AttentionOptions& opt, Tensor* alibi, Tensor* sinks);

// The absolute floor (in units of the values, not of u) that an LSE may differ by beyond twice
// plain float32's error (docs/numerics.md): lse = m + log(l), and the largest score m carries
// the rounding of its dot product, about √D·u·scale·Σ_c|q_c·k_c| in practice (independent
// roundings; allowed twice that, with the largest such sum over rows and keys), plus u·|bias|,
// u·|ALiBi term| and the softcap's tanh (≤ 4u·softcap); the probabilities' ~8u (exp2) become 8u
// absolute through the log, and m + log(l) rounds by u·|lse|, allowed 2u·max|lse|. Plain float32
// rounds its scores in another order and can be lucky. Costs B·Hq·Tq·Tk·D: call it where the
// cheap 4u·max|lse| does not hold.
double lse_floor(const AttentionInputs& in, const AttentionOptions& opt, double lse_max);

// An independent naive attention in double: dense masks built element by element, K/V
// repeated per query head, softmax through an explicit log-sum-exp. Outputs are contiguous
// (B, Hq, Tq, Dv), (B, Hq, Tq) and (B, Hq, Tq, Tk) per-head weights before dropout.
struct NaiveResult {
  std::vector<double> out, lse, weights;
};
NaiveResult naive_attention(const AttentionInputs& in, const AttentionOptions& options);

}  // namespace mha::test

#endif  // MHA_TESTS_TEST_UTIL_H_
