#include "mha/multi_head_attention.h"

#include <cmath>
#include <cstring>

#include "io/weight_names.h"
#include "kernels/dropout.h"
#include "ops/attention_internal.h"
#include "ops/linear.h"
#include "util/check.h"
#include "util/random.h"

namespace mha {
namespace {

const char* kProjNames[4] = {"q", "k", "v", "out"};

}  // namespace

MultiHeadAttentionConfig resolve_config(const MultiHeadAttentionConfig& in) {
  MultiHeadAttentionConfig c = in;
  MHA_CHECK(c.embed_dim > 0, "MultiHeadAttention: embed_dim must be positive; got {}", c.embed_dim);
  MHA_CHECK(c.num_heads > 0, "MultiHeadAttention: num_heads must be positive; got {}", c.num_heads);
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.vdim == 0) c.vdim = c.embed_dim;
  if (c.qk_dim == 0) c.qk_dim = c.embed_dim;
  if (c.v_dim == 0) c.v_dim = c.embed_dim;
  if (c.out_dim == 0) c.out_dim = c.embed_dim;
  for (auto [value, name] : {std::pair{c.num_kv_heads, "num_kv_heads"}, {c.kdim, "kdim"}, {c.vdim, "vdim"},
                             {c.qk_dim, "qk_dim"}, {c.v_dim, "v_dim"}, {c.out_dim, "out_dim"}}) {
    MHA_CHECK(value > 0, "MultiHeadAttention: {} must be positive; got {}", name, value);
  }
  MHA_CHECK(c.qk_dim % c.num_heads == 0,
            "MultiHeadAttention: qk_dim (embed_dim by default) = {} is not divisible by num_heads = {}", c.qk_dim,
            c.num_heads);
  MHA_CHECK(c.v_dim % c.num_heads == 0,
            "MultiHeadAttention: v_dim (embed_dim by default) = {} is not divisible by num_heads = {}", c.v_dim,
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
  return c;
}

MultiHeadAttention::Dims MultiHeadAttention::dims() const {
  const auto& c = config_;
  const int64_t group = c.num_heads / c.num_kv_heads;
  return {{c.qk_dim, c.qk_dim / group, c.v_dim / group, c.out_dim},
          {c.embed_dim, c.kdim, c.vdim, c.v_dim}};
}

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config, uint64_t seed)
    : config_(resolve_config(config)), seed_(seed) {
  const Dims d = dims();
  in_weight_ = Tensor(DType::kF32, {d.rows[0] * d.cols[0] + d.rows[1] * d.cols[1] + d.rows[2] * d.cols[2]});
  in_bias_ = Tensor(DType::kF32, {d.rows[0] + d.rows[1] + d.rows[2]});
  if (config_.out_proj) {
    out_weight_ = Tensor(DType::kF32, {d.rows[3], d.cols[3]});
    out_bias_ = Tensor(DType::kF32, {d.rows[3]});
  }
  for (int p = 0; p < 4; ++p) has_bias_[p] = config_.bias && (p < 3 || config_.out_proj);
  // nn.Linear's default initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  uint64_t index = 0;
  for (int p = 0; p < 4; ++p) {
    if (p == kOut && !config_.out_proj) continue;
    const float a = 1.0f / std::sqrt(static_cast<float>(d.cols[p]));
    View<float> w = weight(static_cast<Proj>(p));
    for (int64_t i = 0; i < w.numel(); ++i) w.data[i] = uniform_pm(seed, index++, a);
    if (has_bias_[p]) {
      View<float> b = bias(static_cast<Proj>(p));
      for (int64_t i = 0; i < b.numel(); ++i) b.data[i] = uniform_pm(seed, index++, a);
    }
  }
}

MultiHeadAttention::MultiHeadAttention(MultiHeadAttention&& other) noexcept
    : config_(other.config_),
      in_weight_(std::move(other.in_weight_)),
      in_bias_(std::move(other.in_bias_)),
      out_weight_(std::move(other.out_weight_)),
      out_bias_(std::move(other.out_bias_)),
      training_(other.training_),
      backend_(other.backend_),
      num_threads_(other.num_threads_),
      seed_(other.seed_),
      calls_(other.calls_.load()) {
  std::copy(other.has_bias_, other.has_bias_ + 4, has_bias_);
}

View<float> MultiHeadAttention::weight(Proj p) {
  const Dims d = dims();
  if (p == kOut) {
    MHA_CHECK(config_.out_proj, "MultiHeadAttention: this module has no output projection");
    return out_weight_.view<float>();
  }
  int64_t offset = 0;
  for (int i = 0; i < p; ++i) offset += d.rows[i] * d.cols[i];
  return View<float>(in_weight_.data<float>() + offset, {d.rows[p], d.cols[p]});
}

View<const float> MultiHeadAttention::weight(Proj p) const {
  return const_cast<MultiHeadAttention*>(this)->weight(p);
}

View<float> MultiHeadAttention::bias(Proj p) {
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

// ---------------------------------------------------------------------------------------------
// Weights in and out.

namespace {

// A float32 copy of `t` if it is another floating dtype; records the conversion.
const Tensor& as_f32(const io::FoundTensor& found, Tensor* holder, LoadReport* report) {
  const Tensor& t = *found.tensor;
  if (t.dtype() == DType::kF32) return t;
  MHA_CHECK(t.dtype() == DType::kF64 || t.dtype() == DType::kF16 || t.dtype() == DType::kBF16,
            "weights: '{}' has dtype {}; weights must be F32, F64, F16 or BF16", found.name, dtype_name(t.dtype()));
  *holder = t.to_f32();
  report->converted.push_back(found.name);
  return *holder;
}

void copy_checked(const io::FoundTensor& found, View<float> dst, LoadReport* report) {
  Tensor holder;
  const Tensor& src = as_f32(found, &holder, report);
  const std::vector<int64_t> want(dst.shape.begin(), dst.shape.begin() + dst.rank);
  MHA_CHECK(src.shape() == want, "weights: '{}' has shape {}, expected {}", found.name,
            shape_string(src.shape().data(), src.rank()), shape_string(dst));
  std::memcpy(dst.data, src.data<float>(), src.nbytes());
  report->used.push_back(found.name);
}

std::vector<int64_t> shape_of(const io::FoundTensor& f) { return f.tensor->shape(); }

}  // namespace

LoadReport MultiHeadAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  const io::FoundWeights f = io::find_weights(sd, prefix);
  const Dims d = dims();
  LoadReport report;
  report.layout = f.layout;
  report.ignored = f.ignored;

  // Check bias presence against the module before copying anything.
  bool file_bias[4];
  for (int p = 0; p < 4; ++p) file_bias[p] = f.bias[p].tensor != nullptr || (p < 3 && f.in_proj_bias.tensor);
  MHA_CHECK(config_.out_proj == (f.weight[3].tensor != nullptr),
            "weights: the module {} an output projection but the file {} ({})",
            config_.out_proj ? "has" : "has no", config_.out_proj ? "has none" : "has one", f.layout);
  for (int p = 0; p < 4; ++p) {
    if (p == kOut && !config_.out_proj) continue;
    MHA_CHECK(file_bias[p] || !has_bias_[p], "weights: the {} projection's bias is missing from the file ({}); the "
              "module has one", kProjNames[p], f.layout);
    MHA_CHECK(!file_bias[p] || has_bias_[p], "weights: the file has a bias for the {} projection ({}) but the module "
              "was built without one", kProjNames[p], f.layout);
  }

  if (f.in_proj_weight.tensor) {
    MHA_CHECK(packed(), "weights: '{}' is packed but the module's kdim/vdim differ from embed_dim",
              f.in_proj_weight.name);
    copy_checked(f.in_proj_weight, View<float>(in_weight_.data<float>(), {d.rows[0] + d.rows[1] + d.rows[2], d.cols[0]}),
                 &report);
  } else {
    for (int p = 0; p < 3; ++p) copy_checked(f.weight[p], weight(static_cast<Proj>(p)), &report);
  }
  if (f.in_proj_bias.tensor) copy_checked(f.in_proj_bias, in_bias_.view<float>(), &report);
  for (int p = 0; p < 3; ++p) {
    if (f.bias[p].tensor) copy_checked(f.bias[p], bias(static_cast<Proj>(p)), &report);
  }
  if (config_.out_proj) {
    copy_checked(f.weight[3], weight(kOut), &report);
    if (f.bias[3].tensor) copy_checked(f.bias[3], bias(kOut), &report);
  }
  return report;
}

MultiHeadAttention MultiHeadAttention::from_state_dict(const StateDict& sd, const MultiHeadAttentionConfig& base,
                                                       LoadReport* report, const std::string& prefix) {
  const io::FoundWeights f = io::find_weights(sd, prefix);
  MHA_CHECK(base.num_heads > 0, "MultiHeadAttention::from_state_dict: num_heads must be positive; got {}",
            base.num_heads);
  // Shapes of q, k, v (rows, cols).
  int64_t rows[3], cols[3];
  if (f.in_proj_weight.tensor) {
    const auto s = shape_of(f.in_proj_weight);
    MHA_CHECK(s.size() == 2 && s[0] % 3 == 0, "weights: '{}' must be (3E, E); got {}", f.in_proj_weight.name,
              shape_string(s.data(), static_cast<int>(s.size())));
    for (int p = 0; p < 3; ++p) rows[p] = s[0] / 3, cols[p] = s[1];
  } else {
    for (int p = 0; p < 3; ++p) {
      const auto s = shape_of(f.weight[p]);
      MHA_CHECK(s.size() == 2, "weights: '{}' must be 2-D (out, in); got {}", f.weight[p].name,
                shape_string(s.data(), static_cast<int>(s.size())));
      rows[p] = s[0], cols[p] = s[1];
    }
  }
  const char* names[3] = {"query", "key", "value"};
  for (int p = 0; p < 3; ++p) {
    MHA_CHECK(rows[p] > 0 && cols[p] > 0, "weights: the {} projection weight has an empty shape ({}, {})", names[p],
              rows[p], cols[p]);
  }
  MultiHeadAttentionConfig c = base;
  c.embed_dim = cols[0];
  c.kdim = cols[1];
  c.vdim = cols[2];
  c.qk_dim = rows[0];
  const int64_t H = base.num_heads;
  MHA_CHECK(rows[0] % H == 0, "weights: query projection width {} is not divisible by num_heads = {}", rows[0], H);
  const int64_t dh = rows[0] / H;
  MHA_CHECK(rows[1] % dh == 0 && H % (rows[1] / dh) == 0,
            "weights: key projection width {} is not a whole number of heads of {} dividing {} heads (query width {})",
            rows[1], dh, H, rows[0]);
  c.num_kv_heads = rows[1] / dh;
  c.v_dim = rows[2] * (H / c.num_kv_heads);
  c.out_proj = f.weight[3].tensor != nullptr;
  if (c.out_proj) {
    const auto s = shape_of(f.weight[3]);
    MHA_CHECK(s.size() == 2 && s[1] == c.v_dim, "weights: '{}' must be (out, {}); got {}", f.weight[3].name, c.v_dim,
              shape_string(s.data(), static_cast<int>(s.size())));
    c.out_dim = s[0];
  }
  c.bias = true;
  MultiHeadAttention m(c);
  for (int p = 0; p < 4; ++p) {
    m.has_bias_[p] = (p < 3 && f.in_proj_bias.tensor) || f.bias[p].tensor;
    if (!m.has_bias_[p] && p < 3) {
      View<float> b(m.in_bias_.data<float>() + (p == 0 ? 0 : p == 1 ? rows[0] : rows[0] + rows[1]), {rows[p]});
      std::fill(b.data, b.data + b.numel(), 0.0f);
    }
  }
  m.config_.bias = m.has_bias_[0] && m.has_bias_[1] && m.has_bias_[2] && (!c.out_proj || m.has_bias_[3]);
  LoadReport r = m.load_state_dict(sd, f.prefix);
  if (report) *report = std::move(r);
  return m;
}

StateDict MultiHeadAttention::state_dict() const {
  StateDict sd;
  const auto& c = config_;
  const Dims d = dims();
  auto copy_of = [](View<const float> v) { return to_tensor(v); };
  const bool all_bias = has_bias_[0] && has_bias_[1] && has_bias_[2];
  const bool none_bias = !has_bias_[0] && !has_bias_[1] && !has_bias_[2];
  const bool torch_mha = c.out_proj && c.out_dim == c.embed_dim && c.qk_dim == c.embed_dim &&
                         c.v_dim == c.embed_dim && c.num_kv_heads == c.num_heads && (all_bias || none_bias) &&
                         has_bias_[3] == all_bias;
  if (torch_mha) {
    if (packed()) {
      sd.emplace("in_proj_weight", to_tensor(View<const float>(in_weight_.data<float>(),
                                                                {d.rows[0] + d.rows[1] + d.rows[2], d.cols[0]})));
    } else {
      sd.emplace("q_proj_weight", copy_of(weight(kQ)));
      sd.emplace("k_proj_weight", copy_of(weight(kK)));
      sd.emplace("v_proj_weight", copy_of(weight(kV)));
    }
    if (all_bias) sd.emplace("in_proj_bias", in_bias_.clone());
    sd.emplace("out_proj.weight", copy_of(weight(kOut)));
    if (has_bias_[3]) sd.emplace("out_proj.bias", copy_of(bias(kOut)));
    return sd;
  }
  const char* names[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
  for (int p = 0; p < 4; ++p) {
    if (p == kOut && !c.out_proj) continue;
    sd.emplace(std::string(names[p]) + ".weight", copy_of(weight(static_cast<Proj>(p))));
    if (has_bias_[p]) sd.emplace(std::string(names[p]) + ".bias", copy_of(bias(static_cast<Proj>(p))));
  }
  return sd;
}

// ---------------------------------------------------------------------------------------------
// Forward.

namespace {

struct Layout {
  int64_t B, T;
  bool batch_first;
  // Strides (in rows) of batch and time in a row matrix of B*T rows.
  int64_t batch_rows() const { return batch_first ? T : 1; }
  int64_t time_rows() const { return batch_first ? 1 : B; }
};

// A (B, H, T, D) view of heads [h0, h0+H) inside a row matrix whose rows have `width` floats.
View<float> heads_view(float* base, const Layout& l, int64_t width, int64_t H, int64_t D) {
  return View<float>(base, {l.B, H, l.T, D}, {l.batch_rows() * width, D, l.time_rows() * width, 1});
}

// Rows of a (B, T, E) or (T, B, E) input, contiguous (copied if the view is not).
struct Rows {
  const float* data;
  Tensor holder;
};
Rows contiguous_rows(const View<const float>& v) {
  if (v.is_contiguous()) return {v.data, Tensor()};
  Rows r{nullptr, to_tensor(v)};
  r.data = r.holder.data<float>();
  return r;
}

uint64_t derive_seed(uint64_t seed, uint64_t stream) { return splitmix64(seed ^ splitmix64(stream)); }

template <typename T>
View<const T> view_or_empty(const Tensor& t) {
  return t.defined() ? t.view<T>() : View<const T>();
}

}  // namespace

// Everything backward() reads, owned (the caller's buffers may change after forward returns).
struct MhaTape::State {
  const MultiHeadAttention* module = nullptr;
  int64_t B = 0, Tq = 0, Tk = 0;
  bool self = false;
  std::vector<int64_t> query_shape, key_shape, value_shape, output_shape;
  Tensor xq, xk, xv;        // input rows (xk, xv only when not self-attention)
  Tensor qkv, kbuf, vbuf;   // projections: packed [q | k | v] rows, or q, k, v apart
  Tensor merged;            // attention output, heads merged, before out_proj and dropout
  Tensor lse;               // (B, Hq, Tq)
  Tensor keep, bias, lengths;
  AttentionOptions options;  // causal, window, dropout of the attention
  uint64_t out_dropout_seed = 0;
  float out_dropout = 0.0f;
};

MhaTape::MhaTape() = default;
MhaTape::~MhaTape() = default;
MhaTape::MhaTape(MhaTape&&) noexcept = default;
MhaTape& MhaTape::operator=(MhaTape&&) noexcept = default;

MhaOutput MultiHeadAttention::forward(const MhaInputs& in) const { return forward(in, nullptr); }

MhaOutput MultiHeadAttention::forward(const MhaInputs& in, MhaTape* tape) const {
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
  auto same_view = [](const View<const float>& a, const View<const float>& b) {
    return a.data == b.data && a.rank == b.rank && a.shape == b.shape && a.stride == b.stride;
  };
  const bool self = !in.key.given() || (same_view(in.key, q) && same_view(in.value, q));
  const View<const float>& key = in.key.given() ? in.key : q;
  const View<const float>& value = in.value.given() ? in.value : q;
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

  const bool reference = backend_ == Backend::kReference;
  auto project = [&](const float* x, int64_t rows, int64_t cols, Proj p, float* y, int64_t ldy) {
    const View<const float> w = weight(p);
    const ops::RowMatrix xm{x, rows, cols, cols};
    const ops::RowMatrix wm{w.data, w.shape[0], w.shape[1], w.shape[1]};
    const float* b = has_bias_[p] ? bias(p).data : nullptr;
    (reference ? ops::linear_ref : ops::linear)(xm, wm, b, y, ldy, num_threads_);
  };

  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, dqk = head_dim_qk(), dv = head_dim_v();
  const Layout lq{B, Tq, batch_first}, lk{B, Tk, batch_first};
  const int64_t Nq = B * Tq, Nk = B * Tk;

  // Projections. Self-attention with packed weights: one GEMM into rows of [q | k | v].
  Tensor qkv, kbuf, vbuf;
  View<float> qh, kh, vh;
  const Rows xq = contiguous_rows(q);
  if (self && packed()) {
    const int64_t W = d.rows[0] + d.rows[1] + d.rows[2];
    qkv = Tensor(DType::kF32, {Nq, W});
    float* base = qkv.data<float>();
    const ops::RowMatrix xm{xq.data, Nq, c.embed_dim, c.embed_dim};
    const ops::RowMatrix wm{in_weight_.data<float>(), W, c.embed_dim, c.embed_dim};
    (reference ? ops::linear_ref : ops::linear)(xm, wm, in_bias_.data<float>(), base, W, num_threads_);
    qh = heads_view(base, lq, W, Hq, dqk);
    kh = heads_view(base + d.rows[0], lk, W, Hkv, dqk);
    vh = heads_view(base + d.rows[0] + d.rows[1], lk, W, Hkv, dv);
  } else {
    qkv = Tensor(DType::kF32, {Nq, d.rows[0]});
    kbuf = Tensor(DType::kF32, {Nk, d.rows[1]});
    vbuf = Tensor(DType::kF32, {Nk, d.rows[2]});
    project(xq.data, Nq, c.embed_dim, kQ, qkv.data<float>(), d.rows[0]);
    const Rows xk = contiguous_rows(key);
    project(xk.data, Nk, c.kdim, kK, kbuf.data<float>(), d.rows[1]);
    const Rows xv = contiguous_rows(value);
    project(xv.data, Nk, c.vdim, kV, vbuf.data<float>(), d.rows[2]);
    qh = heads_view(qkv.data<float>(), lq, d.rows[0], Hq, dqk);
    kh = heads_view(kbuf.data<float>(), lk, d.rows[1], Hkv, dqk);
    vh = heads_view(vbuf.data<float>(), lk, d.rows[2], Hkv, dv);
  }

  // Masks. key_padding_mask (nonzero = pad) becomes part of the keep mask.
  AttentionInputs ai;
  ai.query = qh;
  ai.key = kh;
  ai.value = vh;
  ai.bias = in.attn_bias;
  ai.key_lengths = in.key_lengths;
  Tensor keep;
  if (in.key_padding_mask.given()) {
    const auto& kpm = in.key_padding_mask;
    MHA_CHECK(kpm.rank == 2 && kpm.shape[0] == B && kpm.shape[1] == Tk,
              "MultiHeadAttention: key_padding_mask must be (B, Tk) = ({}, {}); got {}", B, Tk, shape_string(kpm));
    MHA_CHECK(kpm.numel() == 0 || kpm.data, "MultiHeadAttention: key_padding_mask has a null data pointer");
    if (!in.keep_mask.given()) {
      keep = Tensor(DType::kU8, {B, 1, 1, Tk});
      uint8_t* k = keep.data<uint8_t>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < Tk; ++j) k[b * Tk + j] = kpm.at(b, j) == 0;
    } else {
      // Combine: keep = keep_mask AND NOT padding, at (B, Hm, Tq, Tk).
      const int64_t target[4] = {B, Hq, Tq, Tk};
      const auto& m = in.keep_mask;
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
      keep = Tensor(DType::kU8, {B, Hm, Tq, Tk});
      uint8_t* k = keep.data<uint8_t>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hm; ++h)
          for (int64_t i = 0; i < Tq; ++i)
            for (int64_t j = 0; j < Tk; ++j)
              *k++ = m.data[b * mstride[0] + h * mstride[1] + i * mstride[2] + j * mstride[3]] != 0 &&
                     kpm.at(b, j) == 0;
    }
    ai.keep_mask = keep.view<uint8_t>();
  } else {
    ai.keep_mask = in.keep_mask;
  }

  const uint64_t call_seed = in.dropout_seed ? *in.dropout_seed : derive_seed(seed_, calls_.fetch_add(1));
  AttentionOptions opt;
  opt.causal = c.causal;
  opt.window = c.window;
  opt.num_threads = num_threads_;
  opt.backend = reference ? Backend::kReference : backend_;
  if (training_) {
    opt.dropout_p = c.attn_dropout;
    opt.dropout_seed = derive_seed(call_seed, 1);
  }

  // Attention output, heads merged: rows of v_dim floats in the input's layout. Without an
  // output projection this is the result itself.
  const int64_t width = output_dim();
  const std::vector<int64_t> out_shape =
      batch_first ? std::vector<int64_t>{B, Tq, width} : std::vector<int64_t>{Tq, B, width};
  Tensor merged = c.out_proj ? Tensor(DType::kF32, {Nq, c.v_dim}) : Tensor(DType::kF32, out_shape);
  AttentionOutputs ao;
  ao.out = heads_view(merged.data<float>(), lq, c.v_dim, Hq, dv);
  MhaOutput result;
  if (in.need_weights) {
    result.weights = in.average_weights ? Tensor(DType::kF32, {B, Tq, Tk}) : Tensor(DType::kF32, {B, Hq, Tq, Tk});
    ao.weights = result.weights.view<float>();
  }
  std::unique_ptr<MhaTape::State> saved;
  if (tape) {
    saved = std::make_unique<MhaTape::State>();
    saved->lse = Tensor(DType::kF32, {B, Hq, Tq});
    ao.lse = saved->lse.view<float>();
  }
  attention(ai, ao, opt);

  const bool drop_out = training_ && c.out_dropout > 0;
  const uint64_t out_seed = derive_seed(call_seed, 2);
  if (c.out_proj) {
    result.output = Tensor(DType::kF32, out_shape);
    project(merged.data<float>(), Nq, c.v_dim, kOut, result.output.data<float>(), width);
  } else {
    result.output = tape && drop_out ? merged.clone() : std::move(merged);
  }
  if (drop_out) {
    const kernels::Dropout drop(c.out_dropout, out_seed);
    float* y = result.output.data<float>();
    for (int64_t n = 0; n < Nq; ++n)
      for (int64_t o = 0; o < width; ++o)
        y[n * width + o] = drop.keep(0, 0, n, o) ? y[n * width + o] * drop.scale() : 0.0f;
  }
  if (tape) {
    MhaTape::State& t = *saved;
    t.module = this;
    t.B = B, t.Tq = Tq, t.Tk = Tk;
    t.self = self;
    t.query_shape.assign(q.shape.begin(), q.shape.begin() + 3);
    t.output_shape = out_shape;
    t.xq = to_tensor(q);
    if (!self) {
      t.key_shape.assign(key.shape.begin(), key.shape.begin() + 3);
      t.value_shape.assign(value.shape.begin(), value.shape.begin() + 3);
      t.xk = to_tensor(key);
      t.xv = to_tensor(value);
    }
    t.qkv = std::move(qkv), t.kbuf = std::move(kbuf), t.vbuf = std::move(vbuf);
    t.merged = merged.defined() ? std::move(merged) : result.output.clone();
    t.keep = keep.defined() ? std::move(keep) : to_tensor(in.keep_mask);
    t.bias = to_tensor(in.attn_bias);
    t.lengths = to_tensor(in.key_lengths);
    t.options = opt;
    t.out_dropout = drop_out ? c.out_dropout : 0.0f;
    t.out_dropout_seed = out_seed;
    tape->state_ = std::move(saved);
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// Training.

void MhaGrads::zero() {
  for (Tensor* t : {&in_weight, &in_bias, &out_weight, &out_bias}) {
    if (t->defined()) std::fill(t->data<float>(), t->data<float>() + t->numel(), 0.0f);
  }
}

MhaGrads MultiHeadAttention::make_grads() const {
  MhaGrads g;
  g.in_weight = Tensor(DType::kF32, in_weight_.shape());
  g.in_bias = Tensor(DType::kF32, in_bias_.shape());
  if (config_.out_proj) {
    g.out_weight = Tensor(DType::kF32, out_weight_.shape());
    g.out_bias = Tensor(DType::kF32, out_bias_.shape());
  }
  return g;
}

namespace {

void check_grads(const MhaGrads& g, const Tensor& in_weight, const Tensor& out_weight) {
  MHA_CHECK(g.in_weight.defined() && g.in_weight.shape() == in_weight.shape() &&
                g.out_weight.defined() == out_weight.defined() &&
                (!out_weight.defined() || g.out_weight.shape() == out_weight.shape()),
            "MultiHeadAttention::backward: grads were not made for this module (in_weight {} vs {}); use make_grads()",
            shape_string(g.in_weight.shape().data(), g.in_weight.rank()),
            shape_string(in_weight.shape().data(), in_weight.rank()));
}

}  // namespace

std::vector<Parameter> MultiHeadAttention::parameters(MhaGrads* grads) {
  if (grads) check_grads(*grads, in_weight_, out_weight_);
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
  return params;
}

MhaInputGrads MultiHeadAttention::backward(const MhaTape& tape, const View<const float>& grad_output,
                                           MhaGrads* grads) const {
  MHA_CHECK(tape.recorded(), "MultiHeadAttention::backward: the tape is empty; record it with forward(inputs, &tape)");
  const MhaTape::State& t = *tape.state_;
  MHA_CHECK(t.module == this, "MultiHeadAttention::backward: the tape was recorded by another module");
  MHA_CHECK(grads != nullptr, "MultiHeadAttention::backward: grads must not be null; use make_grads()");
  check_grads(*grads, in_weight_, out_weight_);
  MHA_CHECK(grad_output.rank == 3 && std::equal(t.output_shape.begin(), t.output_shape.end(), grad_output.shape.begin()),
            "MultiHeadAttention::backward: grad_output must have the output's shape {}; got {}",
            shape_string(t.output_shape.data(), 3), shape_string(grad_output));
  MHA_CHECK(grad_output.numel() == 0 || grad_output.data, "MultiHeadAttention::backward: grad_output has a null data pointer");

  const auto& c = config_;
  const Dims d = dims();
  const int64_t B = t.B, Tq = t.Tq, Tk = t.Tk, Nq = B * Tq, Nk = B * Tk;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, dqk = head_dim_qk(), dv = head_dim_v();
  const int64_t width = output_dim();
  const Layout lq{B, Tq, c.batch_first}, lk{B, Tk, c.batch_first};

  // dL/d(output before dropout): the same draws as the forward's.
  Tensor dy = to_tensor(grad_output);
  if (t.out_dropout > 0) {
    const kernels::Dropout drop(t.out_dropout, t.out_dropout_seed);
    float* g = dy.data<float>();
    for (int64_t n = 0; n < Nq; ++n)
      for (int64_t o = 0; o < width; ++o) g[n * width + o] = drop.keep(0, 0, n, o) ? g[n * width + o] * drop.scale() : 0.0f;
  }

  // Output projection.
  Tensor dmerged;
  if (c.out_proj) {
    dmerged = Tensor(DType::kF32, {Nq, c.v_dim});
    ops::linear_backward({t.merged.data<float>(), Nq, c.v_dim, c.v_dim},
                         {out_weight_.data<float>(), d.rows[3], d.cols[3], d.cols[3]}, dy.data<float>(), width,
                         dmerged.data<float>(), c.v_dim, grads->out_weight.data<float>(), d.cols[3],
                         has_bias_[kOut] ? grads->out_bias.data<float>() : nullptr, num_threads_);
  } else {
    dmerged = std::move(dy);
  }

  // Attention, with the forward's inputs rebuilt from the tape.
  const bool packed_self = t.self;  // self-attention always runs on the packed projection
  const int64_t W = d.rows[0] + d.rows[1] + d.rows[2];
  AttentionInputs ai;
  AttentionGrads ag;
  Tensor dqkv, dk, dv_buf;
  if (packed_self) {
    float* base = const_cast<float*>(t.qkv.data<float>());
    ai.query = heads_view(base, lq, W, Hq, dqk);
    ai.key = heads_view(base + d.rows[0], lk, W, Hkv, dqk);
    ai.value = heads_view(base + d.rows[0] + d.rows[1], lk, W, Hkv, dv);
    dqkv = Tensor(DType::kF32, {Nq, W});
    float* g = dqkv.data<float>();
    ag = {heads_view(g, lq, W, Hq, dqk), heads_view(g + d.rows[0], lk, W, Hkv, dqk),
          heads_view(g + d.rows[0] + d.rows[1], lk, W, Hkv, dv)};
  } else {
    ai.query = heads_view(const_cast<float*>(t.qkv.data<float>()), lq, d.rows[0], Hq, dqk);
    ai.key = heads_view(const_cast<float*>(t.kbuf.data<float>()), lk, d.rows[1], Hkv, dqk);
    ai.value = heads_view(const_cast<float*>(t.vbuf.data<float>()), lk, d.rows[2], Hkv, dv);
    dqkv = Tensor(DType::kF32, {Nq, d.rows[0]});
    dk = Tensor(DType::kF32, {Nk, d.rows[1]});
    dv_buf = Tensor(DType::kF32, {Nk, d.rows[2]});
    ag = {heads_view(dqkv.data<float>(), lq, d.rows[0], Hq, dqk), heads_view(dk.data<float>(), lk, d.rows[1], Hkv, dqk),
          heads_view(dv_buf.data<float>(), lk, d.rows[2], Hkv, dv)};
  }
  ai.keep_mask = view_or_empty<uint8_t>(t.keep);
  ai.bias = view_or_empty<float>(t.bias);
  ai.key_lengths = view_or_empty<int32_t>(t.lengths);
  const View<const float> out_heads = heads_view(const_cast<float*>(t.merged.data<float>()), lq, c.v_dim, Hq, dv);
  const View<const float> dout_heads = heads_view(dmerged.data<float>(), lq, c.v_dim, Hq, dv);
  attention_backward(ai, out_heads, t.lse.view<float>(), dout_heads, ag, t.options);

  // Input projections.
  MhaInputGrads result;
  result.query = Tensor(DType::kF32, t.query_shape);
  if (packed_self) {
    ops::linear_backward({t.xq.data<float>(), Nq, c.embed_dim, c.embed_dim}, {in_weight_.data<float>(), W, c.embed_dim, c.embed_dim},
                         dqkv.data<float>(), W, result.query.data<float>(), c.embed_dim, grads->in_weight.data<float>(), c.embed_dim,
                         grads->in_bias.data<float>(), num_threads_);
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
  const float* dproj[3] = {dqkv.data<float>(), dk.data<float>(), dv_buf.data<float>()};
  float* dx[3] = {result.query.data<float>(), result.key.data<float>(), result.value.data<float>()};
  const int64_t rows[3] = {Nq, Nk, Nk};
  int64_t w_offset = 0, b_offset = 0;
  for (int p = 0; p < 3; ++p) {
    ops::linear_backward({x[p], rows[p], d.cols[p], d.cols[p]}, {in_weight_.data<float>() + w_offset, d.rows[p], d.cols[p], d.cols[p]},
                         dproj[p], d.rows[p], dx[p], d.cols[p], grads->in_weight.data<float>() + w_offset, d.cols[p],
                         has_bias_[p] ? grads->in_bias.data<float>() + b_offset : nullptr, num_threads_);
    w_offset += d.rows[p] * d.cols[p];
    b_offset += d.rows[p];
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// Incremental decoding.

KvCache MultiHeadAttention::make_cache(int64_t batch, int64_t capacity) const {
  KvCacheConfig k;
  k.batch = batch;
  k.kv_heads = config_.num_kv_heads;
  k.head_dim_k = head_dim_qk();
  k.head_dim_v = head_dim_v();
  k.capacity = capacity;
  k.window = config_.window;
  return KvCache(k);
}

MhaOutput MultiHeadAttention::step(const View<const float>& x, KvCache& cache, const std::vector<int64_t>& new_tokens) const {
  const auto& c = config_;
  const Dims d = dims();
  const bool batch_first = c.batch_first;
  MHA_CHECK(x.rank == 3 && x.shape[2] == c.embed_dim, "MultiHeadAttention::step: x must be {} with E = {}; got {}",
            batch_first ? "(B, n, E)" : "(n, B, E)", c.embed_dim, shape_string(x));
  MHA_CHECK(packed(), "MultiHeadAttention::step: decoding is self-attention; this module has kdim {} / vdim {} != {}",
            c.kdim, c.vdim, c.embed_dim);
  const int64_t B = x.shape[batch_first ? 0 : 1], n = x.shape[batch_first ? 1 : 0];
  const KvCacheConfig& kc = cache.config();
  MHA_CHECK(kc.batch == B && kc.kv_heads == c.num_kv_heads && kc.head_dim_k == head_dim_qk() &&
                kc.head_dim_v == head_dim_v() && kc.window == c.window,
            "MultiHeadAttention::step: the cache (batch {}, kv heads {}, head dims {}/{}, window {}) does not fit this "
            "module and input (batch {}, kv heads {}, head dims {}/{}, window {}); use make_cache()",
            kc.batch, kc.kv_heads, kc.head_dim_k, kc.head_dim_v, kc.window, B, c.num_kv_heads, head_dim_qk(),
            head_dim_v(), c.window);
  std::vector<int64_t> counts = new_tokens.empty() ? std::vector<int64_t>(static_cast<size_t>(B), n) : new_tokens;
  MHA_CHECK(static_cast<int64_t>(counts.size()) == B, "MultiHeadAttention::step: {} new_tokens for a batch of {}",
            counts.size(), B);
  for (int64_t b = 0; b < B; ++b) {
    MHA_CHECK(counts[b] >= 0 && counts[b] <= n, "MultiHeadAttention::step: new_tokens[{}] = {} outside [0, {}]", b,
              counts[b], n);
    if (c.max_seq_len > 0) {
      MHA_CHECK(cache.length(b) + counts[b] <= c.max_seq_len,
                "MultiHeadAttention::step: sequence {} would reach {} positions, beyond max_seq_len (block_size) = {}",
                b, cache.length(b) + counts[b], c.max_seq_len);
    }
  }

  // One GEMM for the new positions' q, k and v.
  const int64_t W = d.rows[0] + d.rows[1] + d.rows[2], N = B * n;
  const int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, dqk = head_dim_qk(), dv = head_dim_v();
  const Rows xr = contiguous_rows(x);
  Tensor qkv(DType::kF32, {N, W});
  (backend_ == Backend::kReference ? ops::linear_ref : ops::linear)(
      {xr.data, N, c.embed_dim, c.embed_dim}, {in_weight_.data<float>(), W, c.embed_dim, c.embed_dim},
      in_bias_.data<float>(), qkv.data<float>(), W, num_threads_);
  const Layout l{B, n, batch_first};
  const View<float> qh = heads_view(qkv.data<float>(), l, W, Hq, dqk);
  const View<float> kh = heads_view(qkv.data<float>() + d.rows[0], l, W, Hkv, dqk);
  const View<float> vh = heads_view(qkv.data<float>() + d.rows[0] + d.rows[1], l, W, Hkv, dv);

  const int64_t out_width = output_dim();
  const std::vector<int64_t> out_shape =
      batch_first ? std::vector<int64_t>{B, n, out_width} : std::vector<int64_t>{n, B, out_width};
  Tensor merged = c.out_proj ? Tensor(DType::kF32, {N, c.v_dim}) : Tensor(DType::kF32, out_shape);
  AttentionOutputs ao;
  ao.out = heads_view(merged.data<float>(), l, c.v_dim, Hq, dv);
  AttentionOptions opt;
  opt.num_threads = num_threads_;
  opt.backend = backend_;
  Tensor lengths(DType::kI32, {B});
  std::vector<int64_t> offsets(static_cast<size_t>(B));

  const bool windowed = c.window > 0;
  bool single = true;  // one new position per sequence: a windowed ring then holds exactly what it sees
  for (int64_t b = 0; b < B; ++b) single &= counts[b] == 1;
  if (!windowed || single) {
    // Append first, then attend to the cache.
    cache.append(kh, vh, counts);
    for (int64_t b = 0; b < B; ++b) {
      lengths.data<int32_t>()[b] = static_cast<int32_t>(cache.stored(b));
      offsets[b] = cache.length(b) - counts[b];  // query i sits at position length - count + i
    }
    const AttentionInputs ai{qh, cache.keys(), cache.values(), {}, {}, lengths.view<int32_t>()};
    if (windowed) {
      attention(ai, ao, opt);  // the ring holds exactly the window: every stored key is visible
    } else {
      opt.causal = Causal::kBottomRight;
      ops::attention_with_offsets(ai, ao, opt, offsets.data());
    }
  } else {
    // A windowed chunk: its first query needs up to window-1 positions before the chunk, which
    // the chunk's own append could overwrite in the ring. Gather them, in position order,
    // followed by the chunk's keys; attend; then append.
    const int64_t before = c.window - 1, T = before + n;
    Tensor kt(DType::kF32, {B, Hkv, T, dqk}), vt(DType::kF32, {B, Hkv, T, dv});
    const View<const float> ck = cache.keys(), cv = cache.values();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L0 = cache.length(b), kept = std::min(L0, before);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t t = 0; t < kept; ++t) {
          const int64_t slot = (L0 - kept + t) % c.window;
          for (int64_t e = 0; e < dqk; ++e) kt.view<float>().at(b, h, t, e) = ck.at(b, h, slot, e);
          for (int64_t e = 0; e < dv; ++e) vt.view<float>().at(b, h, t, e) = cv.at(b, h, slot, e);
        }
        for (int64_t t = 0; t < counts[b]; ++t) {
          for (int64_t e = 0; e < dqk; ++e) kt.view<float>().at(b, h, kept + t, e) = kh.at(b, h, t, e);
          for (int64_t e = 0; e < dv; ++e) vt.view<float>().at(b, h, kept + t, e) = vh.at(b, h, t, e);
        }
      }
      lengths.data<int32_t>()[b] = static_cast<int32_t>(kept + counts[b]);
      offsets[b] = kept;
    }
    opt.causal = Causal::kBottomRight;
    opt.window = c.window;
    const AttentionInputs ai{qh, kt.view<float>(), vt.view<float>(), {}, {}, lengths.view<int32_t>()};
    ops::attention_with_offsets(ai, ao, opt, offsets.data());
    cache.append(kh, vh, counts);
  }

  // Rows past new_tokens[b] are padding: zeros.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = counts[b]; t < n; ++t) {
      float* row = merged.data<float>() + (b * l.batch_rows() + t * l.time_rows()) * c.v_dim;
      std::fill(row, row + c.v_dim, 0.0f);
    }
  MhaOutput result;
  if (c.out_proj) {
    result.output = Tensor(DType::kF32, out_shape);
    const View<const float> w = weight(kOut);
    (backend_ == Backend::kReference ? ops::linear_ref : ops::linear)(
        {merged.data<float>(), N, c.v_dim, c.v_dim}, {w.data, w.shape[0], w.shape[1], w.shape[1]},
        has_bias_[kOut] ? bias(kOut).data : nullptr, result.output.data<float>(), out_width, num_threads_);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = counts[b]; t < n; ++t) {
        float* row = result.output.data<float>() + (b * l.batch_rows() + t * l.time_rows()) * out_width;
        std::fill(row, row + out_width, 0.0f);
      }
  } else {
    result.output = std::move(merged);
  }
  return result;
}

}  // namespace mha
