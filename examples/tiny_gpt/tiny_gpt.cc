#include "tiny_gpt/tiny_gpt.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "mha/linear.h"

namespace mha::examples {
namespace {

// splitmix64 → U(-a, a), so that weights are the same on every platform.
float uniform(uint64_t seed, uint64_t i, float a) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<float>(z >> 40) / 16777216.0f * 2.0f - 1.0f) * a;
}

Tensor filled(std::vector<int64_t> shape, uint64_t seed, float a) {
  Tensor t(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = uniform(seed, static_cast<uint64_t>(i), a);
  return t;
}

Tensor constant(std::vector<int64_t> shape, float value) {
  Tensor t(DType::kF32, std::move(shape));
  std::fill(t.data<float>(), t.data<float>() + t.numel(), value);
  return t;
}

// LayerNorm over the last dim of x (rows, dim), eps 1e-5.
Tensor layer_norm(const Tensor& x, const Tensor& g, const Tensor& b) {
  const int64_t rows = x.shape()[0], dim = x.shape()[1];
  Tensor y(DType::kF32, {rows, dim});
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data<float>() + r * dim;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < dim; ++i) mean += xr[i];
    mean /= static_cast<double>(dim);
    for (int64_t i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float inv = static_cast<float>(1.0 / std::sqrt(var / static_cast<double>(dim) + 1e-5));
    for (int64_t i = 0; i < dim; ++i)
      y.data<float>()[r * dim + i] = (xr[i] - static_cast<float>(mean)) * inv * g.data<float>()[i] + b.data<float>()[i];
  }
  return y;
}

// d layer_norm(x)/dx applied to dy, added to dx; dg and db accumulate. The row statistics are
// recomputed from x in double as the forward computes them.
void layer_norm_backward(const Tensor& x, const Tensor& g, const Tensor& dy, Tensor& dx, Tensor& dg, Tensor& db) {
  const int64_t rows = x.shape()[0], dim = x.shape()[1];
  std::vector<float> xhat(static_cast<size_t>(dim)), dxhat(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data<float>() + r * dim;
    const float* dyr = dy.data<float>() + r * dim;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < dim; ++i) mean += xr[i];
    mean /= static_cast<double>(dim);
    for (int64_t i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float inv = static_cast<float>(1.0 / std::sqrt(var / static_cast<double>(dim) + 1e-5));
    double mean_dxhat = 0, mean_dxhat_xhat = 0;
    for (int64_t i = 0; i < dim; ++i) {
      xhat[i] = (xr[i] - static_cast<float>(mean)) * inv;
      dxhat[i] = dyr[i] * g.data<float>()[i];
      mean_dxhat += dxhat[i];
      mean_dxhat_xhat += static_cast<double>(dxhat[i]) * xhat[i];
      dg.data<float>()[i] += dyr[i] * xhat[i];
      db.data<float>()[i] += dyr[i];
    }
    mean_dxhat /= static_cast<double>(dim);
    mean_dxhat_xhat /= static_cast<double>(dim);
    float* dxr = dx.data<float>() + r * dim;
    for (int64_t i = 0; i < dim; ++i)
      dxr[i] += inv * (dxhat[i] - static_cast<float>(mean_dxhat) - xhat[i] * static_cast<float>(mean_dxhat_xhat));
  }
}

constexpr float kGeluC = 0.7978845608f;  // sqrt(2/pi)

float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(kGeluC * (x + 0.044715f * x * x * x))); }

float gelu_grad(float x) {
  const float t = std::tanh(kGeluC * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * 0.044715f * x * x);
}

Tensor zeros_like(const Tensor& t) { return Tensor(DType::kF32, t.shape()); }

void add_into(Tensor& dst, const Tensor& src) {
  for (int64_t i = 0; i < dst.numel(); ++i) dst.data<float>()[i] += src.data<float>()[i];
}

}  // namespace

TinyGpt::TinyGpt(const TinyGptConfig& config) : config_(config) {
  const auto& c = config_;
  uint64_t seed = c.seed * 1000;
  tok_emb_ = filled({c.vocab, c.dim}, ++seed, 0.5f);
  pos_emb_ = filled({c.max_len, c.dim}, ++seed, 0.1f);
  lnf_g_ = constant({c.dim}, 1.0f);
  lnf_b_ = constant({c.dim}, 0.0f);
  for (int64_t l = 0; l < c.layers; ++l) {
    MultiHeadAttentionConfig a;
    a.embed_dim = c.dim;
    a.num_heads = c.heads;
    a.num_kv_heads = c.kv_heads;
    a.causal = Causal::kTopLeft;
    a.max_seq_len = c.max_len;
    Block blk{constant({c.dim}, 1.0f), constant({c.dim}, 0.0f), constant({c.dim}, 1.0f), constant({c.dim}, 0.0f),
              MultiHeadAttention(a, ++seed),
              filled({c.hidden, c.dim}, ++seed, 1.0f / std::sqrt(static_cast<float>(c.dim))), constant({c.hidden}, 0.0f),
              filled({c.dim, c.hidden}, ++seed, 1.0f / std::sqrt(static_cast<float>(c.hidden))), constant({c.dim}, 0.0f)};
    g_blocks_.push_back({zeros_like(blk.ln1_g), zeros_like(blk.ln1_b), zeros_like(blk.ln2_g), zeros_like(blk.ln2_b),
                         blk.attn.make_grads(), zeros_like(blk.fc1_w), zeros_like(blk.fc1_b), zeros_like(blk.fc2_w),
                         zeros_like(blk.fc2_b)});
    blocks_.push_back(std::move(blk));
  }
  g_tok_emb_ = zeros_like(tok_emb_);
  g_pos_emb_ = zeros_like(pos_emb_);
  g_lnf_g_ = zeros_like(lnf_g_);
  g_lnf_b_ = zeros_like(lnf_b_);
}

std::vector<Parameter> TinyGpt::parameters() {
  std::vector<Parameter> params;
  auto add = [&](const std::string& name, Tensor& value, Tensor& grad) {
    params.push_back({name, value.view<float>(), grad.view<float>()});
  };
  add("tok_emb", tok_emb_, g_tok_emb_);
  add("pos_emb", pos_emb_, g_pos_emb_);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    Block& b = blocks_[l];
    BlockGrads& g = g_blocks_[l];
    const std::string p = "blocks." + std::to_string(l) + ".";
    add(p + "ln1.weight", b.ln1_g, g.ln1_g);
    add(p + "ln1.bias", b.ln1_b, g.ln1_b);
    for (Parameter& a : b.attn.parameters(&g.attn)) {
      a.name = p + "attn." + a.name;
      params.push_back(std::move(a));
    }
    add(p + "ln2.weight", b.ln2_g, g.ln2_g);
    add(p + "ln2.bias", b.ln2_b, g.ln2_b);
    add(p + "fc1.weight", b.fc1_w, g.fc1_w);
    add(p + "fc1.bias", b.fc1_b, g.fc1_b);
    add(p + "fc2.weight", b.fc2_w, g.fc2_w);
    add(p + "fc2.bias", b.fc2_b, g.fc2_b);
  }
  add("ln_f.weight", lnf_g_, g_lnf_g_);
  add("ln_f.bias", lnf_b_, g_lnf_b_);
  return params;
}

void TinyGpt::zero_grad() { mha::zero_grad(parameters()); }

TinyGpt::StepResult TinyGpt::forward_backward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                                              int64_t B, int64_t T) {
  const auto& c = config_;
  const int64_t N = B * T, dim = c.dim;
  if (static_cast<int64_t>(tokens.size()) != N || static_cast<int64_t>(targets.size()) != N || T > c.max_len) {
    throw Error("TinyGpt: " + std::to_string(tokens.size()) + " tokens and " + std::to_string(targets.size()) +
                " targets for B = " + std::to_string(B) + ", T = " + std::to_string(T) + " (max_len " +
                std::to_string(c.max_len) + ")");
  }
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab || targets[i] >= c.vocab) {
      throw Error("TinyGpt: token " + std::to_string(tokens[i]) + " or target " + std::to_string(targets[i]) +
                  " outside the vocabulary of " + std::to_string(c.vocab));
    }
  }

  // Forward, keeping what the backward needs.
  struct Saved {
    Tensor h_in, ln1, h_mid, ln2, pre, act;
    MhaTape tape;
  };
  std::vector<Saved> saved(blocks_.size());
  Tensor h = embed(tokens, B, T, 0);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block& blk = blocks_[l];
    Saved& s = saved[l];
    s.h_in = h.clone();
    s.ln1 = layer_norm(h, blk.ln1_g, blk.ln1_b);
    MhaInputs in;
    in.query = View<const float>(s.ln1.data<float>(), {B, T, dim});
    const Tensor a_out = blk.attn.forward(in, attn_options(/*training=*/true), &s.tape).output;
    add_into(h, a_out);
    s.h_mid = h.clone();
    s.ln2 = layer_norm(h, blk.ln2_g, blk.ln2_b);
    s.pre = Tensor(DType::kF32, {N, c.hidden});
    linear(s.ln2.view<float>(), blk.fc1_w.view<float>(), blk.fc1_b.view<float>(), s.pre.view<float>(), c.num_threads);
    s.act = Tensor(DType::kF32, {N, c.hidden});
    for (int64_t i = 0; i < s.act.numel(); ++i) s.act.data<float>()[i] = gelu(s.pre.data<float>()[i]);
    Tensor m_out(DType::kF32, {N, dim});
    linear(s.act.view<float>(), blk.fc2_w.view<float>(), blk.fc2_b.view<float>(), m_out.view<float>(), c.num_threads);
    add_into(h, m_out);
  }
  const Tensor xf = layer_norm(h, lnf_g_, lnf_b_);
  Tensor lg(DType::kF32, {N, c.vocab});
  linear(xf.view<float>(), tok_emb_.view<float>(), {}, lg.view<float>(), c.num_threads);

  // Cross-entropy over the counted positions; dlogits = (softmax - onehot) / counted.
  StepResult result;
  for (int64_t i = 0; i < N; ++i) result.counted += targets[i] >= 0;
  Tensor dlg(DType::kF32, {N, c.vocab});
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] < 0) continue;
    const float* row = lg.data<float>() + i * c.vocab;
    const int64_t best = std::max_element(row, row + c.vocab) - row;
    result.correct += best == targets[i];
    double sum = 0;
    for (int64_t v = 0; v < c.vocab; ++v) sum += std::exp(static_cast<double>(row[v] - row[best]));
    const double log_z = row[best] + std::log(sum);
    result.loss += log_z - row[targets[i]];
    float* d = dlg.data<float>() + i * c.vocab;
    for (int64_t v = 0; v < c.vocab; ++v)
      d[v] = static_cast<float>((std::exp(row[v] - log_z) - (v == targets[i])) / static_cast<double>(result.counted));
  }
  if (result.counted > 0) result.loss /= static_cast<double>(result.counted);

  // Backward. The head is tied to the token embedding.
  Tensor dxf(DType::kF32, {N, dim});
  linear_backward(xf.view<float>(), tok_emb_.view<float>(), dlg.view<float>(), dxf.view<float>(),
                  g_tok_emb_.view<float>(), {}, c.num_threads);
  Tensor dh(DType::kF32, {N, dim});
  layer_norm_backward(h, lnf_g_, dxf, dh, g_lnf_g_, g_lnf_b_);
  for (size_t l = blocks_.size(); l-- > 0;) {
    const Block& blk = blocks_[l];
    BlockGrads& g = g_blocks_[l];
    Saved& s = saved[l];
    // h_out = h_mid + fc2(gelu(fc1(ln2(h_mid))))
    Tensor dact(DType::kF32, {N, c.hidden});
    linear_backward(s.act.view<float>(), blk.fc2_w.view<float>(), dh.view<float>(), dact.view<float>(),
                    g.fc2_w.view<float>(), g.fc2_b.view<float>(), c.num_threads);
    for (int64_t i = 0; i < dact.numel(); ++i) dact.data<float>()[i] *= gelu_grad(s.pre.data<float>()[i]);
    Tensor dln2(DType::kF32, {N, dim});
    linear_backward(s.ln2.view<float>(), blk.fc1_w.view<float>(), dact.view<float>(), dln2.view<float>(),
                    g.fc1_w.view<float>(), g.fc1_b.view<float>(), c.num_threads);
    layer_norm_backward(s.h_mid, blk.ln2_g, dln2, dh, g.ln2_g, g.ln2_b);
    // h_mid = h_in + attention(ln1(h_in))
    const MhaInputGrads ig = blk.attn.backward(s.tape, View<const float>(dh.data<float>(), {B, T, dim}), &g.attn,
                                                 attn_options(true));
    layer_norm_backward(s.h_in, blk.ln1_g, ig.query.reshaped({N, dim}), dh, g.ln1_g, g.ln1_b);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* d = dh.data<float>() + (b * T + t) * dim;
      float* gt = g_tok_emb_.data<float>() + tokens[b * T + t] * dim;
      float* gp = g_pos_emb_.data<float>() + t * dim;
      for (int64_t i = 0; i < dim; ++i) gt[i] += d[i], gp[i] += d[i];
    }
  return result;
}

int64_t TinyGpt::parameter_count() const {
  int64_t n = tok_emb_.numel() + pos_emb_.numel() + 2 * config_.dim;
  for (const Block& b : blocks_) {
    n += 4 * config_.dim + b.fc1_w.numel() + b.fc1_b.numel() + b.fc2_w.numel() + b.fc2_b.numel();
    for (auto p : {MultiHeadAttention::kQ, MultiHeadAttention::kK, MultiHeadAttention::kV, MultiHeadAttention::kOut})
      n += b.attn.weight(p).numel() + b.attn.bias(p).numel();
  }
  return n;
}

Tensor TinyGpt::embed(const std::vector<int32_t>& tokens, int64_t B, int64_t T, int64_t first_position) const {
  const int64_t dim = config_.dim;
  Tensor h(DType::kF32, {B * T, dim});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int32_t tok = tokens[b * T + t];
      float* row = h.data<float>() + (b * T + t) * dim;
      for (int64_t i = 0; i < dim; ++i)
        row[i] = tok_emb_.data<float>()[tok * dim + i] + pos_emb_.data<float>()[(first_position + t) * dim + i];
    }
  return h;
}

void TinyGpt::block(const Block& blk, Tensor& h, int64_t B, int64_t T, KvCache* cache) const {
  const int64_t dim = config_.dim, rows = B * T;
  const Tensor a_in = layer_norm(h, blk.ln1_g, blk.ln1_b);
  const View<const float> x(a_in.data<float>(), {B, T, dim});
  Tensor a_out;
  if (cache) {
    a_out = blk.attn.step(x, *cache, {}, attn_options(false)).output;
  } else {
    MhaInputs in;
    in.query = x;
    a_out = blk.attn.forward(in, attn_options(false)).output;
  }
  for (int64_t i = 0; i < rows * dim; ++i) h.data<float>()[i] += a_out.data<float>()[i];
  const Tensor m_in = layer_norm(h, blk.ln2_g, blk.ln2_b);
  Tensor mid(DType::kF32, {rows, config_.hidden});
  linear(m_in.view<float>(), blk.fc1_w.view<float>(), blk.fc1_b.view<float>(), mid.view<float>(), config_.num_threads);
  for (int64_t i = 0; i < mid.numel(); ++i) mid.data<float>()[i] = gelu(mid.data<float>()[i]);
  Tensor m_out(DType::kF32, {rows, dim});
  linear(mid.view<float>(), blk.fc2_w.view<float>(), blk.fc2_b.view<float>(), m_out.view<float>(), config_.num_threads);
  for (int64_t i = 0; i < rows * dim; ++i) h.data<float>()[i] += m_out.data<float>()[i];
}

Tensor TinyGpt::logits(const Tensor& h) const {
  const Tensor x = layer_norm(h, lnf_g_, lnf_b_);
  Tensor out(DType::kF32, {x.shape()[0], config_.vocab});
  linear(x.view<float>(), tok_emb_.view<float>(), {}, out.view<float>(), config_.num_threads);
  return out;
}

Tensor TinyGpt::forward(const std::vector<int32_t>& tokens, int64_t B, int64_t T) const {
  Tensor h = embed(tokens, B, T, 0);
  for (const Block& blk : blocks_) block(blk, h, B, T, nullptr);
  return logits(h).reshaped({B, T, config_.vocab});
}

std::vector<int32_t> TinyGpt::generate(const std::vector<int32_t>& prompt, int64_t n, double* prefill_seconds,
                                       double* decode_seconds, CacheType cache_type, int64_t* cache_bytes) const {
  std::vector<KvCache> caches;
  for (const Block& blk : blocks_)
    caches.push_back(blk.attn.make_cache(1, static_cast<int64_t>(prompt.size()) + n, cache_type));
  auto argmax_last = [&](const Tensor& lg) {
    const float* row = lg.data<float>() + (lg.shape()[0] - 1) * config_.vocab;
    return static_cast<int32_t>(std::max_element(row, row + config_.vocab) - row);
  };
  auto run = [&](const std::vector<int32_t>& tokens, int64_t position) {
    Tensor h = embed(tokens, 1, static_cast<int64_t>(tokens.size()), position);
    for (size_t l = 0; l < blocks_.size(); ++l) block(blocks_[l], h, 1, static_cast<int64_t>(tokens.size()), &caches[l]);
    return argmax_last(logits(h));
  };
  std::vector<int32_t> out;
  auto start = std::chrono::steady_clock::now();
  int32_t next = run(prompt, 0);
  if (prefill_seconds) *prefill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(next);
    if (i + 1 < n) next = run({next}, static_cast<int64_t>(prompt.size()) + i);
  }
  if (decode_seconds) *decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (cache_bytes) {
    *cache_bytes = 0;
    for (const KvCache& kc : caches) *cache_bytes += kc.nbytes();
  }
  return out;
}

}  // namespace mha::examples
