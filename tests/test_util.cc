#include "test_util.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/cpu/flash.h"

namespace mha::test {

uint64_t base_seed() {
  const char* s = std::getenv("MHA_TEST_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 20261130ull;
}

void restore_kernel_switches() {
  kernels::force_simd_target("");
  kernels::allow_decode_dot_products(true);
  kernels::allow_decode_avx512_vnni(true);
  kernels::allow_decode_byte_values(true);
  kernels::allow_decode_amx(true);
  kernels::allow_decode_amx_values(true);
  kernels::allow_decode_bf16_values(true);
  kernels::force_decode_bf16_values(false);
  kernels::allow_forward_amx(true);
  kernels::allow_backward_amx(true);
  kernels::set_backward_pack_limit(kernels::kDefaultBackwardPackLimit);
  kernels::set_forward_value_keep_limit(kernels::kDefaultForwardValueKeepLimit);
}

DecodeRounding decode_rounding(CacheType type) { return decode_rounding(type, kernels::simd_targets().front()); }

DecodeRounding decode_rounding(CacheType type, const std::string& target) {
  DecodeRounding r;
  // Only the AVX3 and AVX2 targets have dot products (integer; bfloat16 on AVX3).
  if (target != "AVX3" && target != "AVX2") return r;
  const bool avx3 = target == "AVX3";
  if (type == CacheType::kInt4) {
    if (kernels::decode_int8_dots()) r.query = 1.0 / (1 << 4);
    const bool rounded = avx3 ? kernels::decode_vnni_byte_values() || kernels::decode_bf16_dots()
                              : kernels::decode_byte_values();
    if (rounded) r.values = 1.0 / (1 << 6);
  } else if (type == CacheType::kInt8) {
    if (kernels::decode_int8_dots()) r.query = 1.0 / (1 << 12);
    if (avx3 ? kernels::decode_vnni_word_values() : kernels::decode_byte_values()) r.values = 1.0 / (1 << 9);
  }
  return r;
}

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }

float Rng::normal() {
  const double u1 = uniform() + 1e-300, u2 = uniform();
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

int64_t Rng::range(int64_t lo, int64_t hi) {
  // An empty range is a bug in the test that asks for it (its draws would be garbage).
  if (lo > hi) throw std::logic_error("Rng::range(" + std::to_string(lo) + ", " + std::to_string(hi) + "): lo > hi");
  return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
}

Tensor random_tensor(Rng& rng, std::vector<int64_t> shape, float scale) {
  Tensor t(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = scale * rng.normal();
  return t;
}

Tensor random_mask(Rng& rng, std::vector<int64_t> shape, double keep_probability) {
  Tensor t(DType::kU8, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = rng.coin(keep_probability);
  return t;
}

std::vector<int64_t> broadcast_shape(Rng& rng, const std::vector<int64_t>& full) {
  const int64_t rank = std::min<int64_t>(rng.range(1, 4), static_cast<int64_t>(full.size()));
  std::vector<int64_t> s(full.end() - rank, full.end());
  for (auto& d : s)
    if (rng.coin(0.4)) d = 1;
  return s;
}

Tensor random_lengths(Rng& rng, int64_t B, int64_t Tk) {
  Tensor t(DType::kI64, {B});
  for (int64_t b = 0; b < B; ++b) t.data<int64_t>()[b] = static_cast<int64_t>(rng.range(0, Tk));
  return t;
}

namespace {
template <typename F>
void for_each(const View<const float>& v, F&& f) {
  const int64_t d0 = v.rank > 0 ? v.shape[0] : 1, d1 = v.rank > 1 ? v.shape[1] : 1;
  const int64_t d2 = v.rank > 2 ? v.shape[2] : 1, d3 = v.rank > 3 ? v.shape[3] : 1;
  for (int64_t a = 0; a < d0; ++a)
    for (int64_t b = 0; b < d1; ++b)
      for (int64_t c = 0; c < d2; ++c)
        for (int64_t d = 0; d < d3; ++d) f(v.at(a, b, c, d), ((a * d1 + b) * d2 + c) * d3 + d);
}
}  // namespace

double max_abs(const View<const float>& v) {
  double m = 0;
  for_each(v, [&](float x, int64_t) { m = std::max(m, std::fabs(static_cast<double>(x))); });
  return m;
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

double rel_error(const View<const float>& got, const View<const float>& want) {
  EXPECT_EQ(got.numel(), want.numel());
  std::vector<double> w;
  for_each(want, [&](float x, int64_t) { w.push_back(x); });
  double err = 0;
  for_each(got, [&](float x, int64_t i) {
    const double e = std::fabs(static_cast<double>(x) - w[i]);
    err = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(err, e);
  });
  return err / std::max(max_abs(want), 1e-30);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

void add_score_variants(Rng& rng, double chance, int64_t B, int64_t Hq, float sink_range, AttentionInputs& in,
                        AttentionOptions& opt, Tensor* alibi, Tensor* sinks) {
  if (rng.coin(chance)) opt.softcap = static_cast<float>(0.3 + rng.uniform());
  if (rng.coin(chance)) {
    *alibi = rng.coin(0.5) ? Tensor(DType::kF32, {Hq}) : Tensor(DType::kF32, {B, Hq});
    for (int64_t i = 0; i < alibi->numel(); ++i) alibi->data<float>()[i] = static_cast<float>(0.5 * rng.uniform());
    in.alibi_slopes = alibi->view<float>();
  }
  if (rng.coin(chance)) {
    *sinks = Tensor(DType::kF32, {Hq});
    for (int64_t i = 0; i < Hq; ++i) sinks->data<float>()[i] = static_cast<float>(sink_range * (2 * rng.uniform() - 1));
    in.sinks = sinks->view<float>();
  }
}

double lse_floor(const AttentionInputs& in, const AttentionOptions& opt, double lse_max) {
  const View<const float>& q = in.query;
  const View<const float>& k = in.key;
  const int64_t B = q.shape[0], Hq = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Tk = k.shape[2];
  const double scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(static_cast<double>(D));
  double dots = 0;  // max over rows and keys of scale·Σ_c |q_c·k_c|
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < Tk; ++j) {
          double sum = 0;
          for (int64_t c = 0; c < D; ++c) sum += std::fabs(double{q.at(b, h, i, c)} * k.at(b, h / (Hq / Hkv), j, c));
          dots = std::max(dots, sum * scale);
        }
  double bias_max = 0;
  if (in.attn_bias.given())
    for_each(in.attn_bias, [&](float x, int64_t) {
      if (std::isfinite(x)) bias_max = std::max(bias_max, std::fabs(double{x}));
    });
  // ALiBi adds slope·|distance|, the distance below Tq + Tk whatever the alignment.
  const double alibi_max = in.alibi_slopes.given() ? max_abs(in.alibi_slopes) * static_cast<double>(Tq + Tk) : 0.0;
  const double terms = 2 * std::sqrt(static_cast<double>(D)) * dots + bias_max + alibi_max + 4.0 * opt.softcap;
  return (terms + 8 + 2 * lse_max) * std::ldexp(1.0, -24);
}

NaiveResult naive_attention(const AttentionInputs& in, const AttentionOptions& options) {
  const auto& q = in.query;
  const auto& k = in.key;
  const auto& v = in.value;
  const int64_t B = q.shape[0], Hq = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3];
  const double scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(D));
  // Element (b, h, i, j) of a mask of any rank <= 4, broadcast right-aligned.
  auto mask_at = [](auto& m, int64_t b, int64_t h, int64_t i, int64_t j) {
    const int64_t idx[4] = {b, h, i, j};
    int64_t off = 0;
    for (int d = 0; d < m.rank; ++d) {
      const int64_t full = idx[4 - m.rank + d];
      off += (m.shape[d] == 1 ? 0 : full) * m.stride[d];
    }
    return m.data[off];
  };
  // K and V repeated per query head (GQA by copying, unlike the library).
  std::vector<double> K(B * Hq * Tk * D), V(B * Hq * Tk * Dv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t j = 0; j < Tk; ++j) {
        const int64_t hk = h * Hkv / Hq;
        for (int64_t d = 0; d < D; ++d) K[((b * Hq + h) * Tk + j) * D + d] = k.at(b, hk, j, d);
        for (int64_t d = 0; d < Dv; ++d) V[((b * Hq + h) * Tk + j) * Dv + d] = v.at(b, hk, j, d);
      }
  NaiveResult r;
  r.out.assign(B * Hq * Tq * Dv, 0.0);
  r.lse.assign(B * Hq * Tq, -std::numeric_limits<double>::infinity());
  r.weights.assign(B * Hq * Tq * Tk, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = in.key_lengths.given() ? in.key_lengths.at(b) : Tk;
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Tq; ++i) {
        std::vector<double> s(Tk, -std::numeric_limits<double>::infinity());
        std::vector<bool> vis(Tk, true);
        for (int64_t j = 0; j < Tk; ++j) {
          bool ok = j < L;
          // A window keeps the last `window` keys; sink tokens (StreamingLLM) the first ones too.
          const bool sink = j < options.sink_tokens;
          if (options.causal == Causal::kTopLeft)
            ok = ok && j <= i && (options.window == 0 || j > i - options.window || sink);
          if (options.causal == Causal::kBottomRight)
            ok = ok && j <= i + L - Tq && (options.window == 0 || j > i + L - Tq - options.window || sink);
          if (in.keep_mask.given()) ok = ok && mask_at(in.keep_mask, b, h, i, j) != 0;
          vis[j] = ok;
          if (!ok) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q.at(b, h, i, d)) * K[((b * Hq + h) * Tk + j) * D + d];
          double x = scale * dot;
          if (options.softcap > 0) x = options.softcap * std::tanh(x / options.softcap);  // Gemma 2
          if (in.alibi_slopes.given()) {
            // BLOOM/FlashAttention ALiBi: -slope · |query position - key position|.
            const double slope = in.alibi_slopes.rank == 1 ? in.alibi_slopes.at(h) : in.alibi_slopes.at(b, h);
            const int64_t pos = options.causal == Causal::kTopLeft ? i : i + L - Tq;
            x -= slope * static_cast<double>(pos > j ? pos - j : j - pos);
          }
          s[j] = x + (in.attn_bias.given() ? mask_at(in.attn_bias, b, h, i, j) : 0.0f);
        }
        // A sink (gpt-oss) is one more logit in the softmax, with no value row.
        const bool has_sink = in.sinks.given();
        const double sink = has_sink ? in.sinks.at(h) : -std::numeric_limits<double>::infinity();
        double m = sink;
        for (int64_t j = 0; j < Tk; ++j)
          if (vis[j]) m = std::max(m, s[j]);
        if (m == -std::numeric_limits<double>::infinity()) continue;  // fully masked: zeros, lse -inf
        double sum = has_sink ? std::exp(sink - m) : 0.0;
        for (int64_t j = 0; j < Tk; ++j)
          if (vis[j]) sum += std::exp(s[j] - m);
        const double lse = m + std::log(sum);
        r.lse[(b * Hq + h) * Tq + i] = lse;
        for (int64_t j = 0; j < Tk; ++j) {
          const double p = vis[j] ? std::exp(s[j] - lse) : 0.0;
          r.weights[((b * Hq + h) * Tq + i) * Tk + j] = p;
          for (int64_t d = 0; d < Dv; ++d) r.out[((b * Hq + h) * Tq + i) * Dv + d] += p * V[((b * Hq + h) * Tk + j) * Dv + d];
        }
      }
  }
  return r;
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& words) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& w : words) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "no mha::Error thrown";
}

}  // namespace mha::test
