// mha forward: weights + inputs from safetensors files, outputs to a safetensors file.
#include <fmt/format.h>

#include <cstdio>
#include <set>

#include "mha/multi_head_attention.h"
#include "mha/safetensors.h"
#include "tools/commands.h"
#include "util/check.h"

namespace mha::tools {
namespace {

const Tensor* find(const StateDict& sd, const char* name) {
  auto it = sd.find(name);
  return it == sd.end() ? nullptr : &it->second;
}

View<const float> float_input(const StateDict& sd, const char* name, int rank_lo, int rank_hi) {
  const Tensor* t = find(sd, name);
  if (!t) return {};
  MHA_CHECK(t->dtype() == DType::kF32, "input: '{}' has dtype {}; it must be F32", name, dtype_name(t->dtype()));
  MHA_CHECK(t->rank() >= rank_lo && t->rank() <= rank_hi, "input: '{}' must have {} to {} dimensions; got {}", name,
            rank_lo, rank_hi, shape_string(t->shape().data(), t->rank()));
  return t->view<float>();
}

View<const uint8_t> mask_input(const StateDict& sd, const char* name, int rank_lo, int rank_hi) {
  const Tensor* t = find(sd, name);
  if (!t) return {};
  MHA_CHECK(t->dtype() == DType::kBool || t->dtype() == DType::kU8, "input: '{}' has dtype {}; it must be BOOL or U8",
            name, dtype_name(t->dtype()));
  MHA_CHECK(t->rank() >= rank_lo && t->rank() <= rank_hi, "input: '{}' must have {} to {} dimensions; got {}", name,
            rank_lo, rank_hi, shape_string(t->shape().data(), t->rank()));
  return t->view<uint8_t>();
}

}  // namespace

int run_forward(const ForwardArgs& args) {
  const SafetensorsFile weights = read_safetensors(args.weights);
  const SafetensorsFile input = read_safetensors(args.input);

  const std::set<std::string> known = {"x", "query", "key", "value", "keep_mask", "attn_bias", "key_padding_mask"};
  for (const auto& [name, t] : input.tensors) {
    MHA_CHECK(known.count(name),
              "input: unknown tensor '{}' in '{}' (expected x, or query, key, value; optional keep_mask, attn_bias, "
              "key_padding_mask)",
              name, args.input);
  }
  const bool has_x = find(input.tensors, "x") != nullptr;
  const bool has_q = find(input.tensors, "query") != nullptr;
  MHA_CHECK(has_x != has_q, "input: '{}' must hold either 'x' (self-attention) or 'query', 'key', 'value'", args.input);

  MultiHeadAttentionConfig base;
  base.num_heads = args.heads;
  base.causal = !args.causal ? Causal::kNone
                : args.causal_align == "bottom-right" ? Causal::kBottomRight
                                                      : Causal::kTopLeft;
  base.batch_first = !args.seq_first;
  LoadReport report;
  MultiHeadAttention module = MultiHeadAttention::from_state_dict(weights.tensors, base, &report, args.prefix);
  if (args.kv_heads > 0) {
    MHA_CHECK(module.config().num_kv_heads == args.kv_heads,
              "--kv-heads {} disagrees with the weights, which have {} key/value heads", args.kv_heads,
              module.config().num_kv_heads);
  }
  // Names come from the file: printed escaped, as every error message is.
  for (const auto& name : report.ignored)
    std::fprintf(stderr, "mha: note: ignored '%s' in the weights\n", printable(name).c_str());
  for (const auto& name : report.converted)
    std::fprintf(stderr, "mha: note: converted '%s' to F32\n", printable(name).c_str());

  MhaInputs in;
  if (has_x) {
    in.query = float_input(input.tensors, "x", 3, 3);
  } else {
    in.query = float_input(input.tensors, "query", 3, 3);
    in.key = float_input(input.tensors, "key", 3, 3);
    in.value = float_input(input.tensors, "value", 3, 3);
    MHA_CHECK(in.key.given() && in.value.given(), "input: 'query' needs 'key' and 'value' too");
  }
  in.keep_mask = mask_input(input.tensors, "keep_mask", 1, 4);
  in.attn_bias = float_input(input.tensors, "attn_bias", 1, 4);
  in.key_padding_mask = mask_input(input.tensors, "key_padding_mask", 2, 2);
  MhaCallOptions options;
  options.need_weights = args.need_weights;
  options.average_weights = args.average_weights;
  options.num_threads = args.threads;
  if (args.reference) options.backend = Backend::kReference;
  MhaOutputs out = module.forward(in, options);

  StateDict result;
  result.emplace("output", std::move(out.output));
  if (args.need_weights) result.emplace("attn_weights", std::move(out.weights));
  write_safetensors(args.output, result);
  const Tensor& o = result.at("output");
  std::printf("mha forward: %s, %lld heads -> output %s%s\n", report.layout.c_str(),
              static_cast<long long>(args.heads), shape_string(o.shape().data(), o.rank()).c_str(),
              args.need_weights ? " and attn_weights" : "");
  return 0;
}

}  // namespace mha::tools
