#include "tiny_gpt/tiny_gpt.h"

#include <algorithm>
#include <chrono>
#include <cmath>

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

float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x))); }

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
    blk.attn.set_num_threads(c.num_threads);
    blocks_.push_back(std::move(blk));
  }
}

int64_t TinyGpt::parameters() const {
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
    a_out = blk.attn.step(x, *cache).output;
  } else {
    MhaInputs in;
    in.query = x;
    a_out = blk.attn.forward(in).output;
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
                                       double* decode_seconds) const {
  std::vector<KvCache> caches;
  for (const Block& blk : blocks_) caches.push_back(blk.attn.make_cache(1, static_cast<int64_t>(prompt.size()) + n));
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
  return out;
}

}  // namespace mha::examples
