#include "kernels/ref/attention_bwd_ref.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/dropout.h"

namespace mha::kernels {

template <typename Acc>
void attention_bwd_ref_head(const AttentionParams& p, const AttentionGradParams& g, int64_t b, int64_t hk) {
  constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  const int64_t Tk = p.kv_len, D = p.head_dim_qk, Dv = p.head_dim_v;
  const Dropout dropout(p.dropout_p, p.dropout_seed);
  std::vector<Acc> dk(Tk * D, Acc(0)), dv(Tk * Dv, Acc(0)), score(Tk), prob(Tk), dprob(Tk), dq(D);
  std::vector<bool> contributes(Tk);
  std::vector<Acc> cap_grad(Tk, Acc(1));  // d(capped score)/d(scaled score) = 1 - tanh²
  auto K = [&](int64_t j, int64_t d) {
    return static_cast<Acc>(static_cast<const float*>(p.k)[b * p.k_stride[0] + hk * p.k_stride[1] + j * p.k_stride[2] + d * p.k_stride[3]]);
  };
  auto V = [&](int64_t j, int64_t d) {
    return static_cast<Acc>(static_cast<const float*>(p.v)[b * p.v_stride[0] + hk * p.v_stride[1] + j * p.v_stride[2] + d * p.v_stride[3]]);
  };
  for (int64_t g_ = 0; g_ < p.group(); ++g_) {
    const int64_t h = hk * p.group() + g_;
    for (int64_t i = 0; i < p.q_len; ++i) {
      auto Q = [&](int64_t d) {
        return static_cast<Acc>(static_cast<const float*>(p.q)[b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2] + d * p.q_stride[3]]);
      };
      auto dO = [&](int64_t d) {
        return static_cast<Acc>(static_cast<const float*>(g.grad_out)[b * g.grad_out_stride[0] + h * g.grad_out_stride[1] +
                                           i * g.grad_out_stride[2] + d * g.grad_out_stride[3]]);
      };
      // Recompute the probabilities as the forward does.
      const KeyRange range = visible_keys(p, b, i);
      Acc max = kNegInf;
      bool nan = false;
      for (int64_t j = 0; j < Tk; ++j) {
        bool vis = range.visible(j);
        if (vis && p.keep) {
          vis = p.keep[b * p.keep_stride[0] + h * p.keep_stride[1] + i * p.keep_stride[2] + j * p.keep_stride[3]] != 0;
        }
        contributes[j] = vis;
        if (!vis) continue;
        Acc dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += Q(d) * K(j, d);
        Acc s = static_cast<Acc>(p.scale) * dot;
        if (p.softcap > 0) {
          const Acc t = std::tanh(s / static_cast<Acc>(p.softcap));
          s = static_cast<Acc>(p.softcap) * t;
          cap_grad[j] = 1 - t * t;
        }
        if (p.alibi) s -= static_cast<Acc>(alibi_slope(p, b, h)) * static_cast<Acc>(std::abs(query_position(p, b, i) - j));
        if (p.attn_bias) {
          s += static_cast<Acc>(p.attn_bias[b * p.attn_bias_stride[0] + h * p.attn_bias_stride[1] + i * p.attn_bias_stride[2] +
                                       j * p.attn_bias_stride[3]]);
        }
        score[j] = s;
        nan |= std::isnan(s);
        if (s > max) max = s;
        contributes[j] = s != kNegInf;
      }
      if (nan) max = std::numeric_limits<Acc>::quiet_NaN();
      const Acc sink = p.sinks ? static_cast<Acc>(sink_logit(p, h)) : kNegInf;
      if (p.sinks && !nan) max = std::max(max, sink);
      Acc sum = p.sinks ? std::exp(sink - max) : Acc(0);
      for (int64_t j = 0; j < Tk; ++j) sum += contributes[j] ? std::exp(score[j] - max) : Acc(0);
      // dP and D = Σ_j P_d dP_d over the contributing keys.
      Acc Drow = 0;
      for (int64_t j = 0; j < Tk; ++j) {
        if (!contributes[j]) continue;
        prob[j] = std::exp(score[j] - max) / sum;
        Acc dpd = 0;
        for (int64_t d = 0; d < Dv; ++d) dpd += dO(d) * V(j, d);
        const bool kept = !dropout.active() || dropout.keep(b, h, i, j);
        const Acc drop_scale = dropout.active() ? static_cast<Acc>(dropout.scale()) : Acc(1);
        dprob[j] = kept ? dpd * drop_scale : Acc(0);  // dP = dP_d ⊙ Z/(1-p)
        Drow += prob[j] * dprob[j];                    // = Σ P_d dP_d
        const Acc pd = kept ? prob[j] * drop_scale : Acc(0);
        for (int64_t d = 0; d < Dv; ++d) dv[j * Dv + d] += pd * dO(d);
      }
      std::fill(dq.begin(), dq.end(), Acc(0));
      for (int64_t j = 0; j < Tk; ++j) {
        if (!contributes[j]) continue;
        if (g.grad_scores) {
          g.grad_scores[b * g.grad_scores_stride[0] + h * g.grad_scores_stride[1] + i * g.grad_scores_stride[2] +
                        j * g.grad_scores_stride[3]] = static_cast<float>(prob[j] * (dprob[j] - Drow));
        }
        const Acc ds = prob[j] * (dprob[j] - Drow) * cap_grad[j] * static_cast<Acc>(p.scale);
        for (int64_t d = 0; d < D; ++d) {
          dq[d] += ds * K(j, d);
          dk[j * D + d] += ds * Q(d);
        }
      }
      if (p.sinks && g.grad_sinks_by_batch) g.grad_sinks_by_batch[b * p.q_heads + h] -= std::exp(sink - max) / sum * Drow;
      float* gq = static_cast<float*>(g.grad_q) + b * g.grad_q_stride[0] + h * g.grad_q_stride[1] + i * g.grad_q_stride[2];
      for (int64_t d = 0; d < D; ++d) gq[d * g.grad_q_stride[3]] = static_cast<float>(dq[d]);
    }
  }
  for (int64_t j = 0; j < Tk; ++j) {
    float* gk = static_cast<float*>(g.grad_k) + b * g.grad_k_stride[0] + hk * g.grad_k_stride[1] + j * g.grad_k_stride[2];
    float* gv = static_cast<float*>(g.grad_v) + b * g.grad_v_stride[0] + hk * g.grad_v_stride[1] + j * g.grad_v_stride[2];
    for (int64_t d = 0; d < D; ++d) gk[d * g.grad_k_stride[3]] = static_cast<float>(dk[j * D + d]);
    for (int64_t d = 0; d < Dv; ++d) gv[d * g.grad_v_stride[3]] = static_cast<float>(dv[j * Dv + d]);
  }
}

template void attention_bwd_ref_head<double>(const AttentionParams&, const AttentionGradParams&, int64_t, int64_t);
template void attention_bwd_ref_head<float>(const AttentionParams&, const AttentionGradParams&, int64_t, int64_t);

}  // namespace mha::kernels
