// MultiHeadAttention: configuration, weights (initialisation) and forward. Loading and saving
// weights by name is in multi_head_attention_weights.cc, training in
// multi_head_attention_backward.cc, decoding in multi_head_attention_step.cc.
#include "mha/multi_head_attention.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>

#include "kernels/cpu/linear_rows.h"
#include "modules/multi_head_attention_internal.h"
#include "modules/positional.h"
#include "ops/linear.h"
#include "util/check.h"
#include "util/convert.h"
#include "util/fp16.h"
#include "util/random.h"

namespace mha {
namespace {

// x rounded to a weight dtype's precision (float32: unchanged).
float round_to(DType t, float x) {
  switch (t) {
    case DType::kBF16: return bf16_to_float(float_to_bf16(x));
    case DType::kF16: return half_to_float(float_to_half(x));
    default: return x;
  }
}

void store_as(DType t, void* base, int64_t i, float x) {
  switch (t) {
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_half(x); break;
    default: static_cast<float*>(base)[i] = x; break;
  }
}

}  // namespace

MultiHeadAttentionConfig resolve_config(const MultiHeadAttentionConfig& in) {
  MultiHeadAttentionConfig c = in;
  MHA_CHECK(c.embed_dim > 0, "MultiHeadAttention: embed_dim must be positive; got {}", c.embed_dim);
  MHA_CHECK(c.num_heads > 0, "MultiHeadAttention: num_heads must be positive; got {}", c.num_heads);
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.vdim == 0) c.vdim = c.embed_dim;
  if (c.qk_proj_dim == 0) c.qk_proj_dim = c.embed_dim;
  if (c.v_proj_dim == 0) c.v_proj_dim = c.embed_dim;
  if (c.out_dim == 0) c.out_dim = c.embed_dim;
  for (auto [value, name] : {std::pair{c.num_kv_heads, "num_kv_heads"}, {c.kdim, "kdim"}, {c.vdim, "vdim"},
                             {c.qk_proj_dim, "qk_proj_dim"}, {c.v_proj_dim, "v_proj_dim"}, {c.out_dim, "out_dim"}}) {
    MHA_CHECK(value > 0, "MultiHeadAttention: {} must be positive; got {}", name, value);
  }
  MHA_CHECK(c.qk_proj_dim % c.num_heads == 0,
            "MultiHeadAttention: qk_proj_dim (embed_dim by default) = {} is not divisible by num_heads = {}", c.qk_proj_dim,
            c.num_heads);
  MHA_CHECK(c.v_proj_dim % c.num_heads == 0,
            "MultiHeadAttention: v_proj_dim (embed_dim by default) = {} is not divisible by num_heads = {}", c.v_proj_dim,
            c.num_heads);
  MHA_CHECK(c.num_heads % c.num_kv_heads == 0,
            "MultiHeadAttention: num_kv_heads = {} does not divide num_heads = {}", c.num_kv_heads, c.num_heads);
  MHA_CHECK(c.attn_dropout >= 0 && c.attn_dropout <= 1, "MultiHeadAttention: attn_dropout must be in [0, 1]; got {}",
            c.attn_dropout);
  MHA_CHECK(c.out_dropout >= 0 && c.out_dropout <= 1, "MultiHeadAttention: out_dropout must be in [0, 1]; got {}",
            c.out_dropout);
  MHA_CHECK(c.max_seq_len >= 0, "MultiHeadAttention: max_seq_len must be >= 0; got {}", c.max_seq_len);
  MHA_CHECK(c.window >= 0, "MultiHeadAttention: window must be >= 0; got {}", c.window);
  MHA_CHECK(c.window == 0 || c.causal != Causal::kNone, "MultiHeadAttention: a sliding window (window = {}) needs causal",
            c.window);
  MHA_CHECK(c.sink_tokens >= 0 && (c.sink_tokens == 0 || c.window > 0),
            "MultiHeadAttention: sink_tokens = {} keep the first positions past a sliding window; they need window > 0 "
            "(window = {})", c.sink_tokens, c.window);
  MHA_CHECK(c.sink_tokens == 0 || !c.alibi,
            "MultiHeadAttention: sink_tokens with alibi are not supported (a cache holds the sinks apart from the "
            "window, and ALiBi would measure the distance across the gap)");
  MHA_CHECK(std::isfinite(c.softcap) && c.softcap >= 0.0f,
            "MultiHeadAttention: softcap must be finite and >= 0 (0 turns it off); got {}", c.softcap);
  modules::check_rotary(c.rotary, c.qk_proj_dim / c.num_heads);
  MHA_CHECK(std::isfinite(c.qk_norm_eps) && c.qk_norm_eps > 0.0f, "MultiHeadAttention: qk_norm_eps must be > 0; got {}",
            c.qk_norm_eps);
  MHA_CHECK(c.dtype == DType::kF32 || c.dtype == DType::kBF16 || c.dtype == DType::kF16,
            "MultiHeadAttention: dtype must be F32, BF16 or F16; got {}", dtype_name(c.dtype));
  return c;
}

MultiHeadAttention::Dims MultiHeadAttention::dims() const {
  const auto& c = config_;
  const std::array<int64_t, 3> rows = modules::qkv_rows(c);
  return {{rows[0], rows[1], rows[2], c.out_dim}, {c.embed_dim, c.kdim, c.vdim, c.v_proj_dim}};
}

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config, uint64_t seed)
    : config_(resolve_config(config)), seed_(seed) {
  const Dims d = dims();
  int64_t in_weights = 0, in_rows = 0;  // sizes checked: a huge config is an error, not overflow
  for (int p = 0; p < 3; ++p) {
    in_weights = checked_add(in_weights, checked_mul(d.rows[p], d.cols[p], "MultiHeadAttention: weight elements"),
                             "MultiHeadAttention: weight elements");
    in_rows = checked_add(in_rows, d.rows[p], "MultiHeadAttention: projection rows");
  }
  try {
    in_weight_ = Tensor(config_.dtype, {in_weights});
  } catch (const Error& e) {
    throw Error(std::string("MultiHeadAttention: the q/k/v weights: ") + e.what());
  }
  in_bias_ = Tensor(DType::kF32, {in_rows});
  if (config_.out_proj) {
    out_weight_ = Tensor(config_.dtype, {d.rows[3], d.cols[3]});
    out_bias_ = Tensor(DType::kF32, {d.rows[3]});
  }
  for (int p = 0; p < 4; ++p) has_bias_[p] = config_.bias && (p < 3 || config_.out_proj);
  if (config_.alibi) {
    const std::vector<float> s = modules::alibi_slopes(config_.num_heads);
    alibi_slopes_ = Tensor(DType::kF32, {config_.num_heads});
    std::copy(s.begin(), s.end(), alibi_slopes_.data<float>());
  }
  if (config_.sinks) {
    sinks_ = Tensor(DType::kF32, {config_.num_heads});
    std::fill(sinks_.data<float>(), sinks_.data<float>() + config_.num_heads, 0.0f);
  }
  if (config_.qk_norm) {
    for (Tensor* w : {&q_norm_, &k_norm_}) {
      *w = Tensor(DType::kF32, {head_dim_qk()});
      std::fill(w->data<float>(), w->data<float>() + head_dim_qk(), 1.0f);
    }
  }
  // nn.Linear's default initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias (the
  // same float32 draws for every dtype, rounded to it; biases hold values of the dtype).
  uint64_t index = 0;
  const DType t = config_.dtype;
  for (int p = 0; p < 4; ++p) {
    if (p == kOut && !config_.out_proj) continue;
    const float a = 1.0f / std::sqrt(static_cast<float>(d.cols[p]));
    void* w = weight_data(static_cast<Proj>(p));
    for (int64_t i = 0; i < d.rows[p] * d.cols[p]; ++i) store_as(t, w, i, uniform_pm(seed, index++, a));
    if (has_bias_[p]) {
      View<float> b = bias(static_cast<Proj>(p));
      for (int64_t i = 0; i < b.numel(); ++i) b.data[i] = round_to(t, uniform_pm(seed, index++, a));
    }
  }
}

MultiHeadAttention::MultiHeadAttention(MultiHeadAttention&& other) noexcept
    : config_(other.config_),
      in_weight_(std::move(other.in_weight_)),
      in_bias_(std::move(other.in_bias_)),
      out_weight_(std::move(other.out_weight_)),
      out_bias_(std::move(other.out_bias_)),
      alibi_slopes_(std::move(other.alibi_slopes_)),
      sinks_(std::move(other.sinks_)),
      q_norm_(std::move(other.q_norm_)),
      k_norm_(std::move(other.k_norm_)),
      seed_(other.seed_),
      calls_(other.calls_.load()) {
  std::copy(other.has_bias_, other.has_bias_ + 4, has_bias_);
}

void MultiHeadAttention::check_proj(Proj p) const {
  MHA_CHECK(p >= kQ && p <= kOut, "MultiHeadAttention: projection {} is not one of kQ, kK, kV, kOut (0..3)",
            static_cast<int>(p));
}

void* MultiHeadAttention::weight_data(Proj p) {
  check_proj(p);
  if (p == kOut) {
    MHA_CHECK(config_.out_proj, "MultiHeadAttention: this module has no output projection");
    return out_weight_.raw();
  }
  const Dims d = dims();
  int64_t offset = 0;
  for (int i = 0; i < p; ++i) offset += d.rows[i] * d.cols[i];
  return static_cast<std::byte*>(in_weight_.raw()) + offset * static_cast<int64_t>(dtype_size(config_.dtype));
}

const void* MultiHeadAttention::weight_data(Proj p) const {
  return const_cast<MultiHeadAttention*>(this)->weight_data(p);
}

View<float> MultiHeadAttention::weight(Proj p) {
  check_proj(p);
  MHA_CHECK(config_.dtype == DType::kF32,
            "MultiHeadAttention::weight: this module stores {} weights; weight() gives float32 views (read them "
            "through state_dict())",
            dtype_name(config_.dtype));
  const Dims d = dims();
  return View<float>(static_cast<float*>(weight_data(p)), {d.rows[p], d.cols[p]});
}

View<const float> MultiHeadAttention::weight(Proj p) const {
  return const_cast<MultiHeadAttention*>(this)->weight(p);
}

View<float> MultiHeadAttention::bias(Proj p) {
  check_proj(p);
  if (!has_bias_[p]) return {};
  if (p == kOut) return out_bias_.view<float>();
  const Dims d = dims();
  int64_t offset = 0;
  for (int i = 0; i < p; ++i) offset += d.rows[i];
  return View<float>(in_bias_.data<float>() + offset, {d.rows[p]});
}

View<const float> MultiHeadAttention::bias(Proj p) const {
  return const_cast<MultiHeadAttention*>(this)->bias(p);
}

View<float> MultiHeadAttention::sinks() {
  MHA_CHECK(config_.sinks, "MultiHeadAttention::sinks: this module has no sinks (config.sinks is false)");
  return sinks_.view<float>();
}
View<float> MultiHeadAttention::q_norm_weight() {
  MHA_CHECK(config_.qk_norm, "MultiHeadAttention::q_norm_weight: this module has no QK-norm (config.qk_norm is false)");
  return q_norm_.view<float>();
}
View<float> MultiHeadAttention::k_norm_weight() {
  MHA_CHECK(config_.qk_norm, "MultiHeadAttention::k_norm_weight: this module has no QK-norm (config.qk_norm is false)");
  return k_norm_.view<float>();
}
View<const float> MultiHeadAttention::alibi_slopes() const {
  MHA_CHECK(config_.alibi, "MultiHeadAttention::alibi_slopes: this module has no ALiBi (config.alibi is false)");
  return alibi_slopes_.view<float>();
}

// ---------------------------------------------------------------------------------------------
// Forward.

void MultiHeadAttention::transform_qk(const View<float>& q, const View<float>& k, const View<float>& q_out,
                                      const View<float>& k_out, const std::vector<int64_t>& q_first,
                                      const std::vector<int64_t>& k_first, int num_threads) const {
  const auto& c = config_;
  const modules::RotaryFreqs f = modules::rotary_freqs(c.rotary);
  const float* qw = c.qk_norm ? q_norm_.data<float>() : nullptr;
  const float* kw = c.qk_norm ? k_norm_.data<float>() : nullptr;
  modules::transform_qk(f, c.qk_norm_eps, {q, q_out, qw}, q_first, {k, k_out, kw}, k_first, num_threads);
}

void MultiHeadAttention::score_inputs(AttentionInputs& in) const {
  if (config_.alibi) in.alibi_slopes = alibi_slopes_.view<float>();
  if (config_.sinks) in.sinks = sinks_.view<float>();
}

namespace {

// keep_mask AND NOT key_padding_mask as one (B, Hm, Tq, Tk) mask, Hm the mask's head count
// (1 without keep_mask). key_padding_mask is (B, Tk), nonzero = padding.
Tensor combined_keep_mask(const View<const uint8_t>& m, const View<const uint8_t>& kpm, int64_t B, int64_t Hq,
                          int64_t Tq, int64_t Tk) {
  MHA_CHECK(kpm.rank == 2 && kpm.shape[0] == B && kpm.shape[1] == Tk,
            "MultiHeadAttention: key_padding_mask must be (B, Tk) = ({}, {}); got {}", B, Tk, shape_string(kpm));
  MHA_CHECK(kpm.numel() == 0 || kpm.data, "MultiHeadAttention: key_padding_mask has a null data pointer");
  if (!m.given()) {
    Tensor keep(DType::kU8, {B, 1, 1, Tk});
    uint8_t* k = keep.data<uint8_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < Tk; ++j) k[b * Tk + j] = kpm.at(b, j) == 0;
    return keep;
  }
  const int64_t target[4] = {B, Hq, Tq, Tk};
  MHA_CHECK(m.rank >= 1 && m.rank <= 4, "MultiHeadAttention: keep_mask must have 1 to 4 dimensions; got {}",
            shape_string(m));
  int64_t mshape[4] = {1, 1, 1, 1}, mstride[4] = {0, 0, 0, 0};
  for (int i = 0; i < m.rank; ++i) {
    const int a = 4 - m.rank + i;
    MHA_CHECK(m.shape[i] == target[a] || m.shape[i] == 1,
              "MultiHeadAttention: keep_mask {} does not broadcast to (B, Hq, Tq, Tk) = ({}, {}, {}, {})",
              shape_string(m), B, Hq, Tq, Tk);
    mshape[a] = m.shape[i];
    mstride[a] = m.shape[i] == 1 ? 0 : m.stride[i];
  }
  const int64_t Hm = mshape[1];
  Tensor keep(DType::kU8, {B, Hm, Tq, Tk});
  uint8_t* k = keep.data<uint8_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hm; ++h)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < Tk; ++j)
          *k++ = m.data[b * mstride[0] + h * mstride[1] + i * mstride[2] + j * mstride[3]] != 0 && kpm.at(b, j) == 0;
  return keep;
}

}  // namespace

void MultiHeadAttention::linear_rows(const void* w, int64_t w_rows, int64_t w_cols, const float* b, const void* x,
                                     int64_t rows, float* y, int64_t ldy, const MhaCallOptions& options) const {
  const bool ref = options.backend == Backend::kReference;
  const auto f32_linear = ref ? ops::linear_ref : ops::linear;
  switch (config_.dtype) {
    case DType::kF32:
      f32_linear({static_cast<const float*>(x), rows, w_cols, w_cols},
                 {static_cast<const float*>(w), w_rows, w_cols, w_cols}, b, y, ldy, options.num_threads);
      return;
    case DType::kBF16:
      if (!ref && rows <= kernels::kLinearRowsMax && !ops::bf16_matmul_available()) {
        // A decode step on a CPU without oneDNN's bf16 matmul: the weight read as stored.
        kernels::linear_rows16(x, DType::kBF16, w_cols, rows, w, DType::kBF16, w_cols, w_rows, w_cols, b, y, ldy,
                               options.num_threads);
        return;
      }
      if (!ref) {
        ops::linear_bf16({static_cast<const bfloat16*>(x), rows, w_cols, w_cols},
                         {static_cast<const bfloat16*>(w), w_rows, w_cols, w_cols}, b, y, ldy, options.num_threads);
        return;
      }
      break;
    case DType::kF16:
      if (ref) break;
      if (rows <= kernels::kLinearRowsMax) {  // a decode step: the weight read as stored
        kernels::linear_rows16(x, DType::kF32, w_cols, rows, w, DType::kF16, w_cols, w_rows, w_cols, b, y, ldy,
                               options.num_threads);
      } else {  // each tile of the weight widened as sgemm needs it
        ops::linear_widened(x, DType::kF32, w_cols, rows, w, DType::kF16, w_cols, w_rows, w_cols, b, y, ldy,
                            options.num_threads);
      }
      return;
    default:
      break;
  }
  // The reference path: the weights (and bfloat16 rows) widened to float32 whole.
  Tensor w32(DType::kF32, {w_rows, w_cols});
  widen_to_f32(w, config_.dtype, w32.data<float>(), w_rows * w_cols);
  Tensor x32;
  const float* xf = static_cast<const float*>(x);
  if (config_.dtype == DType::kBF16) {
    x32 = Tensor(DType::kF32, {rows, w_cols});
    widen_to_f32(x, DType::kBF16, x32.data<float>(), rows * w_cols);
    xf = x32.data<float>();
  }
  f32_linear({xf, rows, w_cols, w_cols}, {w32.data<float>(), w_rows, w_cols, w_cols}, b, y, ldy, options.num_threads);
}

void MultiHeadAttention::project(Proj p, const void* x, int64_t rows, float* y, int64_t ldy,
                                 const MhaCallOptions& options) const {
  const Dims d = dims();
  linear_rows(weight_data(p), d.rows[p], d.cols[p], has_bias_[p] ? bias(p).data : nullptr, x, rows, y, ldy, options);
}

void MultiHeadAttention::project_qkv(const void* x, int64_t rows, float* qkv, const MhaCallOptions& options) const {
  const int64_t E = config_.embed_dim, W = in_bias_.numel();
  linear_rows(in_weight_.raw(), W, E, in_bias_.data<float>(), x, rows, qkv, W, options);
}

void MultiHeadAttention::check_dtype(DType input, const char* where) const {
  MHA_CHECK(input == config_.dtype, "MultiHeadAttention::{}: the module's dtype is {}; the inputs are {} (convert them, "
            "or build the module with that dtype)", where, dtype_name(config_.dtype), dtype_name(input));
}

std::vector<int64_t> MultiHeadAttention::output_shape(int64_t B, int64_t T) const {
  return config_.batch_first ? std::vector<int64_t>{B, T, output_dim()} : std::vector<int64_t>{T, B, output_dim()};
}

MhaTape::MhaTape() = default;
MhaTape::~MhaTape() = default;
MhaTape::MhaTape(MhaTape&&) noexcept = default;
MhaTape& MhaTape::operator=(MhaTape&&) noexcept = default;

MhaOutputs MultiHeadAttention::forward(const MhaInputs& in, const MhaCallOptions& options, MhaTape* tape) const {
  return forward_impl(in, options, tape);
}
MhaOutputs MultiHeadAttention::forward(const BasicMhaInputs<bfloat16>& in, const MhaCallOptions& options) const {
  return forward_impl(in, options, nullptr);
}
MhaOutputs MultiHeadAttention::forward(const BasicMhaInputs<float16>& in, const MhaCallOptions& options) const {
  return forward_impl(in, options, nullptr);
}

// T: the inputs' element type, which must be the module's dtype. Inside, everything after the
// projections is float32; outputs are rounded once to T.
template <typename T>
MhaOutputs MultiHeadAttention::forward_impl(const BasicMhaInputs<T>& in, const MhaCallOptions& options,
                                            MhaTape* tape) const {
  check_dtype(DTypeOf<T>::value, "forward");
  const auto& c = config_;
  const Dims d = dims();
  const auto& q = in.query;
  const char* layout_name = c.batch_first ? "(B, T, E)" : "(T, B, E)";
  MHA_CHECK(q.rank == 3 && q.shape[2] == c.embed_dim, "MultiHeadAttention: query must be {} with E = {}; got {}",
            layout_name, c.embed_dim, shape_string(q));
  MHA_CHECK(in.key.given() == in.value.given(), "MultiHeadAttention: give both key and value, or neither; got key {}, value {}",
            shape_string(in.key), shape_string(in.value));
  const bool batch_first = c.batch_first;
  const int64_t B = q.shape[batch_first ? 0 : 1], Tq = q.shape[batch_first ? 1 : 0];
  auto same_view = [](const View<const T>& a, const View<const T>& b) {
    return a.data == b.data && a.rank == b.rank && a.shape == b.shape && a.stride == b.stride;
  };
  const bool self = !in.key.given() || (same_view(in.key, q) && same_view(in.value, q));
  const View<const T>& key = in.key.given() ? in.key : q;
  const View<const T>& value = in.value.given() ? in.value : q;
  int64_t Tk = Tq;
  if (!self) {
    MHA_CHECK(key.rank == 3 && key.shape[2] == c.kdim, "MultiHeadAttention: key must be {} with kdim = {}; got {}",
              layout_name, c.kdim, shape_string(key));
    MHA_CHECK(value.rank == 3 && value.shape[2] == c.vdim, "MultiHeadAttention: value must be {} with vdim = {}; got {}",
              layout_name, c.vdim, shape_string(value));
    Tk = key.shape[batch_first ? 1 : 0];
    const int64_t kb = key.shape[batch_first ? 0 : 1];
    MHA_CHECK(kb == B && value.shape[0] == key.shape[0] && value.shape[1] == key.shape[1],
              "MultiHeadAttention: query {}, key {} and value {} disagree on batch size or key length", shape_string(q),
              shape_string(key), shape_string(value));
  } else {
    MHA_CHECK(c.kdim == c.embed_dim && c.vdim == c.embed_dim,
              "MultiHeadAttention: self-attention needs kdim = vdim = embed_dim; this module has kdim = {}, vdim = {}, "
              "embed_dim = {}; pass key and value",
              c.kdim, c.vdim, c.embed_dim);
  }
  if (c.max_seq_len > 0) {
    MHA_CHECK(Tq <= c.max_seq_len && Tk <= c.max_seq_len,
              "MultiHeadAttention: sequence length {} exceeds max_seq_len (block_size) = {} (query {})", std::max(Tq, Tk),
              c.max_seq_len, shape_string(q));
  }

  const int64_t Hq = c.num_heads;
  const modules::Layout lq{B, Tq, batch_first}, lk{B, Tk, batch_first};
  const int64_t Nq = checked_mul(B, Tq, "MultiHeadAttention: query rows B·Tq"),
                Nk = checked_mul(B, Tk, "MultiHeadAttention: key rows B·Tk");

  // Projections. Self-attention with packed weights: one GEMM into rows of [q | k | v].
  Tensor qkv, kbuf, vbuf;
  modules::InputRows xq = modules::input_rows(q), xk, xv;
  if (self && packed()) {
    qkv = Tensor(DType::kF32, {Nq, d.rows[0] + d.rows[1] + d.rows[2]});
    project_qkv(xq.data, Nq, qkv.data<float>(), options);
  } else {
    xk = modules::input_rows(key);
    xv = modules::input_rows(value);
    qkv = Tensor(DType::kF32, {Nq, d.rows[0]});
    kbuf = Tensor(DType::kF32, {Nk, d.rows[1]});
    vbuf = Tensor(DType::kF32, {Nk, d.rows[2]});
    project(kQ, xq.data, Nq, qkv.data<float>(), d.rows[0], options);
    project(kK, xk.data, Nk, kbuf.data<float>(), d.rows[1], options);
    project(kV, xv.data, Nk, vbuf.data<float>(), d.rows[2], options);
  }
  const modules::QkvHeads heads = modules::qkv_heads(c, qkv.data<float>(), kbuf.defined() ? kbuf.data<float>() : nullptr,
                                                     vbuf.defined() ? vbuf.data<float>() : nullptr, lq, lk);
  const Causal causal = options.causal.value_or(c.causal);
  // QK-norm, then rotary embeddings. Query i sits at position i (+ Tk - Tq when aligned
  // bottom-right), key j at j. In place, except when training with QK-norm: then the
  // projections stay (its backward reads them) and q, k go to scratch (modules::NormalizedQk).
  std::optional<modules::NormalizedQk> normed;
  View<float> q_heads = heads.q, k_heads = heads.k;
  if (c.qk_norm && tape) {
    normed.emplace(lq, lk, Hq, c.num_kv_heads, head_dim_qk());
    q_heads = normed->q, k_heads = normed->k;
  }
  const std::vector<int64_t> q_first(static_cast<size_t>(B), causal == Causal::kBottomRight ? Tk - Tq : 0);
  transform_qk(heads.q, heads.k, q_heads, k_heads, q_first, std::vector<int64_t>(static_cast<size_t>(B), 0),
               options.num_threads);

  // Masks. key_padding_mask (nonzero = pad) becomes part of the keep mask.
  AttentionInputs ai;
  ai.query = q_heads;
  ai.key = k_heads;
  ai.value = heads.v;
  score_inputs(ai);
  ai.attn_bias = in.attn_bias;
  ai.key_lengths = in.key_lengths;
  Tensor keep;
  if (in.key_padding_mask.given()) keep = combined_keep_mask(in.keep_mask, in.key_padding_mask, B, Hq, Tq, Tk);
  ai.keep_mask = keep.defined() ? keep.view<uint8_t>() : in.keep_mask;

  const uint64_t call_seed =
      options.dropout_seed ? *options.dropout_seed : modules::derive_seed(seed_, calls_.fetch_add(1));
  AttentionOptions opt;
  opt.causal = causal;
  opt.softcap = c.softcap;
  MHA_CHECK(c.window == 0 || opt.causal != Causal::kNone,
            "MultiHeadAttention: options.causal turns causal masking off, but the module's window = {} needs it",
            c.window);
  opt.window = c.window;
  opt.sink_tokens = c.sink_tokens;
  opt.num_threads = options.num_threads;
  opt.backend = options.backend;
  if (options.training) {
    opt.dropout_p = c.attn_dropout;
    opt.dropout_seed = modules::derive_seed(call_seed, 1);
  }

  // Attention output, heads merged: rows of v_proj_dim floats in the input's layout. Without an
  // output projection this is the result itself.
  const std::vector<int64_t> out_shape = output_shape(B, Tq);
  Tensor merged = c.out_proj ? Tensor(DType::kF32, {Nq, c.v_proj_dim}) : Tensor(DType::kF32, out_shape);
  AttentionOutputs ao;
  ao.out = modules::heads_view(merged.data<float>(), lq, c.v_proj_dim, Hq, head_dim_v());
  MhaOutputs result;
  if (options.need_weights) {
    result.weights = options.average_weights ? Tensor(DType::kF32, {B, Tq, Tk}) : Tensor(DType::kF32, {B, Hq, Tq, Tk});
    ao.weights = result.weights.view<float>();
  }
  std::unique_ptr<MhaTape::State> saved;
  if (tape) {
    saved = std::make_unique<MhaTape::State>();
    saved->lse = Tensor(DType::kF32, {B, Hq, Tq});
    ao.lse = saved->lse.view<float>();
  }
  attention(ai, ao, opt);

  const bool drop_out = options.training && c.out_dropout > 0;
  const uint64_t out_seed = modules::derive_seed(call_seed, 2);
  if (c.out_proj) {
    result.output = Tensor(DType::kF32, out_shape);
    // A bfloat16 module's output projection reads bfloat16 rows: the attention output rounded once.
    const Tensor merged16 = c.dtype == DType::kBF16 ? merged.converted(DType::kBF16) : Tensor();
    project(kOut, merged16.defined() ? merged16.raw() : merged.raw(), Nq, result.output.data<float>(), output_dim(),
            options);
  } else {
    result.output = tape && drop_out ? merged.clone() : std::move(merged);
  }
  if (drop_out) modules::apply_output_dropout(c.out_dropout, out_seed, result.output.data<float>(), Nq, output_dim());
  if constexpr (!std::is_same_v<T, float>) {
    result.output = result.output.converted(c.dtype);
    if (result.weights.defined()) result.weights = result.weights.converted(c.dtype);
    return result;
  } else if (tape) {
    MhaTape::State& t = *saved;
    t.module = this;
    t.B = B, t.Tq = Tq, t.Tk = Tk;
    t.self = self;
    t.query_shape.assign(q.shape.begin(), q.shape.begin() + 3);
    t.output_shape = out_shape;
    // The input rows: the contiguous copy made for the projection if there is one.
    auto keep_rows = [](modules::InputRows& rows, const View<const float>& v) {
      return rows.holder.defined() ? std::move(rows.holder) : to_tensor(v);
    };
    t.xq = keep_rows(xq, q);
    if (!self) {
      t.key_shape.assign(key.shape.begin(), key.shape.begin() + 3);
      t.value_shape.assign(value.shape.begin(), value.shape.begin() + 3);
      t.xk = keep_rows(xk, key);
      t.xv = keep_rows(xv, value);
    }
    t.qkv = std::move(qkv), t.kbuf = std::move(kbuf), t.vbuf = std::move(vbuf);
    t.merged = merged.defined() ? std::move(merged) : result.output.clone();
    t.keep = keep.defined() ? std::move(keep) : to_tensor(in.keep_mask);
    t.bias = to_tensor(in.attn_bias);
    t.lengths = to_tensor(in.key_lengths);
    t.options = opt;
    t.q_first = q_first;
    t.out_dropout = drop_out ? c.out_dropout : 0.0f;
    t.out_dropout_seed = out_seed;
    tape->state_ = std::move(saved);
  }
  return result;
}

template MhaOutputs MultiHeadAttention::forward_impl(const BasicMhaInputs<float>&, const MhaCallOptions&,
                                                     MhaTape*) const;
template MhaOutputs MultiHeadAttention::forward_impl(const BasicMhaInputs<bfloat16>&, const MhaCallOptions&,
                                                     MhaTape*) const;
template MhaOutputs MultiHeadAttention::forward_impl(const BasicMhaInputs<float16>&, const MhaCallOptions&,
                                                     MhaTape*) const;

}  // namespace mha
