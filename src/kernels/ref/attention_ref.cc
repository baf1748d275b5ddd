#include "kernels/ref/attention_ref.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/dropout.h"

namespace mha::kernels {
namespace {

template <typename Acc>
struct HeadRow {
  std::vector<Acc> prob;  // per key, after masking, normalisation and dropout
  std::vector<Acc> out;   // Dv
  Acc lse;                // -inf when fully masked, NaN when the row is NaN
};

// Probabilities and output of query row i of batch b, head h.
template <typename Acc>
void compute_head_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i, HeadRow<Acc>& row) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  const int64_t Tk = p.kv_len;
  const Dropout dropout(p.dropout_p, p.dropout_seed);
  const KeyRange range = visible_keys(p, b, i);
  const int64_t hk = h / p.group();
  const int64_t q_row = b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2];

  std::vector<Acc> score(Tk);
  std::vector<bool> visible(Tk);
  row.prob.assign(Tk, Acc(0));
  row.out.assign(p.head_dim_v, Acc(0));

  // Scores of the visible keys.
  for (int64_t j = 0; j < Tk; ++j) {
    visible[j] = range.visible(j);
    if (visible[j] && p.keep) {
      visible[j] = p.keep[b * p.keep_stride[0] + h * p.keep_stride[1] + i * p.keep_stride[2] + j * p.keep_stride[3]] != 0;
    }
    if (!visible[j]) continue;
    const int64_t k_row = b * p.k_stride[0] + hk * p.k_stride[1] + j * p.k_stride[2];
    Acc dot = 0;
    for (int64_t d = 0; d < p.head_dim_qk; ++d)
      dot += static_cast<Acc>(load_element(p.q, q_row + d * p.q_stride[3], p.dtype)) *
             static_cast<Acc>(load_element(p.k, k_row + d * p.k_stride[3], p.dtype));
    Acc s = static_cast<Acc>(p.scale) * dot;
    if (p.softcap > 0) s = static_cast<Acc>(p.softcap) * std::tanh(s / static_cast<Acc>(p.softcap));
    if (p.alibi) s -= static_cast<Acc>(alibi_slope(p, b, h)) * static_cast<Acc>(std::abs(query_position(p, b, i) - j));
    if (p.attn_bias) {
      s += static_cast<Acc>(p.attn_bias[b * p.attn_bias_stride[0] + h * p.attn_bias_stride[1] + i * p.attn_bias_stride[2] +
                                   j * p.attn_bias_stride[3]]);
    }
    score[j] = s;
  }

  // max, with NaN propagated: a NaN score makes the whole row NaN.
  Acc max = kNegInf;
  for (int64_t j = 0; j < Tk; ++j) {
    if (!visible[j]) continue;
    if (std::isnan(score[j])) {
      max = score[j];
      break;
    }
    if (score[j] > max) max = score[j];
  }
  const bool fully_masked = max == kNegInf;
  // A sink joins the denominator: the shift is the larger of the two, the sum starts with its term.
  const Acc sink = p.sinks ? static_cast<Acc>(sink_logit(p, h)) : kNegInf;
  if (p.sinks && !std::isnan(max)) max = std::max(max, sink);

  // A key contributes unless it is masked or its score is -inf: those weights are exactly 0,
  // also in a NaN row (where exp(-inf - NaN) would be NaN).
  auto contributes = [&](int64_t j) { return visible[j] && !fully_masked && score[j] != kNegInf; };
  Acc sum = p.sinks ? std::exp(sink - max) : Acc(0);
  for (int64_t j = 0; j < Tk; ++j) {
    row.prob[j] = contributes(j) ? std::exp(score[j] - max) : Acc(0);
    sum += row.prob[j];
  }
  for (int64_t j = 0; j < Tk; ++j) {
    row.prob[j] = contributes(j) ? row.prob[j] / sum : Acc(0);
    if (dropout.active()) row.prob[j] = dropout.keep(b, h, i, j) ? row.prob[j] * dropout.scale() : Acc(0);
  }
  for (int64_t j = 0; j < Tk; ++j) {
    if (!contributes(j)) continue;  // value rows of keys that do not contribute are never read (no 0 * NaN)
    const int64_t v_row = b * p.v_stride[0] + hk * p.v_stride[1] + j * p.v_stride[2];
    for (int64_t d = 0; d < p.head_dim_v; ++d)
      row.out[d] += row.prob[j] * static_cast<Acc>(load_element(p.v, v_row + d * p.v_stride[3], p.dtype));
  }
  row.lse = fully_masked ? sink : max + std::log(sum);  // sink is -inf without sinks
}

template <typename Acc>
void store_output(const AttentionParams& p, int64_t b, int64_t h, int64_t i, const HeadRow<Acc>& row) {
  const int64_t o = b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
  for (int64_t d = 0; d < p.head_dim_v; ++d)
    store_element(p.out, o + d * p.out_stride[3], static_cast<float>(row.out[d]), p.dtype);
}

}  // namespace

template <typename Acc>
void attention_ref_row(const AttentionParams& p, int64_t b, int64_t i) {
  const int64_t Tk = p.kv_len;
  HeadRow<Acc> row;
  std::vector<Acc> weight_sum(p.weights_averaged ? Tk : 0);
  for (int64_t h = 0; h < p.q_heads; ++h) {
    compute_head_row(p, b, h, i, row);
    store_output(p, b, h, i, row);
    if (p.lse) p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = static_cast<float>(row.lse);
    if (p.weights && !p.weights_averaged) {
      float* w = p.weights + b * p.weights_stride[0] + h * p.weights_stride[1] + i * p.weights_stride[2];
      for (int64_t j = 0; j < Tk; ++j) w[j * p.weights_stride[3]] = static_cast<float>(row.prob[j]);
    }
    if (p.weights_averaged) {
      for (int64_t j = 0; j < Tk; ++j) weight_sum[j] += row.prob[j];
    }
  }
  if (p.weights && p.weights_averaged) {
    float* w = p.weights + b * p.weights_stride[0] + i * p.weights_stride[2];
    for (int64_t j = 0; j < Tk; ++j)
      w[j * p.weights_stride[3]] = static_cast<float>(weight_sum[j] / static_cast<Acc>(p.q_heads));
  }
}

void attention_ref_output_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  HeadRow<double> row;
  compute_head_row(p, b, h, i, row);
  store_output(p, b, h, i, row);
}

template void attention_ref_row<double>(const AttentionParams&, int64_t, int64_t);
template void attention_ref_row<float>(const AttentionParams&, int64_t, int64_t);

}  // namespace mha::kernels
