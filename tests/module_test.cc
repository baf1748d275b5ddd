// MultiHeadAttention: equivalences between its paths and layouts, GQA, dropout, threads.
#include <gtest/gtest.h>

#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

MultiHeadAttentionConfig cfg(int64_t E, int64_t H) {
  MultiHeadAttentionConfig c;
  c.embed_dim = E;
  c.num_heads = H;
  return c;
}

Tensor run(const MultiHeadAttention& m, const Tensor& q, const Tensor* kv = nullptr, const MhaCallOptions& options = {}) {
  MhaInputs in;
  in.query = q.view<float>();
  if (kv) in.key = in.value = kv->view<float>();
  return m.forward(in, options).output;
}

TEST(Module, PackedSelfAttentionEqualsTheCrossAttentionPath) {
  MultiHeadAttention m(cfg(48, 6), 3);
  Rng rng(base_seed());
  const Tensor x = random_tensor(rng, {3, 13, 48});
  const Tensor copy = x.clone();  // another pointer: takes the three-GEMM path
  const Tensor a = run(m, x), b = run(m, x, &copy);
  EXPECT_LE(rel_error(a.view<float>(), b.view<float>()), 1e-6);
}

TEST(Module, SequenceFirstLayoutMatchesBatchFirst) {
  auto c = cfg(32, 4);
  MultiHeadAttention bf(c, 5);
  c.batch_first = false;
  MultiHeadAttention sf(c, 5);
  Rng rng(base_seed() + 1);
  const Tensor x = random_tensor(rng, {2, 9, 32});
  const Tensor xt = to_tensor(x.view<float>().transposed(0, 1));  // (T, B, E)
  const Tensor a = run(bf, x), b = run(sf, xt);
  const Tensor bt = to_tensor(b.view<float>().transposed(0, 1));
  EXPECT_LE(rel_error(a.view<float>(), bt.view<float>()), 1e-6);
}

TEST(Module, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  // 8 query heads sharing 2 kv heads == 8 heads whose k/v weights repeat each kv head 4 times.
  auto c = cfg(32, 8);
  c.num_kv_heads = 2;
  MultiHeadAttention gqa(c, 11);
  MultiHeadAttention full(cfg(32, 8), 12);
  const int64_t dh = 4;
  for (auto p : {MultiHeadAttention::kQ, MultiHeadAttention::kOut}) {
    auto src = gqa.weight(p), dst = full.weight(p);
    std::copy(src.data, src.data + src.numel(), dst.data);
    auto sb = gqa.bias(p), db = full.bias(p);
    std::copy(sb.data, sb.data + sb.numel(), db.data);
  }
  for (auto p : {MultiHeadAttention::kK, MultiHeadAttention::kV}) {
    auto src = gqa.weight(p), dst = full.weight(p);
    auto sb = gqa.bias(p), db = full.bias(p);
    for (int64_t h = 0; h < 8; ++h)
      for (int64_t r = 0; r < dh; ++r) {
        const int64_t from = (h / 4) * dh + r, to = h * dh + r;
        std::copy(src.data + from * 32, src.data + (from + 1) * 32, dst.data + to * 32);
        db.data[to] = sb.data[from];
      }
  }
  Rng rng(base_seed() + 2);
  const Tensor x = random_tensor(rng, {2, 10, 32});
  EXPECT_LE(rel_error(run(gqa, x).view<float>(), run(full, x).view<float>()), 1e-6);
}

TEST(Module, StateDictRoundTripGivesTheSameBits) {
  for (bool packed : {true, false}) {
    auto c = cfg(24, 3);
    if (!packed) c.kdim = 16, c.vdim = 20;
    MultiHeadAttention m(c, 21);
    const std::string bytes = serialize_safetensors(m.state_dict());
    const SafetensorsFile f = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    MultiHeadAttention back = MultiHeadAttention::from_state_dict(f.tensors, cfg(0, 3));
    Rng rng(base_seed() + 3);
    const Tensor q = random_tensor(rng, {2, 5, 24});
    const Tensor k = random_tensor(rng, {2, 7, packed ? 24 : 16}), v = random_tensor(rng, {2, 7, packed ? 24 : 20});
    MhaInputs in;
    in.query = q.view<float>();
    in.key = k.view<float>();
    in.value = v.view<float>();
    EXPECT_TRUE(bitwise_equal(m.forward(in).output, back.forward(in).output));
  }
}

TEST(Module, SameBitsForOneAndTwoThreads) {
  auto c = cfg(64, 8);
  c.causal = Causal::kTopLeft;
  c.attn_dropout = 0.2f;
  c.out_dropout = 0.1f;
  MultiHeadAttention m(c, 31);
  Rng rng(base_seed() + 4);
  const Tensor x = random_tensor(rng, {3, 300, 64});  // several GEMM tiles
  MhaInputs in;
  in.query = x.view<float>();
  MhaCallOptions options;
  options.training = true;
  options.dropout_seed = 99;
  options.need_weights = true;
  options.num_threads = 1;
  const MhaOutputs a = m.forward(in, options);
  options.num_threads = 2;
  const MhaOutputs b = m.forward(in, options);
  EXPECT_TRUE(bitwise_equal(a.output, b.output));
  EXPECT_TRUE(bitwise_equal(a.weights, b.weights));
}

TEST(Module, DropoutOnlyInTrainingAndSeeded) {
  auto c = cfg(32, 4);
  c.attn_dropout = 0.3f;
  c.out_dropout = 0.3f;
  MultiHeadAttention m(c, 41);
  Rng rng(base_seed() + 5);
  const Tensor x = random_tensor(rng, {2, 8, 32});
  MhaInputs in;
  in.query = x.view<float>();
  const Tensor eval1 = m.forward(in).output, eval2 = m.forward(in).output;
  EXPECT_TRUE(bitwise_equal(eval1, eval2));
  MhaCallOptions train;
  train.training = true;
  train.dropout_seed = 1;
  const Tensor t1 = m.forward(in, train).output, t1b = m.forward(in, train).output;
  train.dropout_seed = 2;
  const Tensor t2 = m.forward(in, train).output;
  EXPECT_TRUE(bitwise_equal(t1, t1b));
  EXPECT_FALSE(bitwise_equal(t1, t2));
  EXPECT_FALSE(bitwise_equal(t1, eval1));
  // Without a seed each call draws the next one from the module's counter.
  train.dropout_seed.reset();
  EXPECT_FALSE(bitwise_equal(m.forward(in, train).output, m.forward(in, train).output));
  // An evaluation call between training calls is unaffected by them.
  EXPECT_TRUE(bitwise_equal(m.forward(in).output, eval1));
}

TEST(Module, ReferenceBackendAgrees) {
  auto c = cfg(40, 5);
  c.causal = Causal::kTopLeft;
  const MultiHeadAttention m(c, 51);
  MhaCallOptions ref;
  ref.backend = Backend::kReference;
  Rng rng(base_seed() + 6);
  const Tensor x = random_tensor(rng, {2, 17, 40});
  EXPECT_LE(rel_error(run(m, x).view<float>(), run(m, x, nullptr, ref).view<float>()), 1e-5);
}

TEST(Module, CausalPerCallEqualsTheConfiguredCausalModule) {
  auto c = cfg(32, 4);
  const MultiHeadAttention plain(c, 53);
  c.causal = Causal::kTopLeft;
  const MultiHeadAttention causal(c, 53);
  Rng rng(base_seed() + 9);
  const Tensor x = random_tensor(rng, {2, 19, 32});
  MhaCallOptions is_causal;
  is_causal.causal = Causal::kTopLeft;
  EXPECT_TRUE(bitwise_equal(run(plain, x, nullptr, is_causal), run(causal, x)));
  MhaCallOptions not_causal;
  not_causal.causal = Causal::kNone;
  EXPECT_TRUE(bitwise_equal(run(causal, x, nullptr, not_causal), run(plain, x)));
  EXPECT_FALSE(bitwise_equal(run(plain, x), run(causal, x)));
}

TEST(Module, KeyLengthsEqualSuffixPadding) {
  MultiHeadAttention m(cfg(16, 2), 61);
  Rng rng(base_seed() + 7);
  const Tensor x = random_tensor(rng, {2, 6, 16});
  Tensor len(DType::kI64, {2}), kpm(DType::kU8, {2, 6});
  len.data<int64_t>()[0] = 4;
  len.data<int64_t>()[1] = 6;
  for (int64_t j = 4; j < 6; ++j) kpm.data<uint8_t>()[j] = 1;
  MhaInputs a, b;
  a.query = b.query = x.view<float>();
  a.key_lengths = len.view<int64_t>();
  b.key_padding_mask = kpm.view<uint8_t>();
  MhaCallOptions weights;
  weights.need_weights = true;
  const MhaOutputs ra = m.forward(a, weights), rb = m.forward(b, weights);
  EXPECT_TRUE(bitwise_equal(ra.output, rb.output));
  EXPECT_TRUE(bitwise_equal(ra.weights, rb.weights));
}

TEST(Module, AveragedWeightsAreTheMeanOverHeads) {
  MultiHeadAttention m(cfg(24, 4), 71);
  Rng rng(base_seed() + 8);
  const Tensor x = random_tensor(rng, {2, 5, 24});
  MhaInputs in;
  in.query = x.view<float>();
  MhaCallOptions options;
  options.need_weights = true;
  options.average_weights = false;
  const Tensor per_head = m.forward(in, options).weights;
  options.average_weights = true;
  const Tensor avg = m.forward(in, options).weights;
  ASSERT_EQ(avg.shape(), (std::vector<int64_t>{2, 5, 5}));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 25; ++i) {
      double s = 0;
      for (int64_t h = 0; h < 4; ++h) s += per_head.data<float>()[(b * 4 + h) * 25 + i];
      EXPECT_NEAR(avg.data<float>()[b * 25 + i], s / 4, 1e-7);
    }
}

}  // namespace
}  // namespace mha::test
