// Recognising weights by name: every supported spelling, prefixes, extra and missing tensors.
#include <gtest/gtest.h>

#include <functional>

#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

Tensor ones(std::vector<int64_t> shape, float value = 1.0f) {
  Tensor t(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value;
  return t;
}

MultiHeadAttentionConfig heads(int64_t H) {
  MultiHeadAttentionConfig c;
  c.num_heads = H;
  return c;
}

void expect_error(const std::function<void()>& f, const std::string& words) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "no error; expected: " << words;
}

TEST(Weights, EverySeparateLinearSpellingLoads) {
  const std::vector<std::vector<std::string>> spellings = {
      {"q_proj", "k_proj", "v_proj", "out_proj"}, {"q_proj", "k_proj", "v_proj", "o_proj"},
      {"q_linear", "k_linear", "v_linear", "out_linear"}, {"linear_q", "linear_k", "linear_v", ""},
      {"wq", "wk", "wv", "wo"}, {"query", "key", "value", ""}};
  for (const auto& s : spellings) {
    StateDict sd;
    for (int p = 0; p < 3; ++p) {
      sd.emplace(s[p] + ".weight", ones({8, 8}, static_cast<float>(p + 1)));
      sd.emplace(s[p] + ".bias", ones({8}, static_cast<float>(p + 10)));
    }
    if (!s[3].empty()) sd.emplace(s[3] + ".weight", ones({8, 8}, 4.0f));
    LoadReport report;
    MultiHeadAttention m = MultiHeadAttention::from_state_dict(sd, heads(2), &report);
    EXPECT_EQ(m.config().out_proj, !s[3].empty()) << s[0];
    EXPECT_FALSE(m.has_bias(MultiHeadAttention::kOut));
    EXPECT_EQ(m.weight(MultiHeadAttention::kK).data[0], 2.0f) << s[0];
    EXPECT_EQ(m.bias(MultiHeadAttention::kV).data[0], 12.0f) << s[0];
    EXPECT_TRUE(report.ignored.empty()) << s[0];
  }
}

TEST(Weights, TorchMultiheadAttentionNamesAndPrefixes) {
  StateDict sd;
  sd.emplace("encoder.layers.0.self_attn.in_proj_weight", ones({24, 8}));
  sd.emplace("encoder.layers.0.self_attn.in_proj_bias", ones({24}));
  sd.emplace("encoder.layers.0.self_attn.out_proj.weight", ones({8, 8}));
  sd.emplace("encoder.layers.0.self_attn.out_proj.bias", ones({8}));
  sd.emplace("encoder.layers.0.norm.weight", ones({8}));
  LoadReport report;
  MultiHeadAttention m = MultiHeadAttention::from_state_dict(sd, heads(2), &report);
  EXPECT_EQ(report.layout, "nn.MultiheadAttention (in_proj_weight)");
  ASSERT_EQ(report.ignored.size(), 1u);
  EXPECT_EQ(report.ignored[0], "encoder.layers.0.norm.weight");
  // state_dict() writes the same names back (without the prefix).
  const StateDict out = m.state_dict();
  for (const char* n : {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}) EXPECT_TRUE(out.count(n)) << n;

  // Two modules: a prefix is needed.
  sd.emplace("decoder.attn.in_proj_weight", ones({24, 8}));
  sd.emplace("decoder.attn.out_proj.weight", ones({8, 8}));
  expect_error([&] { MultiHeadAttention::from_state_dict(sd, heads(2)); }, "several attention modules");
  MultiHeadAttention d = MultiHeadAttention::from_state_dict(sd, heads(2), nullptr, "decoder.attn.");
  EXPECT_FALSE(d.config().bias);
}

TEST(Weights, KdimVdimSeparateProjectionWeights) {
  StateDict sd;
  sd.emplace("q_proj_weight", ones({8, 8}));
  sd.emplace("k_proj_weight", ones({8, 6}));
  sd.emplace("v_proj_weight", ones({8, 10}));
  sd.emplace("in_proj_bias", ones({24}));
  sd.emplace("out_proj.weight", ones({8, 8}));
  sd.emplace("out_proj.bias", ones({8}));
  MultiHeadAttention m = MultiHeadAttention::from_state_dict(sd, heads(4));
  EXPECT_EQ(m.config().kdim, 6);
  EXPECT_EQ(m.config().vdim, 10);
  const StateDict out = m.state_dict();
  EXPECT_TRUE(out.count("k_proj_weight"));
}

TEST(Weights, GroupedQueryHeadsAreInferred) {
  StateDict sd;
  sd.emplace("q_proj.weight", ones({16, 16}));  // 8 heads of 2
  sd.emplace("k_proj.weight", ones({4, 16}));   // 2 kv heads
  sd.emplace("v_proj.weight", ones({6, 16}));   // 2 kv heads of 3
  sd.emplace("o_proj.weight", ones({16, 24}));
  MultiHeadAttention m = MultiHeadAttention::from_state_dict(sd, heads(8));
  EXPECT_EQ(m.config().num_kv_heads, 2);
  EXPECT_EQ(m.config().v_proj_dim, 24);
  EXPECT_EQ(m.head_dim_v(), 3);
}

TEST(Weights, MissingMisshapedAndUnsupportedTensorsAreErrors) {
  StateDict sd;
  sd.emplace("q_proj.weight", ones({8, 8}));
  sd.emplace("v_proj.weight", ones({8, 8}));
  expect_error([&] { MultiHeadAttention::from_state_dict(sd, heads(2)); }, "'k_proj.weight' is missing");

  sd.emplace("k_proj.weight", ones({8, 8}));
  sd.emplace("out_proj.weight", ones({8, 7}));
  expect_error([&] { MultiHeadAttention::from_state_dict(sd, heads(2)); }, "out_proj.weight");

  StateDict mha;
  mha.emplace("in_proj_weight", ones({24, 8}));
  mha.emplace("out_proj.weight", ones({8, 8}));
  mha.emplace("bias_k", ones({1, 1, 8}));
  expect_error([&] { MultiHeadAttention::from_state_dict(mha, heads(2)); }, "add_bias_kv");

  StateDict none;
  none.emplace("fc.weight", ones({8, 8}));
  expect_error([&] { MultiHeadAttention::from_state_dict(none, heads(2)); }, "no attention weights recognised");

  // load_state_dict into an existing module checks shapes and bias presence.
  MultiHeadAttentionConfig c;
  c.embed_dim = 8;
  c.num_heads = 2;
  MultiHeadAttention m(c);
  StateDict wrong;
  wrong.emplace("in_proj_weight", ones({24, 4}));
  wrong.emplace("in_proj_bias", ones({24}));
  wrong.emplace("out_proj.weight", ones({8, 8}));
  wrong.emplace("out_proj.bias", ones({8}));
  expect_error([&] { m.load_state_dict(wrong); }, "'in_proj_weight' has shape (24, 4), expected (24, 8)");
  wrong.erase("out_proj.bias");
  expect_error([&] { m.load_state_dict(wrong); }, "out projection's bias is missing");

  Tensor ints(DType::kI64, {24, 8});
  StateDict typed;
  typed.emplace("in_proj_weight", std::move(ints));
  typed.emplace("in_proj_bias", ones({24}));
  typed.emplace("out_proj.weight", ones({8, 8}));
  typed.emplace("out_proj.bias", ones({8}));
  expect_error([&] { m.load_state_dict(typed); }, "dtype I64");
}

TEST(Weights, HalfPrecisionWeightsAreConverted) {
  StateDict sd;
  for (const char* n : {"wq.weight", "wk.weight", "wv.weight"}) {
    Tensor t(DType::kBF16, {4, 4});
    for (int64_t i = 0; i < 16; ++i) static_cast<uint16_t*>(t.raw())[i] = 0x3FC0;  // 1.5
    sd.emplace(n, std::move(t));
  }
  LoadReport report;
  MultiHeadAttention m = MultiHeadAttention::from_state_dict(sd, heads(1), &report);
  EXPECT_EQ(report.converted.size(), 3u);
  EXPECT_EQ(m.weight(MultiHeadAttention::kQ).data[5], 1.5f);
}

}  // namespace
}  // namespace mha::test
