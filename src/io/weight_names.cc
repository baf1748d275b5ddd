#include "io/weight_names.h"

#include <set>

#include "util/check.h"

namespace mha::io {
namespace {

// Separate Linear layers: "<q>.weight", "<q>.bias", ... ; the first out spelling found wins.
struct LinearSpelling {
  const char* q;
  const char* k;
  const char* v;
  std::vector<const char*> out;
};

const std::vector<LinearSpelling>& linear_spellings() {
  static const std::vector<LinearSpelling> kSpellings = {
      {"q_proj", "k_proj", "v_proj", {"out_proj", "o_proj"}},          // seed 000, HF, fairseq
      {"q_linear", "k_linear", "v_linear", {"out_linear"}},            // seed 002
      {"linear_q", "linear_k", "linear_v", {"linear_out", "linear_o"}},// seed 003, ESPnet
      {"wq", "wk", "wv", {"wo"}},                                      // LLaMA
      {"query", "key", "value", {"out", "output"}},                    // BERT-style
  };
  return kSpellings;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

FoundTensor get(const StateDict& sd, const std::string& name) {
  auto it = sd.find(name);
  return it == sd.end() ? FoundTensor{} : FoundTensor{&it->second, name};
}

// The anchor names whose presence identifies each layout.
std::vector<std::string> anchors() {
  std::vector<std::string> a = {"in_proj_weight", "q_proj_weight"};
  for (const auto& s : linear_spellings()) a.push_back(std::string(s.q) + ".weight");
  return a;
}

FoundWeights find_under(const StateDict& sd, const std::string& prefix) {
  FoundWeights f;
  f.prefix = prefix;
  const std::string& p = prefix;
  for (const char* unsupported : {"bias_k", "bias_v"}) {
    MHA_CHECK(!sd.count(p + unsupported),
              "weights: '{}{}' is present: add_bias_kv is not supported by mha", p, unsupported);
  }
  if (sd.count(p + "in_proj_weight") || sd.count(p + "q_proj_weight")) {
    const bool packed = sd.count(p + "in_proj_weight") > 0;
    f.layout = packed ? "nn.MultiheadAttention (in_proj_weight)"
                      : "nn.MultiheadAttention (q_proj_weight, k_proj_weight, v_proj_weight)";
    if (packed) {
      f.in_proj_weight = get(sd, p + "in_proj_weight");
    } else {
      const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
      for (int i = 0; i < 3; ++i) {
        f.weight[i] = get(sd, p + names[i]);
        MHA_CHECK(f.weight[i].tensor, "weights: '{}{}' is missing (found {}q_proj_weight)", p, names[i], p);
      }
    }
    f.in_proj_bias = get(sd, p + "in_proj_bias");
    f.weight[3] = get(sd, p + "out_proj.weight");
    f.bias[3] = get(sd, p + "out_proj.bias");
    MHA_CHECK(f.weight[3].tensor, "weights: '{}out_proj.weight' is missing (nn.MultiheadAttention layout)", p);
  } else {
    for (const auto& s : linear_spellings()) {
      if (!sd.count(p + s.q + ".weight")) continue;
      const char* names[3] = {s.q, s.k, s.v};
      for (int i = 0; i < 3; ++i) {
        f.weight[i] = get(sd, p + names[i] + ".weight");
        f.bias[i] = get(sd, p + names[i] + ".bias");
        MHA_CHECK(f.weight[i].tensor, "weights: '{}{}.weight' is missing (found {}{}.weight)", p, names[i], p,
                  s.q);
      }
      std::string out_name;
      for (const char* o : s.out) {
        if (sd.count(p + o + ".weight")) {
          f.weight[3] = get(sd, p + o + ".weight");
          f.bias[3] = get(sd, p + o + ".bias");
          out_name = o;
          break;
        }
      }
      f.layout = fmt::format("Linear layers {}, {}, {}{}", s.q, s.k, s.v,
                             out_name.empty() ? " (no output projection)" : ", " + out_name);
      break;
    }
  }
  if (f.layout.empty()) return f;

  std::set<std::string> used;
  for (const FoundTensor* t : {&f.in_proj_weight, &f.in_proj_bias}) used.insert(t->name);
  for (int i = 0; i < 4; ++i) used.insert(f.weight[i].name), used.insert(f.bias[i].name);
  for (const auto& [name, tensor] : sd) {
    if (!used.count(name)) f.ignored.push_back(name);
  }
  return f;
}

}  // namespace

FoundWeights find_weights(const StateDict& sd, const std::string& prefix) {
  if (!prefix.empty()) {
    FoundWeights f = find_under(sd, prefix);
    MHA_CHECK(!f.layout.empty(),
              "weights: no attention weights under prefix '{}' (looked for {}in_proj_weight, "
              "{}q_proj.weight, {}q_linear.weight, {}linear_q.weight, ...)",
              prefix, prefix, prefix, prefix, prefix);
    return f;
  }
  // Every prefix under which an anchor name appears.
  std::set<std::string> prefixes;
  for (const auto& [name, tensor] : sd) {
    for (const std::string& a : anchors()) {
      if (name == a) prefixes.insert("");
      if (ends_with(name, "." + a)) prefixes.insert(name.substr(0, name.size() - a.size()));
    }
  }
  MHA_CHECK(!prefixes.empty(),
            "weights: no attention weights recognised among {} tensors; expected nn.MultiheadAttention's "
            "in_proj_weight/out_proj.weight, or Linear layers named q_proj/k_proj/v_proj[/out_proj], "
            "q_linear/k_linear/v_linear[/out_linear], linear_q/linear_k/linear_v, wq/wk/wv[/wo] or "
            "query/key/value",
            sd.size());
  if (prefixes.size() > 1) {
    std::string list;
    for (const auto& p : prefixes) list += (list.empty() ? "'" : ", '") + p + "'";
    throw Error("weights: several attention modules found (prefixes " + list + "); choose one with a prefix");
  }
  return find_under(sd, *prefixes.begin());
}

}  // namespace mha::io
