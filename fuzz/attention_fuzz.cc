// libFuzzer target: the attention entry point with fuzzed shapes, strides, masks and options,
// the fast path compared with the float64 reference (and the plain float32 one for the bound).
// Invariants: no crash or UB; invalid arguments are an mha::Error; NaN and infinities land in
// the same places on both paths; finite outputs obey err(fast) <= 2·err(plain) + 4u or, for
// ill-conditioned inputs, the a-priori bound (docs/numerics.md).
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <limits>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "mha/attention.h"
#include "mha/safetensors.h"
#include "ops/attention_checks.h"

namespace {

using mha::Tensor;
using mha::View;
using mha::fuzz::Rng;

struct Outputs {
  Tensor out, lse, weights;
};

std::vector<int64_t> broadcast_shape(mha::fuzz::Input& in, const std::vector<int64_t>& full) {
  const int rank = static_cast<int>(in.range(1, 4));
  std::vector<int64_t> s(full.end() - rank, full.end());
  for (auto& d : s)
    if (in.flag()) d = 1;
  return s;
}

}  // namespace

// The same view over a 16-bit copy of its tensor (same shape and strides).
template <typename T>
View<const T> same_layout(const View<const float>& v, const Tensor& t16) {
  View<const T> w;
  w.data = t16.data<T>();
  w.rank = v.rank, w.shape = v.shape, w.stride = v.stride;
  return w;
}

// 16-bit inputs: the fast path must give, bit for bit, the float32 fast path's results on the
// widened inputs, rounded once (docs/numerics.md, "16-bit types") — with the decode kernel's
// dot products off. With them on (bfloat16 keys by vdpbf16ps, sums in another order) Inf and
// NaN must land in the same places (tests/half_attention_test.cc holds their accuracy).
template <typename T>
void check_sixteen_bit(const mha::AttentionInputs& ai, const Tensor& q, const Tensor& k, const Tensor& v,
                       mha::AttentionOptions opt, int weights, int64_t B, int64_t Hq, int64_t Tq, int64_t Tk,
                       int64_t Dv) {
  const mha::DType t = mha::DTypeOf<T>::value;
  const Tensor q16 = q.converted(t), k16 = k.converted(t), v16 = v.converted(t);
  const Tensor qw = q16.to_f32(), kw = k16.to_f32(), vw = v16.to_f32();
  mha::AttentionInputs wide = ai;
  wide.query = same_layout<float>(ai.query, qw);
  wide.key = same_layout<float>(ai.key, kw);
  wide.value = same_layout<float>(ai.value, vw);
  mha::BasicAttentionInputs<T> half{same_layout<T>(ai.query, q16),
                                    same_layout<T>(ai.key, k16),
                                    same_layout<T>(ai.value, v16),
                                    ai.keep_mask,
                                    ai.attn_bias,
                                    ai.key_lengths,
                                    ai.alibi_slopes,
                                    ai.sinks};
  std::vector<int64_t> wshape = weights == 1 ? std::vector<int64_t>{B, Hq, Tq, Tk} : std::vector<int64_t>{B, Tq, Tk};
  Tensor o32(mha::DType::kF32, {B, Hq, Tq, Dv}), l32(mha::DType::kF32, {B, Hq, Tq}), w32;
  Tensor o16(t, {B, Hq, Tq, Dv}), l16(mha::DType::kF32, {B, Hq, Tq}), w16;
  if (weights) w32 = Tensor(mha::DType::kF32, wshape), w16 = Tensor(t, wshape);
  opt.backend = mha::Backend::kFast;
  mha::attention(wide, {o32.view<float>(), l32.view<float>(), weights ? w32.view<float>() : View<float>()}, opt);
  mha::kernels::allow_decode_dot_products(false);
  mha::attention(half, mha::BasicAttentionOutputs<T>{o16.view<T>(), l16.view<float>(), weights ? w16.view<T>() : View<T>()},
                 opt);
  mha::kernels::allow_decode_dot_products(true);
  Tensor od(t, {B, Hq, Tq, Dv}), ld(mha::DType::kF32, {B, Hq, Tq}), wd;
  if (weights) wd = Tensor(t, wshape);
  mha::attention(half, {od.view<T>(), ld.view<float>(), weights ? wd.view<T>() : View<T>()}, opt);
  auto same_specials = [](const Tensor& a, const Tensor& b) {  // float32 copies: Inf and NaN in the same places
    const Tensor x = a.to_f32(), y = b.to_f32();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float u = x.data<float>()[i], w = y.data<float>()[i];
      if (std::isnan(u) != std::isnan(w) || (std::isinf(u) || std::isinf(w) ? u != w : false)) return false;
    }
    return true;
  };
  if (!same_specials(od, o16) || !same_specials(ld, l16) || (weights && !same_specials(wd, w16))) {
    std::fprintf(stderr, "%s: the decode dot products put Inf or NaN elsewhere (B=%ld Hq=%ld Tq=%ld Tk=%ld Dv=%ld)\n",
                 mha::dtype_name(t), (long)B, (long)Hq, (long)Tq, (long)Tk, (long)Dv);
    __builtin_trap();
  }
  auto same_bits = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  if (!same_bits(o16, o32.converted(t)) || !same_bits(l16, l32) || (weights && !same_bits(w16, w32.converted(t)))) {
    std::fprintf(stderr, "%s: the 16-bit path is not the rounded float32 path (B=%ld Hq=%ld Tq=%ld Tk=%ld Dv=%ld)\n",
                 mha::dtype_name(t), (long)B, (long)Hq, (long)Tq, (long)Tk, (long)Dv);
    __builtin_trap();
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha::fuzz::Input in(data, size);
  const int64_t B = in.range(1, 2), Hkv = in.range(1, 3), Hq = Hkv * in.range(1, 4);
  const int64_t Tq = in.range(0, 70), Tk = in.range(0, 70), D = in.range(1, 40), Dv = in.range(1, 40);
  Rng rng{in.u64()};
  auto make = [&](int64_t H, int64_t T, int64_t Dd, bool bthd, Tensor* t) {
    *t = Tensor(mha::DType::kF32, bthd ? std::vector<int64_t>{B, T, H, Dd} : std::vector<int64_t>{B, H, T, Dd});
    for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = rng.next();
    if (bthd) return View<const float>(t->data<float>(), {B, H, T, Dd}, {T * H * Dd, Dd, H * Dd, 1});
    return View<const float>(t->data<float>(), {B, H, T, Dd});
  };
  Tensor q, k, v, keep, bias, lengths;
  mha::AttentionInputs ai;
  ai.query = make(Hq, Tq, D, in.flag(), &q);
  ai.key = make(Hkv, Tk, D, in.flag(), &k);
  ai.value = make(Hkv, Tk, Dv, in.flag(), &v);
  // Occasional non-finite inputs.
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (int n = static_cast<int>(in.range(0, 3)); n > 0; --n) {
    Tensor* t = in.flag() ? &q : (in.flag() ? &k : &v);
    if (t->numel() > 0) t->data<float>()[in.u64() % t->numel()] = specials[in.range(0, 2)];
  }
  const std::vector<int64_t> full = {B, Hq, Tq, Tk};
  if (in.flag()) {
    keep = Tensor(mha::DType::kU8, broadcast_shape(in, full));
    const uint8_t density = in.byte();
    for (int64_t i = 0; i < keep.numel(); ++i) keep.data<uint8_t>()[i] = (rng.next() + 8.0f) * 16.0f < density;
    ai.keep_mask = keep.view<uint8_t>();
  }
  if (in.flag()) {
    bias = Tensor(mha::DType::kF32, broadcast_shape(in, full));
    for (int64_t i = 0; i < bias.numel(); ++i) bias.data<float>()[i] = rng.next();
    ai.attn_bias = bias.view<float>();
  }
  if (in.flag()) {
    lengths = Tensor(mha::DType::kI64, {B});
    for (int64_t b = 0; b < B; ++b) lengths.data<int64_t>()[b] = static_cast<int64_t>(in.range(-1, Tk + 1));
    ai.key_lengths = lengths.view<int64_t>();
  }
  mha::AttentionOptions opt;
  opt.causal = static_cast<mha::Causal>(in.range(0, 2));
  opt.window = in.flag() ? in.range(-1, 20) : 0;
  if (in.flag()) opt.dropout_p = 0.3f, opt.dropout_seed = in.u64();
  if (in.flag()) opt.scale = rng.next() / 4;
  // Score variants: softcap (a negative one must be refused), ALiBi slopes, sinks, sink tokens
  // (without a window: refused).
  Tensor slopes, sinks;
  if (in.flag()) opt.softcap = in.flag() ? 0.25f + std::fabs(rng.next()) : -1.0f;
  if (in.flag()) {
    slopes = Tensor(mha::DType::kF32, {Hq});
    for (int64_t h = 0; h < Hq; ++h) slopes.data<float>()[h] = std::fabs(rng.next()) / 16;  // [0, 0.5)
    ai.alibi_slopes = slopes.view<float>();
  }
  if (in.flag()) {
    sinks = Tensor(mha::DType::kF32, {Hq});
    for (int64_t h = 0; h < Hq; ++h) sinks.data<float>()[h] = rng.next() / 2;
    ai.sinks = sinks.view<float>();
  }
  if (in.flag()) opt.sink_tokens = in.range(-1, 8);
  opt.num_threads = 1;
  const int weights = static_cast<int>(in.range(0, 2));  // none, per head, averaged

  auto outputs = [&]() {
    Outputs o;
    o.out = Tensor(mha::DType::kF32, {B, Hq, Tq, Dv});
    o.lse = Tensor(mha::DType::kF32, {B, Hq, Tq});
    if (weights == 1) o.weights = Tensor(mha::DType::kF32, {B, Hq, Tq, Tk});
    if (weights == 2) o.weights = Tensor(mha::DType::kF32, {B, Tq, Tk});
    return o;
  };
  auto views = [](Outputs& o) {
    return mha::AttentionOutputs{o.out.view<float>(), o.lse.view<float>(),
                                 o.weights.defined() ? o.weights.view<float>() : View<float>()};
  };
  Outputs fast = outputs(), ref = outputs(), plain = outputs();
  try {
    opt.backend = mha::Backend::kFast;
    mha::attention(ai, views(fast), opt);
  } catch (const mha::Error&) {
    // The checks are shared: the reference must refuse the same arguments.
    opt.backend = mha::Backend::kReference;
    try {
      mha::attention(ai, views(ref), opt);
    } catch (const mha::Error&) {
      return 0;
    }
    __builtin_trap();
  }
  opt.backend = mha::Backend::kReference;
  mha::attention(ai, views(ref), opt);
  const mha::kernels::AttentionParams p = mha::ops::make_attention_params(ai, views(plain), opt);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tq; ++i) mha::kernels::attention_ref_row<float>(p, b, i);

  // The a-priori bound of docs/numerics.md, for inputs so large that plain float32's own error
  // is luck: every score is off by at most ds = (D + 2)·u·max|s|, every probability by a
  // relative 2·ds + 4u, and the output by that times max|v| plus (Tk + 8)·u·max|v|.
  const double u = 1.0 / (1 << 24);
  auto max_abs = [](const Tensor& t) {
    double m = 0;
    for (int64_t i = 0; i < t.numel(); ++i)
      if (std::isfinite(t.data<float>()[i])) m = std::max(m, std::fabs(static_cast<double>(t.data<float>()[i])));
    return m;
  };
  // Scores: the softcap bounds the dot product's part; ALiBi adds up to max slope · Tk.
  const double dot_max = static_cast<double>(std::fabs(p.scale)) * D * max_abs(q) * max_abs(k);
  const double s_max = (opt.softcap > 0 ? std::min<double>(dot_max, opt.softcap) : dot_max) +
                       (bias.defined() ? max_abs(bias) : 0.0) + (slopes.defined() ? max_abs(slopes) * Tk : 0.0);
  const double ds = (D + 2) * u * s_max;
  const double drop_scale = opt.dropout_p > 0 ? 1.0 / (1.0 - opt.dropout_p) : 1.0;
  const double v_max = max_abs(v) * drop_scale;
  const double derived_out = v_max * (2 * ds + 4 * u + (Tk + 8) * u);
  const double derived_prob = drop_scale * (2 * ds + 4 * u);
  auto dump_inputs = [&] {
    if (const char* path = std::getenv("MHA_FUZZ_DUMP")) {  // triage: the failing inputs
      mha::StateDict dump;
      dump.emplace("query", q.clone());
      dump.emplace("key", k.clone());
      dump.emplace("value", v.clone());
      mha::write_safetensors(path, dump);
    }
  };
  auto check = [&](const Tensor& f, const Tensor& r, const Tensor& pl, double derived) {
    if (!f.defined()) return;
    double scale = 1e-30, ep = 0, ef = 0;
    for (int64_t i = 0; i < r.numel(); ++i) {
      const float x = f.data<float>()[i], y = r.data<float>()[i], z = pl.data<float>()[i];
      if (std::isnan(y) != std::isnan(x) || (std::isinf(y) && x != y)) {
        std::fprintf(stderr, "non-finite mismatch at [%ld]: fast %g ref %g (B=%ld Hq=%ld Hkv=%ld Tq=%ld Tk=%ld D=%ld "
                     "Dv=%ld causal=%d window=%ld p=%g keep=%d bias=%d lengths=%d weights=%d)\n", (long)i, x, y,
                     (long)B, (long)Hq, (long)Hkv, (long)Tq, (long)Tk, (long)D, (long)Dv, (int)opt.causal,
                     (long)opt.window, opt.dropout_p, ai.keep_mask.given(), ai.attn_bias.given(), ai.key_lengths.given(),
                     weights);
        if (std::getenv("MHA_FUZZ_VERBOSE")) {
          const int64_t w = r.shape().back(), row = i / w;
          for (int64_t j = 0; j < w; ++j)
            std::fprintf(stderr, "  [%ld] fast %g ref %g plain %g\n", (long)j, f.data<float>()[row * w + j],
                         r.data<float>()[row * w + j], pl.data<float>()[row * w + j]);
        }
        dump_inputs();
        __builtin_trap();
      }
      if (!std::isfinite(y)) continue;
      scale = std::max(scale, std::fabs(static_cast<double>(y)));
      ef = std::max(ef, std::fabs(static_cast<double>(x) - y));
      if (std::isfinite(z)) ep = std::max(ep, std::fabs(static_cast<double>(z) - y));
    }
    if (ef > 2 * ep + 4 * u * scale && ef > derived) {
      std::fprintf(stderr, "bound: fast %.3g plain %.3g derived %.3g scale %.3g (B=%ld Hq=%ld Hkv=%ld Tq=%ld Tk=%ld "
                   "D=%ld Dv=%ld causal=%d window=%ld p=%g keep=%d bias=%d lengths=%d)\n", ef, ep, derived, scale,
                   (long)B, (long)Hq, (long)Hkv, (long)Tq, (long)Tk, (long)D, (long)Dv, (int)opt.causal,
                   (long)opt.window, opt.dropout_p, ai.keep_mask.given(), ai.attn_bias.given(), ai.key_lengths.given());
      dump_inputs();
      __builtin_trap();
    }
  };
  check(fast.out, ref.out, plain.out, derived_out);
  check(fast.lse, ref.lse, plain.lse, 2 * ds + (Tk + 8) * u * (s_max + 1));
  check(fast.weights, ref.weights, plain.weights, derived_prob);
  if (in.flag()) {
    if (in.flag()) {
      check_sixteen_bit<mha::bfloat16>(ai, q, k, v, opt, weights, B, Hq, Tq, Tk, Dv);
    } else {
      check_sixteen_bit<mha::float16>(ai, q, k, v, opt, weights, B, Hq, Tq, Tk, Dv);
    }
  }
  return 0;
}
