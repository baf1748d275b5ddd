// Bad input to attention() and MultiHeadAttention: an mha::Error whose message names the
// argument and the shapes, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "mha/attention.h"
#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

struct Buffers {
  Tensor q, k, v, out, lse, w;
  AttentionInputs in;
  AttentionOutputs outs;
  Buffers(std::vector<int64_t> qs = {2, 4, 5, 8}, std::vector<int64_t> ks = {2, 2, 6, 8},
          std::vector<int64_t> vs = {2, 2, 6, 3}) {
    Rng rng(1);
    q = random_tensor(rng, qs);
    k = random_tensor(rng, ks);
    v = random_tensor(rng, vs);
    out = Tensor(DType::kF32, {qs[0], qs[1], qs[2], vs[3]});
    in = {q.view<float>(), k.view<float>(), v.view<float>()};
    outs.out = out.view<float>();
  }
  void run(const AttentionOptions& opt = {}) { attention(in, outs, opt); }
};

TEST(AttentionErrors, ShapesAndRanks) {
  {
    Buffers b;
    b.in.query = View<const float>(b.q.data<float>(), {2, 4, 40});
    expect_error([&] { b.run(); }, {"query", "4-D", "(2, 4, 40)"});
  }
  {
    Buffers b({2, 4, 5, 8}, {3, 2, 6, 8}, {3, 2, 6, 3});
    expect_error([&] { b.run(); }, {"batch", "key (3, 2, 6, 8)"});
  }
  {
    Buffers b({2, 4, 5, 8}, {2, 2, 6, 8}, {2, 1, 6, 3});
    expect_error([&] { b.run(); }, {"key and value", "heads", "value (2, 1, 6, 3)"});
  }
  {
    Buffers b({2, 4, 5, 8}, {2, 2, 6, 8}, {2, 2, 7, 3});
    expect_error([&] { b.run(); }, {"same length", "value (2, 2, 7, 3)"});
  }
  {
    Buffers b({2, 4, 5, 8}, {2, 2, 6, 7}, {2, 2, 6, 3});
    expect_error([&] { b.run(); }, {"head dim", "query (2, 4, 5, 8)", "key (2, 2, 6, 7)"});
  }
  {
    Buffers b({2, 4, 5, 8}, {2, 3, 6, 8}, {2, 3, 6, 3});
    expect_error([&] { b.run(); }, {"3 heads", "does not divide", "4 heads"});
  }
  {
    Buffers b({2, 4, 5, 0}, {2, 2, 6, 0}, {2, 2, 6, 3});
    expect_error([&] { b.run(); }, {"head dim must be at least 1"});
  }
}

TEST(AttentionErrors, Masks) {
  Buffers b;
  Tensor m(DType::kU8, {5, 7});
  b.in.keep_mask = m.view<uint8_t>();
  expect_error([&] { b.run(); }, {"keep_mask", "(5, 7)", "(2, 4, 5, 6)"});
  b.in.keep_mask = {};
  Tensor bias(DType::kF32, {3, 1, 1, 6});
  b.in.attn_bias = bias.view<float>();
  expect_error([&] { b.run(); }, {"bias", "(3, 1, 1, 6)", "broadcast"});
  b.in.attn_bias = {};
  {  // Against one key a mask's last dimension may only be 1: the message says so, not "1 or 1".
    Buffers one({2, 4, 5, 8}, {2, 2, 1, 8}, {2, 2, 1, 3});
    Tensor wide(DType::kF32, {5, 2});
    one.in.attn_bias = wide.view<float>();
    expect_error([&] { one.run(); }, {"attn_bias of shape (5, 2)", "(2, 4, 5, 1)", "dimension 1 is 2, expected 1"});
    try {
      one.run();
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("or 1"), std::string::npos) << e.what();
    }
    Tensor tall(DType::kF32, {3, 1});
    one.in.attn_bias = tall.view<float>();
    expect_error([&] { one.run(); }, {"dimension 0 is 3, expected 5 or 1"});
  }
  Tensor len(DType::kI64, {3});
  b.in.key_lengths = len.view<int64_t>();
  expect_error([&] { b.run(); }, {"key_lengths", "(2,)", "(3,)"});
  Tensor len2(DType::kI64, {2});
  len2.data<int64_t>()[1] = 7;
  b.in.key_lengths = len2.view<int64_t>();
  expect_error([&] { b.run(); }, {"key_lengths[1] = 7", "Tk = 6"});
  len2.data<int64_t>()[1] = -1;
  expect_error([&] { b.run(); }, {"key_lengths[1] = -1"});
}

TEST(AttentionErrors, OutputsAndOptions) {
  {
    Buffers b;
    Tensor bad(DType::kF32, {2, 4, 5, 8});
    b.outs.out = bad.view<float>();
    expect_error([&] { b.run(); }, {"out", "(2, 4, 5, 3)", "(2, 4, 5, 8)"});
  }
  {
    Buffers b;
    b.outs.out = {};
    expect_error([&] { b.run(); }, {"out is required"});
  }
  {
    Buffers b;
    Tensor lse(DType::kF32, {2, 4, 6});
    b.outs.lse = lse.view<float>();
    expect_error([&] { b.run(); }, {"lse", "(2, 4, 5)", "(2, 4, 6)"});
  }
  {
    Buffers b;
    Tensor w(DType::kF32, {2, 4, 5, 5});
    b.outs.weights = w.view<float>();
    expect_error([&] { b.run(); }, {"weights", "(2, 4, 5, 6)", "(2, 5, 6)", "(2, 4, 5, 5)"});
  }
  {
    Buffers b;
    AttentionOptions opt;
    opt.dropout_p = 1.5f;
    expect_error([&] { b.run(opt); }, {"dropout_p", "1.5"});
    opt.dropout_p = std::nanf("");
    expect_error([&] { b.run(opt); }, {"dropout_p"});
  }
  {
    Buffers b;
    AttentionOptions opt;
    opt.window = 4;
    expect_error([&] { b.run(opt); }, {"window", "causal"});
    opt.window = -1;
    opt.causal = Causal::kTopLeft;
    expect_error([&] { b.run(opt); }, {"window", "-1"});
  }
  {
    Buffers b;
    AttentionOptions opt;
    opt.scale = std::numeric_limits<float>::infinity();
    expect_error([&] { b.run(opt); }, {"scale", "finite"});
  }
  {
    Buffers b;
    b.outs.out = View<float>(b.q.data<float>(), {2, 4, 5, 3});  // writes over the query
    expect_error([&] { b.run(); }, {"out", "overlaps", "query"});
  }
  {
    Buffers b;
    b.in.key = View<const float>(nullptr, {2, 2, 6, 8});
    expect_error([&] { b.run(); }, {"key", "null"});
  }
}

MultiHeadAttentionConfig config(int64_t E, int64_t H) {
  MultiHeadAttentionConfig c;
  c.embed_dim = E;
  c.num_heads = H;
  return c;
}

TEST(ModuleErrors, Configuration) {
  expect_error([] { MultiHeadAttention m(config(30, 4)); }, {"qk_proj_dim", "30", "num_heads = 4"});
  auto c = config(32, 4);
  c.num_kv_heads = 3;
  expect_error([&] { MultiHeadAttention m(c); }, {"num_kv_heads = 3", "num_heads = 4"});
  c = config(32, 4);
  c.v_proj_dim = 30;
  expect_error([&] { MultiHeadAttention m(c); }, {"v_proj_dim", "30"});
  expect_error([] { MultiHeadAttention m(config(0, 4)); }, {"embed_dim", "0"});
  c = config(32, 4);
  c.attn_dropout = -0.1f;
  expect_error([&] { MultiHeadAttention m(c); }, {"attn_dropout"});
}

TEST(ModuleErrors, Inputs) {
  auto c = config(32, 4);
  c.max_seq_len = 10;
  MultiHeadAttention m(c);
  Rng rng(3);
  Tensor x = random_tensor(rng, {2, 11, 32});
  MhaInputs in;
  in.query = x.view<float>();
  expect_error([&] { m.forward(in); }, {"11", "max_seq_len", "block_size", "10"});

  Tensor bad = random_tensor(rng, {2, 5, 31});
  in.query = bad.view<float>();
  expect_error([&] { m.forward(in); }, {"query", "E = 32", "(2, 5, 31)"});

  Tensor good = random_tensor(rng, {2, 5, 32});
  in.query = good.view<float>();
  in.key = good.view<float>();
  expect_error([&] { m.forward(in); }, {"key and value"});

  in.key = {};
  Tensor kpm(DType::kU8, {2, 6});
  in.key_padding_mask = kpm.view<uint8_t>();
  expect_error([&] { m.forward(in); }, {"key_padding_mask", "(2, 5)", "(2, 6)"});

  in.key_padding_mask = {};
  Tensor k = random_tensor(rng, {3, 7, 32});
  in.key = k.view<float>();
  in.value = k.view<float>();
  expect_error([&] { m.forward(in); }, {"batch", "(3, 7, 32)"});

  auto cc = config(32, 4);
  cc.kdim = 16;
  MultiHeadAttention cross(cc);
  MhaInputs self;
  self.query = good.view<float>();
  expect_error([&] { cross.forward(self); }, {"self-attention", "kdim = 16"});

  Tensor mask(DType::kU8, {4, 5, 4});
  in.key = {};
  in.value = {};
  in.keep_mask = mask.view<uint8_t>();
  expect_error([&] { m.forward(in); }, {"keep_mask", "(4, 5, 4)"});
}

}  // namespace
}  // namespace mha::test
