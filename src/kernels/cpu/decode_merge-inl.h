// The end of a decode step (flash_decode.cc): the partial results (O, m, l) of a (batch, kv
// head)'s chunks merged in chunk order through their log-sum-exp, in double, and the rows written
// out, divided by their sums (StoreQuotients when one chunk needs no merge), with the log-sum-exp
// and the reference's redo of a non-finite row where the cache's layout allows one; and which
// query head and query a task's row is (DecodeRows).
#if defined(MHA_KERNELS_CPU_DECODE_MERGE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_MERGE_INL_H_
#undef MHA_KERNELS_CPU_DECODE_MERGE_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_MERGE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/ref/attention_ref.h"
#include "kernels/workspace.h"
#include "mha/half.h"
#include "util/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

// The rows of a decode task: query heads hk·G .. hk·G + G, queries 0 .. Tq.
struct DecodeRows {
  int64_t rows;
  int64_t head(const AttentionParams& p, int64_t hk, int64_t r) const { return hk * p.group() + r / p.q_len; }
  int64_t query(const AttentionParams& p, int64_t r) const { return r % p.q_len; }
};

// out[c] = o[c] / l for c < Dv, rounded to the output's type; whether any quotient is not finite.
template <typename T>
HWY_INLINE bool StoreQuotients(DF d, const float* o, float l, size_t Dv, T* HWY_RESTRICT out) {
  const size_t N = hn::Lanes(d);
  auto bad = hn::FirstN(d, 0);  // lanes whose quotient is not finite
  for (size_t c = 0; c < Dv; c += N) {
    const size_t n = std::min(N, Dv - c);
    const auto x = hn::Div(hn::LoadU(d, o + c), hn::Set(d, l));
    StoreFromFloat(d, x, n, out + c);
    bad = hn::Or(bad, hn::AndNot(hn::IsFinite(x), hn::FirstN(d, n)));
  }
  return !hn::AllFalse(d, bad);
}

// Merges the chunks of (b, hk) in order and writes out and lse.
inline void Merge(const AttentionParams& p, int64_t b, int64_t hk, int64_t parts, const float* o, const float* m,
                  const float* l, size_t dvp) {
  double* acc = Workspace::local().get<double>(Workspace::kDecodeMerge, static_cast<size_t>(p.head_dim_v));
  const int64_t R = p.group() * p.q_len;
  const DecodeRows rows{R};
  for (int64_t r = 0; r < R; ++r) {
    float mx = kNegInf;
    for (int64_t s = 0; s < parts; ++s) mx = std::max(mx, m[s * R + r]);
    const int64_t h = rows.head(p, hk, r), i = rows.query(p, r);
    const int64_t out = b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
    if (parts == 1 && !p.sinks && p.out_stride[3] == 1 && std::isfinite(m[r]) && std::isfinite(l[r]) && l[r] > 0.0f) {
      // One chunk and a finite row: the general code's weight is exp2(0) = 1 and its quotient
      // in double, rounded to float, is the float quotient (both correctly rounded): the same
      // bits, without the double accumulator (a sixth of a small call's time, measured).
      const float* orow = o + r * static_cast<int64_t>(dvp);
      const size_t Dv = static_cast<size_t>(p.head_dim_v);
      bool nonfinite;
      switch (p.dtype) {
        case DType::kBF16: nonfinite = StoreQuotients(DF(), orow, l[r], Dv, static_cast<bfloat16*>(p.out) + out); break;
        case DType::kF16: nonfinite = StoreQuotients(DF(), orow, l[r], Dv, static_cast<float16*>(p.out) + out); break;
        default: nonfinite = StoreQuotients(DF(), orow, l[r], Dv, static_cast<float*>(p.out) + out); break;
      }
      if (p.lse) {
        p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
            static_cast<float>(m[r] + std::log(static_cast<double>(l[r])));
      }
      if (nonfinite && p.kv_bits == 0 && !p.block_tables) attention_ref_output_row(p, b, h, i);
      continue;
    }
    double sum = 0.0;
    std::fill(acc, acc + p.head_dim_v, 0.0);
    if (p.sinks) {  // the sink's term joins the denominator once, in the merge
      const float sink = sink_logit(p, h);
      mx = std::max(mx, sink);
      sum = std::exp2((static_cast<double>(sink) - mx) * kLog2e);
    }
    if (mx != kNegInf) {
      for (int64_t s = 0; s < parts; ++s) {
        if (l[s * R + r] == 0.0f) continue;  // this chunk saw nothing of the row
        const double w = std::exp2((static_cast<double>(m[s * R + r]) - mx) * kLog2e);
        sum += l[s * R + r] * w;
        for (int64_t c = 0; c < p.head_dim_v; ++c) acc[c] += o[(s * R + r) * static_cast<int64_t>(dvp) + c] * w;
      }
    }
    bool nan_score = false;  // a NaN score of the row reaches l (never m: max drops NaN)
    for (int64_t s = 0; s < parts; ++s) nan_score |= std::isnan(l[s * R + r]);
    const bool masked = sum == 0.0f && !nan_score;
    bool nonfinite = nan_score;
    for (int64_t c = 0; c < p.head_dim_v; ++c) {
      const float x = masked ? 0.0f : static_cast<float>(acc[c] / sum);
      store_element(p.out, out + c * p.out_stride[3], x, p.dtype);
      nonfinite |= !std::isfinite(x);
    }
    if (p.lse) {
      p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
          nan_score ? std::numeric_limits<float>::quiet_NaN()
          : masked  ? kNegInf
                    : static_cast<float>(mx + std::log(sum));
    }
    // As in the forward: a non-finite value must reach only the rows that attend to it. (Cache
    // storage read in place — quantized codes, paged pools — has no layout the reference reads:
    // there a non-finite value stays in the rows that read it; a quantized group is NaN anyway.)
    if (nonfinite && p.kv_bits == 0 && !p.block_tables) attention_ref_output_row(p, b, h, i);
  }
}

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_MERGE_INL_H_
