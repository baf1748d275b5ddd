// MultiHeadAttention training: gradient buffers, parameters for an optimizer, and backward()
// from a tape recorded by forward(inputs, options, &tape).
#include <algorithm>
#include <optional>

#include "mha/multi_head_attention.h"
#include "modules/multi_head_attention_internal.h"
#include "modules/positional.h"
#include "ops/linear.h"
#include "util/check.h"

namespace mha {

void MhaParamGrads::zero() {
  for (Tensor* t : {&in_weight, &in_bias, &out_weight, &out_bias, &sinks, &q_norm, &k_norm}) {
    if (t->defined()) std::fill(t->data<float>(), t->data<float>() + t->numel(), 0.0f);
  }
}

MhaParamGrads MultiHeadAttention::make_grads() const {
  MhaParamGrads g;
  g.in_weight = Tensor(DType::kF32, in_weight_.shape());
  g.in_bias = Tensor(DType::kF32, in_bias_.shape());
  if (config_.out_proj) {
    g.out_weight = Tensor(DType::kF32, out_weight_.shape());
    g.out_bias = Tensor(DType::kF32, out_bias_.shape());
  }
  if (config_.sinks) g.sinks = Tensor(DType::kF32, sinks_.shape());
  if (config_.qk_norm) {
    g.q_norm = Tensor(DType::kF32, q_norm_.shape());
    g.k_norm = Tensor(DType::kF32, k_norm_.shape());
  }
  g.zero();
  return g;
}

namespace {

void check_grads(const MhaParamGrads& g, const Tensor& in_weight, const Tensor& out_weight, const Tensor& sinks,
                 const Tensor& q_norm) {
  auto same = [](const Tensor& a, const Tensor& b) { return a.defined() == b.defined() && (!a.defined() || a.shape() == b.shape()); };
  MHA_CHECK(g.in_weight.defined() && g.in_weight.shape() == in_weight.shape() && same(g.out_weight, out_weight) &&
                same(g.sinks, sinks) && same(g.q_norm, q_norm) && same(g.k_norm, q_norm),
            "MultiHeadAttention::backward: grads were not made for this module (in_weight {} vs {}); use make_grads()",
            shape_string(g.in_weight.shape().data(), g.in_weight.rank()),
            shape_string(in_weight.shape().data(), in_weight.rank()));
}

}  // namespace

std::vector<Parameter> MultiHeadAttention::parameters(MhaParamGrads* grads) {
  if (grads) check_grads(*grads, in_weight_, out_weight_, sinks_, q_norm_);
  std::vector<Parameter> params;
  const Dims d = dims();
  const char* names[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
  int64_t w_offset = 0, b_offset = 0;
  for (int p = 0; p < 4; ++p) {
    if (p == kOut && !config_.out_proj) continue;
    const View<float> w = weight(static_cast<Proj>(p));
    View<float> gw, gb;
    if (grads) {
      gw = p == kOut ? grads->out_weight.view<float>()
                     : View<float>(grads->in_weight.data<float>() + w_offset, {d.rows[p], d.cols[p]});
      gb = p == kOut ? grads->out_bias.view<float>() : View<float>(grads->in_bias.data<float>() + b_offset, {d.rows[p]});
    }
    params.push_back({std::string(names[p]) + ".weight", w, gw});
    if (has_bias_[p]) params.push_back({std::string(names[p]) + ".bias", bias(static_cast<Proj>(p)), gb});
    if (p < 3) w_offset += d.rows[p] * d.cols[p], b_offset += d.rows[p];
  }
  auto extra = [&](const char* name, Tensor& w, Tensor* g) {
    params.push_back({name, w.view<float>(), grads ? g->view<float>() : View<float>()});
  };
  if (config_.sinks) extra("sinks", sinks_, grads ? &grads->sinks : nullptr);
  if (config_.qk_norm) {
    extra("q_norm.weight", q_norm_, grads ? &grads->q_norm : nullptr);
    extra("k_norm.weight", k_norm_, grads ? &grads->k_norm : nullptr);
  }
  return params;
}

MhaInputGrads MultiHeadAttention::backward(const MhaTape& tape, const View<const float>& grad_output,
                                           MhaParamGrads* grads, const MhaCallOptions& options) const {
  MHA_CHECK(tape.recorded(), "MultiHeadAttention::backward: the tape is empty; record it with forward(inputs, options, &tape)");
  const MhaTape::State& t = *tape.state_;
  MHA_CHECK(t.module == this, "MultiHeadAttention::backward: the tape was recorded by another module");
  MHA_CHECK(grads != nullptr, "MultiHeadAttention::backward: grads must not be null; use make_grads()");
  check_grads(*grads, in_weight_, out_weight_, sinks_, q_norm_);
  MHA_CHECK(grad_output.rank == 3 && std::equal(t.output_shape.begin(), t.output_shape.end(), grad_output.shape.begin()),
            "MultiHeadAttention::backward: grad_output must have the output's shape {}; got {}",
            shape_string(t.output_shape.data(), 3), shape_string(grad_output));
  MHA_CHECK(grad_output.numel() == 0 || grad_output.data, "MultiHeadAttention::backward: grad_output has a null data pointer");

  const auto& c = config_;
  const Dims d = dims();
  const int64_t B = t.B, Tq = t.Tq, Tk = t.Tk, Nq = B * Tq, Nk = B * Tk;
  const int64_t width = output_dim();
  const modules::Layout lq{B, Tq, c.batch_first}, lk{B, Tk, c.batch_first};

  // dL/d(output before dropout): the same draws as the forward's.
  Tensor dy = to_tensor(grad_output);
  if (t.out_dropout > 0) modules::apply_output_dropout(t.out_dropout, t.out_dropout_seed, dy.data<float>(), Nq, width);

  // Output projection.
  Tensor dmerged;
  if (c.out_proj) {
    dmerged = Tensor(DType::kF32, {Nq, c.v_proj_dim});
    ops::linear_backward({t.merged.data<float>(), Nq, c.v_proj_dim, c.v_proj_dim},
                         {out_weight_.data<float>(), d.rows[3], d.cols[3], d.cols[3]}, dy.data<float>(), width,
                         dmerged.data<float>(), c.v_proj_dim, grads->out_weight.data<float>(), d.cols[3],
                         has_bias_[kOut] ? grads->out_bias.data<float>() : nullptr, options.num_threads);
  } else {
    dmerged = std::move(dy);
  }

  // Attention, with the forward's inputs rebuilt from the tape; the gradients of the projections
  // take the projections' layout (self-attention always runs on the packed projection).
  const bool packed_self = t.self;
  const int64_t W = d.rows[0] + d.rows[1] + d.rows[2];
  Tensor dqkv, dk, dv;
  if (packed_self) {
    dqkv = Tensor(DType::kF32, {Nq, W});
  } else {
    dqkv = Tensor(DType::kF32, {Nq, d.rows[0]});
    dk = Tensor(DType::kF32, {Nk, d.rows[1]});
    dv = Tensor(DType::kF32, {Nk, d.rows[2]});
  }
  auto data = [](const Tensor& x) { return x.defined() ? const_cast<float*>(x.data<float>()) : nullptr; };
  const modules::QkvHeads heads = modules::qkv_heads(c, data(t.qkv), data(t.kbuf), data(t.vbuf), lq, lk);
  const modules::QkvHeads grad_heads = modules::qkv_heads(c, data(dqkv), data(dk), data(dv), lq, lk);
  AttentionInputs ai;
  const int64_t dqk = head_dim_qk(), Hk = c.num_kv_heads;
  // With QK-norm the projections hold q and k before it: what the forward's attention read is
  // recomputed (the same transform, the same bits).
  std::optional<modules::NormalizedQk> normed;
  ai.query = heads.q;
  ai.key = heads.k;
  if (c.qk_norm) {
    normed.emplace(lq, lk, c.num_heads, Hk, dqk);
    transform_qk(heads.q, heads.k, normed->q, normed->k, t.q_first, std::vector<int64_t>(static_cast<size_t>(B), 0),
                 options.num_threads);
    ai.query = normed->q;
    ai.key = normed->k;
  }
  ai.value = heads.v;
  ai.keep_mask = modules::view_or_empty<uint8_t>(t.keep);
  ai.attn_bias = modules::view_or_empty<float>(t.bias);
  ai.key_lengths = modules::view_or_empty<int64_t>(t.lengths);
  score_inputs(ai);
  const int64_t Hq = c.num_heads, dh = head_dim_v();
  const View<const float> out_heads = modules::heads_view(data(t.merged), lq, c.v_proj_dim, Hq, dh);
  const View<const float> dout_heads = modules::heads_view(dmerged.data<float>(), lq, c.v_proj_dim, Hq, dh);
  AttentionOptions attention_options = t.options;  // the forward's masking and dropout draws
  attention_options.num_threads = options.num_threads;
  attention_options.backend = options.backend;
  Tensor dsinks = c.sinks ? Tensor(DType::kF32, {Hq}) : Tensor();
  attention_backward(ai, out_heads, t.lse.view<float>(), dout_heads,
                     {grad_heads.q, grad_heads.k, grad_heads.v, c.sinks ? dsinks.view<float>() : View<float>(), View<float>()},
                     attention_options);
  if (c.sinks) {
    for (int64_t h = 0; h < Hq; ++h) grads->sinks.data<float>()[h] += dsinks.data<float>()[h];
  }
  // Back through rotary (a rotation: its transpose) and QK-norm, to the projections' outputs.
  const modules::RotaryFreqs f = modules::rotary_freqs(c.rotary);
  const float* qw = c.qk_norm ? q_norm_.data<float>() : nullptr;
  const float* kw = c.qk_norm ? k_norm_.data<float>() : nullptr;
  modules::transform_qk_backward(f, c.qk_norm_eps, {heads.q, grad_heads.q, qw, qw ? grads->q_norm.data<float>() : nullptr},
                                 t.q_first, {heads.k, grad_heads.k, kw, kw ? grads->k_norm.data<float>() : nullptr},
                                 std::vector<int64_t>(static_cast<size_t>(B), 0), options.num_threads);

  // Input projections.
  MhaInputGrads result;
  result.query = Tensor(DType::kF32, t.query_shape);
  if (packed_self) {
    ops::linear_backward({t.xq.data<float>(), Nq, c.embed_dim, c.embed_dim}, {in_weight_.data<float>(), W, c.embed_dim, c.embed_dim},
                         dqkv.data<float>(), W, result.query.data<float>(), c.embed_dim, grads->in_weight.data<float>(), c.embed_dim,
                         grads->in_bias.data<float>(), options.num_threads);
    // Projections without a bias have no bias gradient.
    int64_t offset = 0;
    for (int p = 0; p < 3; ++p) {
      if (!has_bias_[p]) std::fill(grads->in_bias.data<float>() + offset, grads->in_bias.data<float>() + offset + d.rows[p], 0.0f);
      offset += d.rows[p];
    }
    return result;
  }
  result.key = Tensor(DType::kF32, t.key_shape);
  result.value = Tensor(DType::kF32, t.value_shape);
  const float* x[3] = {t.xq.data<float>(), t.xk.data<float>(), t.xv.data<float>()};
  const float* dproj[3] = {dqkv.data<float>(), dk.data<float>(), dv.data<float>()};
  float* dx[3] = {result.query.data<float>(), result.key.data<float>(), result.value.data<float>()};
  const int64_t rows[3] = {Nq, Nk, Nk};
  int64_t w_offset = 0, b_offset = 0;
  for (int p = 0; p < 3; ++p) {
    ops::linear_backward({x[p], rows[p], d.cols[p], d.cols[p]}, {in_weight_.data<float>() + w_offset, d.rows[p], d.cols[p], d.cols[p]},
                         dproj[p], d.rows[p], dx[p], d.cols[p], grads->in_weight.data<float>() + w_offset, d.cols[p],
                         has_bias_[p] ? grads->in_bias.data<float>() + b_offset : nullptr, options.num_threads);
    w_offset += d.rows[p] * d.cols[p];
    b_offset += d.rows[p];
  }
  return result;
}

}  // namespace mha
