// bfloat16 and float16 attention (forward, weights, decode, backward) on every SIMD target,
// against the float64 reference run on the same 16-bit-rounded inputs widened to float32
// (exact). Bound (docs/numerics.md, "16-bit types"), norm-wise relative errors:
//   err(fast16) <= max(2 · err(plain16), 2 · err(plain32) + 4u + u16)
// plain32: the reference templated on float (float32 arithmetic); plain16: plain32 rounded to
// the 16-bit type — what PyTorch's CPU kernels compute for half types (float32 accumulation,
// one rounding of the output). u = 2^-24, u16 = 2^-8 (bfloat16) or 2^-11 (float16): one
// rounding of the output. And exactly: the fast 16-bit path gives the bits of the float32
// fast path on the widened inputs, rounded once.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "mha/attention.h"
#include "ops/attention_checks.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr double kU = 1.0 / (1 << 24);

// (SIMD target, dtype).
using Param = std::tuple<std::string, DType>;

class HalfTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { kernels::force_simd_target(std::get<0>(GetParam())); }
  void TearDown() override { kernels::force_simd_target(""); }
  DType dtype() const { return std::get<1>(GetParam()); }
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param) + "_" + dtype_name(std::get<1>(info.param));
}

// 2^-p for p significant bits (bfloat16: 8, float16: 11): the largest relative rounding error.
double unit_roundoff(DType t) { return t == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048; }

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

Result alloc(const Problem& p, DType out_dtype) {
  Result r;
  r.out = Tensor(out_dtype, {p.B, p.Hq, p.Tq, p.Dv});
  r.lse = Tensor(DType::kF32, {p.B, p.Hq, p.Tq});
  if (p.weights_rank) r.weights = Tensor(out_dtype, p.weights_shape());
  return r;
}

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

Result run_dtype(const Problem& p, Backend backend, int threads = 0) {
  return p.dtype == DType::kBF16 ? run16<bfloat16>(p, backend, threads) : run16<float16>(p, backend, threads);
}

// The fast path with the decode kernel's dot products off (bfloat16 keys widened, as float32).
Result run_dots_off(const Problem& p) {
  // The dot products back on however run_dtype returns; the fixture's SIMD target stays (not
  // RestoreKernelSwitches, which would reset it).
  struct DotsBackOn {
    ~DotsBackOn() { kernels::allow_decode_dot_products(true); }
  } const back_on;
  kernels::allow_decode_dot_products(false);
  return run_dtype(p, Backend::kFast);
}

// On the widened inputs: the float64 reference (Acc = double) or plain float32 (Acc = float).
template <typename Acc>
Result run32(const Problem& p) {
  Result r = alloc(p, DType::kF32);
  const AttentionOutputs o{r.out.view<float>(), r.lse.view<float>(),
                           p.weights_rank ? r.weights.view<float>() : View<float>()};
  const kernels::AttentionParams kp = ops::make_attention_params(p.inputs32(), o, p.opt);
  for (int64_t b = 0; b < kp.batch; ++b)
    for (int64_t i = 0; i < kp.q_len; ++i) kernels::attention_ref_row<Acc>(kp, b, i);
  return r;
}

double abs_error(const Tensor& got, const Tensor& ref) {
  double e = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const float g = got.data<float>()[i], r = ref.data<float>()[i];
    if (!std::isfinite(r)) {
      if (!(std::isnan(r) ? std::isnan(g) : g == r)) return std::numeric_limits<double>::infinity();
      continue;
    }
    const double d = std::fabs(static_cast<double>(g) - r);
    e = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(e, d);
  }
  return e;
}

double finite_max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i)
    if (std::isfinite(t.data<float>()[i])) m = std::max(m, std::fabs(static_cast<double>(t.data<float>()[i])));
  return m;
}

void check(const Problem& p) {
  SCOPED_TRACE(p.describe());
  const double u16 = unit_roundoff(p.dtype);
  const Result fast = run_dtype(p, Backend::kFast), ref = run32<double>(p), plain32 = run32<float>(p);
  const Result ref16 = run_dtype(p, Backend::kReference);
  auto rounded = [&](const Tensor& t) { return t.converted(p.dtype).to_f32(); };
  // floor: the fast path's own error beyond 2x plain, relative to max|r|: 4u, or for the LSE
  // (float32 for every dtype) what its terms allow where that is more. lse = m + log(l): the
  // largest score m carries the rounding of its dot product, about √D·u·Σ|q·k|·scale in
  // practice (independent roundings; allowed twice that) plus u·|bias|; the sum l of the
  // probabilities carries their ~8u (exp2), which the log makes 8u absolute; the sum m + log(l)
  // rounds by |lse|·u. Plain float32 rounds its scores too, in another order, and can be lucky:
  // a seed measured fast at 8.6u of max|lse| = 18.6 (D = 55, a bias) against plain's 1.7u.
  auto expect_bound = [&](const Tensor& f, const Tensor& r, const Tensor& pl32, double u_out, double floor,
                          const char* what) {
    const double scale = std::max(finite_max_abs(r), 1e-30);
    const double ef = abs_error(f, r) / scale, e32 = abs_error(pl32, r) / scale;
    const double e16 = u_out > 0 ? abs_error(rounded(pl32), r) / scale : e32;
    EXPECT_LE(ef, std::max(2 * e16, 2 * e32 + floor + u_out))
        << what << ": fast " << ef << " vs plain16 " << e16 << ", plain32 " << e32 << ", max|ref| " << scale;
  };
  const double lse_max = std::max(finite_max_abs(ref.lse), 1e-30);
  const AttentionInputs in = p.inputs32();
  const double scale = p.opt.scale ? *p.opt.scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  double dots = 0;  // max over rows and keys of Σ_c |q_c·k_c|·scale
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t i = 0; i < p.Tq; ++i)
        for (int64_t j = 0; j < p.Tk; ++j) {
          double sum = 0;
          for (int64_t c = 0; c < p.D; ++c)
            sum += std::fabs(double{in.query.at(b, h, i, c)} * in.key.at(b, h / (p.Hq / p.Hkv), j, c));
          dots = std::max(dots, sum * scale);
        }
  const double bias_max = p.bias.defined() ? finite_max_abs(p.bias) : 0.0;
  const double lse_floor = (2 * std::sqrt(static_cast<double>(p.D)) * dots + bias_max + 8 + 2 * lse_max) * kU;
  // Where the forward's AMX tiles run (bfloat16, head dims they take), P is rounded to bfloat16
  // for P·V: a row's output moves by at most (u16/2)·max|v| more (docs/numerics.md).
  const bool tiles = p.dtype == DType::kBF16 && kernels::forward_amx_bf16() && p.D % 32 == 0 && p.Dv % 16 == 0;
  const double p_rounding = tiles ? u16 / 2 * finite_max_abs(p.v32) / std::max(finite_max_abs(ref.out), 1e-30) : 0.0;
  expect_bound(fast.out, ref.out, plain32.out, u16, 4 * kU + p_rounding, "out");
  expect_bound(fast.lse, ref.lse, plain32.lse, 0.0, std::max(4 * kU, lse_floor / lse_max), "lse");
  if (p.weights_rank) expect_bound(fast.weights, ref.weights, plain32.weights, u16, 4 * kU, "weights");
  // The fast 16-bit path widens its inputs exactly and runs the float32 tiles: its results are
  // the float32 fast path's on the widened inputs, rounded once (round to nearest even). Not so
  // the decode kernel's bfloat16 keys with bfloat16 dot products, nor the forward's AMX tiles
  // (other sums, the scale applied after them, P rounded; the bound above holds them): the bits
  // are checked with the dot products off, which turns both off.
  const Result widened = run_dots_off(p);
  Result fast32 = alloc(p, DType::kF32);
  AttentionOptions fo = p.opt;
  fo.backend = Backend::kFast;
  attention(p.inputs32(),
            {fast32.out.view<float>(), fast32.lse.view<float>(),
             p.weights_rank ? fast32.weights.view<float>() : View<float>()},
            fo);
  EXPECT_TRUE(bitwise_equal(widened.out, rounded(fast32.out))) << "out is not the rounded float32 result";
  EXPECT_TRUE(bitwise_equal(widened.lse, fast32.lse)) << "lse differs from the float32 path's";
  if (p.weights_rank) EXPECT_TRUE(bitwise_equal(widened.weights, rounded(fast32.weights)));
  if (!(p.dtype == DType::kBF16 && kernels::decode_bf16_dots())) {  // then the same path
    EXPECT_TRUE(bitwise_equal(fast.out, widened.out));
    EXPECT_TRUE(bitwise_equal(fast.lse, widened.lse));
  }
  // The 16-bit reference path is the float64 reference rounded once.
  EXPECT_LE(abs_error(ref16.out, ref.out), u16 * std::max(finite_max_abs(ref.out), 1e-30) + 1e-30);
}

TEST_P(HalfTest, SequenceLengthsAroundTileEdges) {
  Rng rng(base_seed() + 110);
  for (int64_t T : {1, 2, 47, 48, 49, 63, 64, 65, 113, 257}) {
    for (Causal c : {Causal::kNone, Causal::kTopLeft}) {
      Problem p;
      p.dtype = dtype();
      p.Tq = p.Tk = T;
      p.D = p.Dv = 64;
      p.opt.causal = c;
      p.make(rng);
      check(p);
    }
  }
}

TEST_P(HalfTest, HeadDimsAndStrides) {
  Rng rng(base_seed() + 111);
  for (int64_t D : {1, 7, 16, 17, 33, 80, 128}) {
    Problem p;
    p.dtype = dtype();
    p.Tq = 37;
    p.Tk = D == 33 ? 1100 : 70;  // >= 1024 strided keys are gathered first (src/ops/attention.cc)
    p.D = D;
    p.Dv = D == 1 ? 5 : D;
    p.bthd = D % 2 == 1;
    p.opt.causal = Causal::kBottomRight;
    p.make(rng);
    check(p);
  }
}

TEST_P(HalfTest, RandomProblems) {
  const uint64_t seed = base_seed() + 114;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with MHA_TEST_SEED)");
  Rng rng(seed);
  const int trials = std::get<0>(GetParam()) == "SCALAR" ? 10 : 40;
  for (int trial = 0; trial < trials; ++trial) {
    Problem p;
    p.dtype = dtype();
    p.B = rng.range(1, 2);
    p.Hkv = rng.range(1, 3);
    p.Hq = p.Hkv * rng.range(1, 4);
    p.Tq = rng.range(1, 130);
    p.Tk = rng.coin(0.3) ? p.Tq : rng.range(1, 130);
    p.D = rng.range(1, 72);
    p.Dv = rng.coin(0.5) ? p.D : rng.range(1, 72);
    p.bthd = rng.coin(0.5);
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.3)) p.keep = random_mask(rng, broadcast_shape(rng, full), rng.coin(0.5) ? 0.9 : 0.3);
    if (rng.coin(0.3)) p.bias = random_tensor(rng, broadcast_shape(rng, full));
    if (rng.coin(0.3)) p.lengths = random_lengths(rng, p.B, p.Tk);
    p.opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (p.opt.causal != Causal::kNone && rng.coin(0.3)) p.opt.window = rng.range(1, 80);
    if (rng.coin(0.2)) p.opt.dropout_p = 0.25f, p.opt.dropout_seed = rng.next();
    if (rng.coin(0.2)) p.opt.scale = static_cast<float>(rng.uniform());
    p.weights_rank = rng.coin(0.5) ? 0 : (rng.coin(0.5) ? 3 : 4);
    check(p);
  }
}

// Few query rows per kv head: the decode kernel, reading 16-bit K/V rows directly.
TEST_P(HalfTest, DecodeShapes) {
  Rng rng(base_seed() + 118);
  for (int64_t G : {1, 4, 8}) {
    for (int64_t Tk : {1, 17, 300, 3000}) {
      Problem p;
      p.dtype = dtype();
      p.B = 2;
      p.Hkv = 2;
      p.Hq = 2 * G;
      p.Tq = 1;
      p.Tk = Tk;
      p.D = Tk == 300 ? 33 : Tk == 17 ? 40 : 64;  // 33, 40: the stage by 4 vectors, then by 1
      p.Dv = Tk == 17 ? 20 : Tk == 3000 ? 48 : p.D;  // 48: a pass of 16 columns too
      p.bthd = Tk == 300;
      p.opt.causal = Causal::kBottomRight;
      p.make(rng);
      check(p);
    }
  }
  Problem p;  // key lengths and a window, keys split into chunks
  p.dtype = dtype();
  p.Hq = 4;
  p.Hkv = 1;
  p.Tk = 5000;
  p.D = p.Dv = 96;
  p.make(rng);
  p.lengths = Tensor(DType::kI64, {1});
  p.lengths.data<int64_t>()[0] = 4321;
  p.opt.causal = Causal::kBottomRight;
  p.opt.window = 700;
  check(p);
}

TEST_P(HalfTest, SameBitsForOneAndTwoThreads) {
  Rng rng(base_seed() + 119);
  for (int64_t Tq : {1, 200}) {
    Problem p;
    p.dtype = dtype();
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = Tq;
    p.Tk = 2000;
    p.D = p.Dv = 64;
    p.weights_rank = Tq == 1 ? 0 : 3;
    p.opt.causal = Causal::kBottomRight;
    p.opt.dropout_p = Tq == 1 ? 0.0f : 0.1f;
    p.make(rng);
    const Result one = run_dtype(p, Backend::kFast, 1), two = run_dtype(p, Backend::kFast, 2);
    EXPECT_TRUE(bitwise_equal(one.out, two.out)) << p.describe();
    EXPECT_TRUE(bitwise_equal(one.lse, two.lse)) << p.describe();
    if (p.weights_rank) EXPECT_TRUE(bitwise_equal(one.weights, two.weights)) << p.describe();
  }
}

// Overflow and special values: float16 outputs beyond 65504 are infinite, NaN stays NaN, and a
// fully masked row is zeros (never NaN) in every dtype.
TEST_P(HalfTest, SpecialValues) {
  Rng rng(base_seed() + 120);
  Problem p;
  p.dtype = dtype();
  p.Tq = 3;
  p.Tk = 5;
  p.D = p.Dv = 16;
  p.make(rng);
  auto set = [&](Tensor& t16, Tensor& t32, int64_t i, float x) {
    if (p.dtype == DType::kBF16) {
      t16.data<bfloat16>()[i] = to_bfloat16(x);
    } else {
      t16.data<float16>()[i] = to_float16(x);
    }
    t32 = t16.to_f32();
  };
  // Every value of key 0's V row is 1e5 (finite in bf16, infinite in fp16).
  for (int64_t c = 0; c < p.Dv; ++c) set(p.v16, p.v32, c, 1e5f);
  p.keep = Tensor(DType::kU8, {p.Tq, p.Tk});
  for (int64_t j = 0; j < p.Tk; ++j) p.keep.data<uint8_t>()[j] = 0;  // query 0 sees nothing
  for (int64_t i = p.Tk; i < p.keep.numel(); ++i) p.keep.data<uint8_t>()[i] = 1;
  const Result r = run_dtype(p, Backend::kFast);
  for (int64_t h = 0; h < p.Hq; ++h) {
    const float* row0 = r.out.data<float>() + h * p.Tq * p.Dv;
    for (int64_t c = 0; c < p.Dv; ++c) EXPECT_EQ(row0[c], 0.0f);
    EXPECT_EQ(r.lse.data<float>()[h * p.Tq], -std::numeric_limits<float>::infinity());
  }
  check(p);
}

// The 16-bit backward is the float32 backward on the widened arguments, rounded once: the
// same bits as doing that by hand — the fast kernel reading 16-bit arguments directly, and the
// reference backend on widened copies.
TEST_P(HalfTest, BackwardIsRoundedFloat32Backward) {
  Rng rng(base_seed() + 121);
  for (Causal c : {Causal::kNone, Causal::kBottomRight}) {
    Problem p;
    p.dtype = dtype();
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = 50;
    p.Tk = 70;
    p.D = 24;
    p.Dv = 20;
    p.bthd = c == Causal::kNone;
    p.opt.causal = c;
    p.opt.dropout_p = 0.2f;
    p.opt.dropout_seed = 7;
    p.make(rng);
    const Result fwd = run_dtype(p, Backend::kFast);
    const Tensor out16 = fwd.out.converted(p.dtype), go32 = random_tensor(rng, {p.B, p.Hq, p.Tq, p.Dv});
    const Tensor go16 = go32.converted(p.dtype);
    // By hand: float32 backward on the widened values.
    const Tensor out32 = out16.to_f32(), gow = go16.to_f32();
    Tensor gq(DType::kF32, {p.B, p.Hq, p.Tq, p.D}), gk(DType::kF32, {p.B, p.Hkv, p.Tk, p.D}),
        gv(DType::kF32, {p.B, p.Hkv, p.Tk, p.Dv});
    attention_backward(p.inputs32(), out32.view<float>(), fwd.lse.view<float>(), gow.view<float>(),
                       {gq.view<float>(), gk.view<float>(), gv.view<float>()}, p.opt);
    Tensor hq(p.dtype, gq.shape()), hk(p.dtype, gk.shape()), hv(p.dtype, gv.shape());
    if (p.dtype == DType::kBF16) {
      attention_backward(p.inputs16<bfloat16>(), out16.view<bfloat16>(), fwd.lse.view<float>(),
                         go16.view<bfloat16>(), {hq.view<bfloat16>(), hk.view<bfloat16>(), hv.view<bfloat16>()},
                         p.opt);
    } else {
      attention_backward(p.inputs16<float16>(), out16.view<float16>(), fwd.lse.view<float>(),
                         go16.view<float16>(), {hq.view<float16>(), hk.view<float16>(), hv.view<float16>()},
                         p.opt);
    }
    EXPECT_TRUE(bitwise_equal(hq, gq.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(hk, gk.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(hv, gv.converted(p.dtype))) << p.describe();
    // The reference backend: the float64-accumulating reference on the widened arguments, rounded.
    AttentionOptions ro = p.opt;
    ro.backend = Backend::kReference;
    attention_backward(p.inputs32(), out32.view<float>(), fwd.lse.view<float>(), gow.view<float>(),
                       {gq.view<float>(), gk.view<float>(), gv.view<float>()}, ro);
    Tensor rq(p.dtype, gq.shape()), rk(p.dtype, gk.shape()), rv(p.dtype, gv.shape());
    if (p.dtype == DType::kBF16) {
      attention_backward(p.inputs16<bfloat16>(), out16.view<bfloat16>(), fwd.lse.view<float>(),
                         go16.view<bfloat16>(), {rq.view<bfloat16>(), rk.view<bfloat16>(), rv.view<bfloat16>()}, ro);
    } else {
      attention_backward(p.inputs16<float16>(), out16.view<float16>(), fwd.lse.view<float>(), go16.view<float16>(),
                         {rq.view<float16>(), rk.view<float16>(), rv.view<float16>()}, ro);
    }
    EXPECT_TRUE(bitwise_equal(rq, gq.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(rk, gk.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(rv, gv.converted(p.dtype))) << p.describe();
    // And the gradients are not trivially zero.
    EXPECT_GT(max_abs(hq.to_f32().view<float>()), 0.0);
    EXPECT_GT(max_abs(hv.to_f32().view<float>()), 0.0);
  }
}

// The decode kernel's bfloat16 keys scored with vdpbf16ps (AVX-512 BF16) against its float path
// on the same inputs (dot products off). Both sum the same exact products q_i·k_i in float32 in
// other orders (the float path scales q first, the dots scale the sum): each score is within
// (D + 2)·u·scale·Σ_i|q_i·k_i| of the exact one (u = 2^-24), so the two within twice that, δ.
// lse = log Σ_j exp(s_j) then moves by ≤ δ plus each path's own rounding of the sum of Tk
// exponentials (≤ (Tk + 8)·u relative apiece); the bfloat16 outputs by one rounding each
// (2^-8 of |o|) plus ≤ 4δ·max|v|. A wrong mask of the last 32 channels, scale or pairing
// moves them by orders of magnitude more.
void expect_dots_near_float_path(const Problem& p) {
  SCOPED_TRACE(p.describe());
  const Result dots = run_dtype(p, Backend::kFast), plain = run_dots_off(p);
  const int64_t D = p.D, Tk = p.Tk, G = p.Hq / p.Hkv;
  const float* q = p.q32.data<float>();
  const float* k = p.k32.data<float>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D)), u = kU;
  double vmax = 0;
  for (int64_t i = 0; i < p.v32.numel(); ++i) vmax = std::max(vmax, std::fabs(double{p.v32.data<float>()[i]}));
  for (int64_t h = 0; h < p.Hq; ++h) {  // B = 1, Tq = 1: row h
    double delta = 0;  // the largest δ of the row's keys
    for (int64_t j = 0; j < Tk; ++j) {
      double a = 0;
      for (int64_t i = 0; i < D; ++i) a += std::fabs(static_cast<double>(q[h * D + i]) * k[((h / G) * Tk + j) * D + i]);
      delta = std::max(delta, 2 * (D + 2) * u * scale * a);
    }
    const double l0 = dots.lse.data<float>()[h], l1 = plain.lse.data<float>()[h];
    if (!std::isfinite(l1)) {  // NaN stays NaN (a NaN query takes the float path: the same bits)
      EXPECT_EQ(std::isnan(l0), std::isnan(l1)) << "lse of row " << h << ": " << l0 << " vs " << l1;
      continue;
    }
    EXPECT_LE(std::fabs(l0 - l1), delta + 2 * (Tk + 8) * u * (1 + std::fabs(l1))) << "lse of row " << h;
    for (int64_t c = 0; c < D; ++c) {
      const double o0 = dots.out.data<float>()[h * D + c], o1 = plain.out.data<float>()[h * D + c];
      EXPECT_LE(std::fabs(o0 - o1), (std::fabs(o0) + std::fabs(o1)) / 256 + 4 * delta * vmax + 1e-30)
          << "out of row " << h << ", column " << c;
    }
  }
}

// The decode kernel's bfloat16 dot products against its float path (expect_dots_near_float_path)
// over head dims, groups and key counts around the tiles, and on special values.
void expect_bf16_dots_near_float_path(uint64_t seed) {
  Rng rng(seed);
  for (int64_t D : {8, 20, 32, 33, 64, 100, 128})
    for (int64_t G : {1, 4, 16})
      for (int64_t Tk : {1, 15, 17, 129, 300}) {
        Problem p;
        p.dtype = DType::kBF16;
        p.Hkv = 2;
        p.Hq = 2 * G;
        p.Tk = Tk;
        p.D = p.Dv = D;
        p.opt.causal = Causal::kBottomRight;
        p.make(rng);
        expect_dots_near_float_path(p);
      }
  // Special values: a NaN query entry (that row takes the float path), an infinite key entry
  // (the rows of its kv head get an infinite or NaN score, on both paths alike).
  Problem p;
  p.Hkv = 2;
  p.Hq = 8;
  p.Tk = 40;
  p.D = p.Dv = 64;
  p.make(rng);
  p.q16.data<bfloat16>()[1 * 64 + 5] = to_bfloat16(std::nanf(""));
  p.k16.data<bfloat16>()[(1 * 40 + 7) * 64 + 3] = to_bfloat16(std::numeric_limits<float>::infinity());
  p.q32 = p.q16.to_f32();
  p.k32 = p.k16.to_f32();
  expect_dots_near_float_path(p);
  // Sums past the float range before the scale: q·k = 64 · 1e38 overflows, (q·scale)·k with
  // scale 1e-30 does not. Those rows take the float path's scores: its bits, finite.
  Problem big;
  big.Hkv = 1;
  big.Hq = 4;
  big.Tk = 40;
  big.D = big.Dv = 64;
  big.opt.scale = 1e-30f;
  big.make(rng);
  for (int64_t i = 0; i < big.q16.numel(); ++i) big.q16.data<bfloat16>()[i] = to_bfloat16(1e19f);
  for (int64_t i = 0; i < big.k16.numel(); ++i)
    big.k16.data<bfloat16>()[i] = to_bfloat16(i % 3 == 0 ? 1e19f : -1e19f);
  big.q32 = big.q16.to_f32();
  big.k32 = big.k16.to_f32();
  const Result dots = run_dtype(big, Backend::kFast), plain = run_dots_off(big);
  EXPECT_TRUE(bitwise_equal(dots.out, plain.out));
  EXPECT_TRUE(bitwise_equal(dots.lse, plain.lse));
  for (int64_t i = 0; i < dots.lse.numel(); ++i) EXPECT_TRUE(std::isfinite(dots.lse.data<float>()[i]));
}

TEST(HalfDecode, Bf16DotScoresStayWithinFloat32Sums) {
  if (!kernels::decode_bf16_dots()) GTEST_SKIP() << "this CPU has no AVX-512 BF16: the float path alone runs";
  // Both paths where the CPU has AMX: its tiles (head dims 32, 64 and 128 here; vdpbf16ps for the
  // others and for a partial tile of keys) and vdpbf16ps alone.
  const RestoreKernelSwitches restore;
  std::vector<bool> amx_paths{false};
  if (kernels::decode_amx_bf16()) amx_paths.push_back(true);
  for (const bool amx : amx_paths) {
    SCOPED_TRACE(amx ? "AMX tiles" : "vdpbf16ps");
    kernels::allow_decode_amx(amx);
    expect_bf16_dots_near_float_path(base_seed() + 130);
  }
}

// The bfloat16 forward with AMX tile products (flash_amx-inl.h) within check's bound of the
// float64 reference, where the CPU has them, on the shapes its tiles cut: head dims of 1 … 8
// tiles of 32 channels, value dims of 1 … 16 tiles of 16 columns (odd counts leave the 2 × 2
// blocks' halves), row counts leaving an odd row tile (G · queries not a multiple of 32), key
// counts around 16, 32 and the 64-key block (the last tile's rows past Tk staged, probabilities
// past the block's keys zeroed), (B, T, H, D) strides, masks, a bias, windows with sink tokens,
// softcap, dropout and weights. check() also runs the float32 tiles (dot products off) for
// their exact bits. The tile path must be the one that ran: its P, rounded to bfloat16 for the
// second product, moves the output's bits in most problems.
TEST(HalfAmx, ForwardTilesStayWithinTheBound) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 140);
  int problems = 0, moved = 0;
  auto run = [&](Problem& p) {
    p.dtype = DType::kBF16;
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.3)) p.keep = random_mask(rng, broadcast_shape(rng, full), rng.coin(0.5) ? 0.9 : 0.3);
    if (rng.coin(0.3)) p.bias = random_tensor(rng, broadcast_shape(rng, full));
    if (rng.coin(0.2)) p.lengths = random_lengths(rng, p.B, p.Tk);
    check(p);
    kernels::allow_forward_amx(false);
    const Result tiles_off = run_dtype(p, Backend::kFast);
    kernels::allow_forward_amx(true);
    const Result tiles = run_dtype(p, Backend::kFast);
    ++problems;
    moved += !bitwise_equal(tiles.out, tiles_off.out);
  };
  for (int64_t D : {32, 64, 96, 128, 256}) {
    for (int64_t Dv : {16, 48, 64, 80, 256}) {
      Problem p;
      p.Hkv = 2;
      p.Hq = 2 * rng.range(1, 5);
      p.Tq = rng.range(1, 80);
      p.Tk = rng.range(1, 200);
      p.D = D;
      p.Dv = Dv;
      p.bthd = rng.coin(0.5);
      p.opt.causal = static_cast<Causal>(rng.range(0, 2));
      run(p);
    }
  }
  for (int64_t Tk : {1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 257}) {
    Problem p;
    p.B = 2;
    p.Hkv = 1;
    p.Hq = 3;
    p.Tq = 37;
    p.Tk = Tk;
    p.D = 64;
    p.Dv = 64;
    p.opt.causal = Tk % 2 ? Causal::kBottomRight : Causal::kNone;
    if (Tk > 100) p.opt.window = 40, p.opt.sink_tokens = 4;
    if (Tk == 65) p.opt.softcap = 5.0f;
    if (Tk == 129) p.opt.dropout_p = 0.25f, p.opt.dropout_seed = rng.next();
    p.weights_rank = Tk == 100 ? 4 : Tk == 257 ? 3 : 0;
    run(p);
  }
  EXPECT_GE(moved, problems / 2) << "the tile path did not run";
}

// Keys and values seen backwards through negative row strides (values read so by the tiles,
// keys by the float32 tiles: a tile load steps forward) give what the same rows copied in that
// order give, within the tiles' rounding: attention without a mask does not depend on key order.
TEST(HalfAmx, ReversedRowsThroughNegativeStrides) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  Rng rng(base_seed() + 142);
  const int64_t Hq = 4, Tq = 70, Tk = 150, D = 64;
  const Tensor q = random_tensor(rng, {1, Hq, Tq, D}).converted(DType::kBF16);
  const Tensor k = random_tensor(rng, {1, 1, Tk, D}).converted(DType::kBF16);
  const Tensor v = random_tensor(rng, {1, 1, Tk, D}).converted(DType::kBF16);
  Tensor k_rev(DType::kBF16, {1, 1, Tk, D}), v_rev(DType::kBF16, {1, 1, Tk, D});
  for (int64_t j = 0; j < Tk; ++j) {
    for (int64_t c = 0; c < D; ++c) {
      k_rev.data<bfloat16>()[j * D + c] = k.data<bfloat16>()[(Tk - 1 - j) * D + c];
      v_rev.data<bfloat16>()[j * D + c] = v.data<bfloat16>()[(Tk - 1 - j) * D + c];
    }
  }
  auto run = [&](const View<const bfloat16>& key, const View<const bfloat16>& value) {
    Tensor out(DType::kBF16, {1, Hq, Tq, D}), lse(DType::kF32, {1, Hq, Tq});
    BasicAttentionInputs<bfloat16> in;
    in.query = q.view<bfloat16>();
    in.key = key;
    in.value = value;
    attention(in, {out.view<bfloat16>(), lse.view<float>(), View<bfloat16>()});
    return out.to_f32();
  };
  const std::initializer_list<int64_t> backwards = {Tk * D, Tk * D, -D, 1};
  const View<const bfloat16> k_back(k.data<bfloat16>() + (Tk - 1) * D, {1, 1, Tk, D}, backwards);
  const View<const bfloat16> v_back(v.data<bfloat16>() + (Tk - 1) * D, {1, 1, Tk, D}, backwards);
  const Tensor copied = run(k_rev.view<bfloat16>(), v_rev.view<bfloat16>());
  const double bound = 2 * unit_roundoff(DType::kBF16) * finite_max_abs(copied);
  EXPECT_LE(abs_error(run(k_rev.view<bfloat16>(), v_back), copied), bound) << "values backwards (tiles)";
  EXPECT_LE(abs_error(run(k_back, v_back), copied), bound) << "keys and values backwards (float32 tiles)";
}

// Where q·k passes the float range but (q·scale)·k does not (a small explicit scale), the
// tile sums are infinite: those scores are taken as the float path takes them (finite), and an
// infinite key entry still gives that key infinite or NaN scores, as on the float path.
TEST(HalfAmx, ScoresPastTheFloatRangeTakeTheFloatPath) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 141);
  auto problem = [&](std::optional<float> scale) {
    Problem p;
    p.dtype = DType::kBF16;
    p.Hkv = 1;
    p.Hq = 2;
    p.Tq = 20;
    p.Tk = 40;
    p.D = p.Dv = 64;
    p.opt.scale = scale;
    p.make(rng);
    return p;
  };
  Problem big = problem(1e-30f);
  for (int64_t i = 0; i < big.q16.numel(); ++i) big.q16.data<bfloat16>()[i] = to_bfloat16(i % 2 ? 1e19f : -1e19f);
  for (int64_t i = 0; i < big.k16.numel(); ++i) big.k16.data<bfloat16>()[i] = to_bfloat16(i % 3 ? 1e19f : -1e19f);
  big.q32 = big.q16.to_f32();
  big.k32 = big.k16.to_f32();
  const Result tiles = run_dtype(big, Backend::kFast);
  for (int64_t i = 0; i < tiles.lse.numel(); ++i) EXPECT_TRUE(std::isfinite(tiles.lse.data<float>()[i])) << i;
  check(big);
  Problem inf = problem(std::nullopt);
  inf.k16.data<bfloat16>()[7 * 64 + 3] = to_bfloat16(std::numeric_limits<float>::infinity());
  inf.k32 = inf.k16.to_f32();
  kernels::allow_forward_amx(false);
  const Result off = run_dtype(inf, Backend::kFast);
  kernels::allow_forward_amx(true);
  const Result on = run_dtype(inf, Backend::kFast);
  for (int64_t i = 0; i < on.lse.numel(); ++i) {
    const float a = on.lse.data<float>()[i], b = off.lse.data<float>()[i];
    EXPECT_EQ(std::isnan(a), std::isnan(b)) << i;
    EXPECT_EQ(std::isinf(a), std::isinf(b)) << i;
  }
  check(inf);
}

INSTANTIATE_TEST_SUITE_P(Targets, HalfTest,
                         ::testing::Combine(::testing::ValuesIn(kernels::simd_targets()),
                                            ::testing::Values(DType::kBF16, DType::kF16)),
                         param_name);

}  // namespace
}  // namespace mha::test
