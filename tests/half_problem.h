// The 16-bit attention tests' problems and their check, shared by half_attention_test.cc (every
// SIMD target, bfloat16 and float16) and half_amx_test.cc (the bfloat16 forward's AMX tiles): a
// random problem held in a 16-bit type and, widened exactly, in float32; the fast, reference and
// plain float32 paths run on it; and check(), docs/numerics.md's bound ("16-bit types"),
// norm-wise relative errors:
//   err(fast16) <= max(2 · err(plain16), 2 · err(plain32) + 4u + u16)
// plain32: the reference templated on float (float32 arithmetic); plain16: plain32 rounded to
// the 16-bit type — what PyTorch's CPU kernels compute for half types (float32 accumulation,
// one rounding of the output). u = 2^-24, u16 = 2^-8 (bfloat16) or 2^-11 (float16): one
// rounding of the output. And exactly: the fast 16-bit path gives the bits of the float32
// fast path on the widened inputs, rounded once.
#ifndef MHA_TESTS_HALF_PROBLEM_H_
#define MHA_TESTS_HALF_PROBLEM_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "mha/attention.h"
#include "mha/tensor.h"
#include "test_util.h"

namespace mha::test {

inline constexpr double kU = 1.0 / (1 << 24);

// 2^-p for p significant bits (bfloat16: 8, float16: 11): the largest relative rounding error.
inline double unit_roundoff(DType t) { return t == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048; }

template <typename T>
View<const T> view4(const Tensor& t, int64_t B, int64_t H, int64_t T_, int64_t D, bool bthd) {
  const T* p = t.data<T>();
  if (!bthd) return View<const T>(p, {B, H, T_, D});
  return View<const T>(p, {B, H, T_, D}, {T_ * H * D, D, H * D, 1});
}

struct Problem {
  int64_t B = 1, Hq = 2, Hkv = 2, Tq = 1, Tk = 1, D = 8, Dv = 8;
  bool bthd = false;       // (B, T, H, D) memory seen through strides
  int weights_rank = 0;    // 0: none, 4: per head, 3: averaged
  DType dtype = DType::kBF16;
  Tensor q16, k16, v16;    // the 16-bit inputs
  Tensor q32, k32, v32;    // the same values in float32 (exact)
  Tensor keep, bias, lengths;
  AttentionOptions opt;

  void make(Rng& rng) {
    auto gen = [&](int64_t H, int64_t T, int64_t Dd, Tensor* t16, Tensor* t32) {
      const Tensor r = bthd ? random_tensor(rng, {B, T, H, Dd}) : random_tensor(rng, {B, H, T, Dd});
      *t16 = r.converted(dtype);
      *t32 = t16->to_f32();
    };
    gen(Hq, Tq, D, &q16, &q32);
    gen(Hkv, Tk, D, &k16, &k32);
    gen(Hkv, Tk, Dv, &v16, &v32);
  }
  AttentionInputs inputs32() const {
    AttentionInputs in;
    in.query = view4<float>(q32, B, Hq, Tq, D, bthd);
    in.key = view4<float>(k32, B, Hkv, Tk, D, bthd);
    in.value = view4<float>(v32, B, Hkv, Tk, Dv, bthd);
    masks(in);
    return in;
  }
  template <typename T>
  BasicAttentionInputs<T> inputs16() const {
    BasicAttentionInputs<T> in;
    in.query = view4<T>(q16, B, Hq, Tq, D, bthd);
    in.key = view4<T>(k16, B, Hkv, Tk, D, bthd);
    in.value = view4<T>(v16, B, Hkv, Tk, Dv, bthd);
    masks(in);
    return in;
  }
  template <typename In>
  void masks(In& in) const {
    if (keep.defined()) in.keep_mask = keep.view<uint8_t>();
    if (bias.defined()) in.attn_bias = bias.view<float>();
    if (lengths.defined()) in.key_lengths = lengths.view<int64_t>();
  }
  std::vector<int64_t> weights_shape() const {
    return weights_rank == 4 ? std::vector<int64_t>{B, Hq, Tq, Tk} : std::vector<int64_t>{B, Tq, Tk};
  }
  std::string describe() const {
    char buf[220];
    std::snprintf(buf, sizeof buf,
                  "%s B=%ld Hq=%ld Hkv=%ld Tq=%ld Tk=%ld D=%ld Dv=%ld causal=%d window=%ld drop=%g weights=%d",
                  dtype_name(dtype), (long)B, (long)Hq, (long)Hkv, (long)Tq, (long)Tk, (long)D, (long)Dv,
                  (int)opt.causal, (long)opt.window, opt.dropout_p, weights_rank);
    return buf + std::string(keep.defined() ? " keep" : "") + (bias.defined() ? " bias" : "") +
           (lengths.defined() ? " lengths" : "") + (bthd ? " bthd" : "");
  }
};

// Float32 results (out, lse, weights) of one implementation.
struct Result {
  Tensor out, lse, weights;
};

// Results shaped for the problem, in out_dtype (the LSE in float32).
Result alloc(const Problem& p, DType out_dtype);

// The fast (or reference) path on the 16-bit inputs; results widened to float32.
template <typename T>
Result run16(const Problem& p, Backend backend, int threads = 0) {
  Result r = alloc(p, DTypeOf<T>::value);
  BasicAttentionOutputs<T> o{r.out.view<T>(), r.lse.view<float>(),
                             p.weights_rank ? r.weights.view<T>() : View<T>()};
  AttentionOptions opt = p.opt;
  opt.backend = backend;
  opt.num_threads = threads;
  attention(p.inputs16<T>(), o, opt);
  r.out = r.out.to_f32();
  if (p.weights_rank) r.weights = r.weights.to_f32();
  return r;
}

// The fast (or reference) path in the problem's 16-bit type.
Result run_dtype(const Problem& p, Backend backend, int threads = 0);
// The fast path with the decode kernel's dot products off (bfloat16 keys widened, as float32),
// which also turns the forward's AMX tiles off.
Result run_dots_off(const Problem& p);
// On the widened inputs: the float64 reference (Acc = double) or plain float32 (Acc = float).
template <typename Acc>
Result run32(const Problem& p);

// The fast path against the float64 reference within the bound above (with the AMX tiles' P
// rounding where they run), and its exact bits against the float32 fast path.
void check(const Problem& p);

}  // namespace mha::test

#endif  // MHA_TESTS_HALF_PROBLEM_H_
