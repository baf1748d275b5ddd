// MultiHeadAttention's weights in and out by name: load_state_dict (the layouts of
// io/weight_names.h, each tensor's shape and dtype checked) and state_dict.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "io/weight_names.h"
#include "mha/multi_head_attention.h"
#include "mha/safetensors.h"
#include "util/check.h"

namespace mha {
namespace {

const char* kProjNames[4] = {"q", "k", "v", "out"};

// Copies a found tensor into `dst` (storage of dtype `storage`, shape `want`), its values first
// converted to the module's dtype `dtype` (recorded when that changes them). Biases are stored
// in float32 whatever the module's dtype, holding values of that dtype.
void copy_checked(const io::FoundTensor& found, void* dst, DType storage, DType dtype, const std::vector<int64_t>& want,
                  LoadReport* report) {
  const Tensor& t = *found.tensor;
  MHA_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF64 || t.dtype() == DType::kF16 || t.dtype() == DType::kBF16,
            "weights: '{}' has dtype {}; weights must be F32, F64, F16 or BF16", found.name, dtype_name(t.dtype()));
  MHA_CHECK(t.shape() == want, "weights: '{}' has shape {}, expected {}", found.name,
            shape_string(t.shape().data(), t.rank()), shape_string(want.data(), static_cast<int>(want.size())));
  if (t.dtype() != dtype) report->converted.push_back(found.name);
  Tensor src = t.converted(dtype);
  if (storage != dtype) src = src.converted(storage);
  std::memcpy(dst, src.raw(), src.nbytes());
  report->used.push_back(found.name);
}

std::vector<int64_t> shape_of(const io::FoundTensor& f) { return f.tensor->shape(); }

}  // namespace

LoadReport MultiHeadAttention::load_state_dict(const StateDict& sd, const std::string& prefix) {
  const io::FoundWeights f = io::find_weights(sd, prefix);
  const Dims d = dims();
  const DType t = config_.dtype;
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
    copy_checked(f.in_proj_weight, in_weight_.raw(), t, t, {d.rows[0] + d.rows[1] + d.rows[2], d.cols[0]}, &report);
  } else {
    for (int p = 0; p < 3; ++p) {
      copy_checked(f.weight[p], weight_data(static_cast<Proj>(p)), t, t, {d.rows[p], d.cols[p]}, &report);
    }
  }
  if (f.in_proj_bias.tensor) copy_checked(f.in_proj_bias, in_bias_.raw(), DType::kF32, t, in_bias_.shape(), &report);
  for (int p = 0; p < 3; ++p) {
    if (f.bias[p].tensor) copy_checked(f.bias[p], bias(static_cast<Proj>(p)).data, DType::kF32, t, {d.rows[p]}, &report);
  }
  if (config_.out_proj) {
    copy_checked(f.weight[3], weight_data(kOut), t, t, {d.rows[3], d.cols[3]}, &report);
    if (f.bias[3].tensor) copy_checked(f.bias[3], bias(kOut).data, DType::kF32, t, {d.rows[3]}, &report);
  }
  // Sinks and QK-norm weights (float32 in every module): required when the module has them,
  // an error when the file has them and the module does not.
  auto extra = [&](const char* name, bool wanted, Tensor& dst) {
    const std::string full = f.prefix + name;
    const auto it = sd.find(full);
    MHA_CHECK(!wanted || it != sd.end(), "weights: '{}' is missing from the file ({}); the module has it", full,
              f.layout);
    MHA_CHECK(wanted || it == sd.end(), "weights: the file has '{}' but the module was built without it (config.{})",
              full, std::string(name) == "sinks" ? "sinks" : "qk_norm");
    if (it == sd.end()) return;
    copy_checked({&it->second, full}, dst.raw(), DType::kF32, DType::kF32, dst.shape(), &report);
    report.ignored.erase(std::remove(report.ignored.begin(), report.ignored.end(), full), report.ignored.end());
  };
  extra("sinks", config_.sinks, sinks_);
  extra("q_norm.weight", config_.qk_norm, q_norm_);
  extra("k_norm.weight", config_.qk_norm, k_norm_);
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
  c.qk_proj_dim = rows[0];
  const int64_t H = base.num_heads;
  MHA_CHECK(rows[0] % H == 0, "weights: query projection width {} is not divisible by num_heads = {}", rows[0], H);
  const int64_t dh = rows[0] / H;
  MHA_CHECK(rows[1] % dh == 0 && H % (rows[1] / dh) == 0,
            "weights: key projection width {} is not a whole number of heads of {} dividing {} heads (query width {})",
            rows[1], dh, H, rows[0]);
  c.num_kv_heads = rows[1] / dh;
  c.v_proj_dim = rows[2] * (H / c.num_kv_heads);
  c.out_proj = f.weight[3].tensor != nullptr;
  if (c.out_proj) {
    const auto s = shape_of(f.weight[3]);
    MHA_CHECK(s.size() == 2 && s[1] == c.v_proj_dim, "weights: '{}' must be (out, {}); got {}", f.weight[3].name, c.v_proj_dim,
              shape_string(s.data(), static_cast<int>(s.size())));
    c.out_dim = s[0];
  }
  c.bias = true;
  c.sinks = sd.count(f.prefix + "sinks") > 0;
  c.qk_norm = sd.count(f.prefix + "q_norm.weight") > 0 || sd.count(f.prefix + "k_norm.weight") > 0;
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
  // Weights in the module's dtype; biases (float32 storage) rounded to it, which is exact.
  auto copy_of = [&](Proj p) {
    Tensor w(c.dtype, {d.rows[p], d.cols[p]});
    std::memcpy(w.raw(), weight_data(p), w.nbytes());
    return w;
  };
  auto bias_of = [&](Proj p) { return to_tensor(bias(p)).converted(c.dtype); };
  const bool all_bias = has_bias_[0] && has_bias_[1] && has_bias_[2];
  const bool none_bias = !has_bias_[0] && !has_bias_[1] && !has_bias_[2];
  const bool torch_mha = c.out_proj && c.out_dim == c.embed_dim && c.qk_proj_dim == c.embed_dim &&
                         c.v_proj_dim == c.embed_dim && c.num_kv_heads == c.num_heads && (all_bias || none_bias) &&
                         has_bias_[3] == all_bias && !c.sinks && !c.qk_norm;
  if (torch_mha) {
    if (packed()) {
      sd.emplace("in_proj_weight", in_weight_.reshaped({d.rows[0] + d.rows[1] + d.rows[2], d.cols[0]}));
    } else {
      sd.emplace("q_proj_weight", copy_of(kQ));
      sd.emplace("k_proj_weight", copy_of(kK));
      sd.emplace("v_proj_weight", copy_of(kV));
    }
    if (all_bias) sd.emplace("in_proj_bias", in_bias_.converted(c.dtype));
    sd.emplace("out_proj.weight", copy_of(kOut));
    if (has_bias_[3]) sd.emplace("out_proj.bias", bias_of(kOut));
    return sd;
  }
  const char* names[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
  for (int p = 0; p < 4; ++p) {
    if (p == kOut && !c.out_proj) continue;
    sd.emplace(std::string(names[p]) + ".weight", copy_of(static_cast<Proj>(p)));
    if (has_bias_[p]) sd.emplace(std::string(names[p]) + ".bias", bias_of(static_cast<Proj>(p)));
  }
  // The names of the models that carry them (gpt-oss, Qwen3), float32 as those store them.
  if (c.sinks) sd.emplace("sinks", sinks_.clone());
  if (c.qk_norm) {
    sd.emplace("q_norm.weight", q_norm_.clone());
    sd.emplace("k_norm.weight", k_norm_.clone());
  }
  return sd;
}

}  // namespace mha
