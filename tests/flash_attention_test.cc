// The fast attention kernels against the float64 reference, on every SIMD target compiled in.
// Bound (docs/numerics.md): err(fast) <= 2 · err(plain float32) + 4u, errors norm-wise relative
// to the float64 reference, u = 2^-24.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>

#include "kernels/cpu/flash.h"
#include "kernels/workspace.h"
#include "kernels/ref/attention_ref.h"
#include "mha/attention.h"
#include "ops/attention_checks.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr double kU = 1.0 / (1 << 24);
constexpr float kInf = std::numeric_limits<float>::infinity();

// Runs every test body once per SIMD target (AVX3, AVX2, SCALAR ...), restoring the default.
class FlashTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { kernels::force_simd_target(GetParam()); }
  void TearDown() override { kernels::force_simd_target(""); }
};

std::string target_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

struct Problem {
  int64_t B = 1, Hq = 2, Hkv = 2, Tq = 1, Tk = 1, D = 8, Dv = 8;
  bool bthd = false;  // (B, T, H, D) memory seen through strides
  Tensor q, k, v, keep, bias, lengths, alibi, sinks;
  AttentionInputs in;
  AttentionOptions opt;

  void add_variants(Rng& rng, double chance) {
    add_score_variants(rng, chance, B, Hq, 2.0f, in, opt, &alibi, &sinks);
  }

  void make(Rng& rng) {
    auto view = [&](int64_t H, int64_t T, int64_t Dd, Tensor* t) {
      if (!bthd) {
        *t = random_tensor(rng, {B, H, T, Dd});
        return View<const float>(t->data<float>(), {B, H, T, Dd});
      }
      *t = random_tensor(rng, {B, T, H, Dd});
      return View<const float>(t->data<float>(), {B, H, T, Dd}, {T * H * Dd, Dd, H * Dd, 1});
    };
    in.query = view(Hq, Tq, D, &q);
    in.key = view(Hkv, Tk, D, &k);
    in.value = view(Hkv, Tk, Dv, &v);
  }
  std::string describe() const {
    char buf[200];
    std::snprintf(buf, sizeof buf, "B=%ld Hq=%ld Hkv=%ld Tq=%ld Tk=%ld D=%ld Dv=%ld causal=%d window=%ld sinks=%ld drop=%g",
                  (long)B, (long)Hq, (long)Hkv, (long)Tq, (long)Tk, (long)D, (long)Dv, (int)opt.causal,
                  (long)opt.window, (long)opt.sink_tokens, opt.dropout_p);
    return buf + std::string(in.keep_mask.given() ? " keep" : "") + (in.attn_bias.given() ? " bias" : "") +
           (in.key_lengths.given() ? " lengths" : "") + (bthd ? " bthd" : "") + (opt.softcap > 0 ? " softcap" : "") +
           (in.alibi_slopes.given() ? " alibi" : "") + (in.sinks.given() ? " sinks" : "");
  }
};

struct Outputs {
  Tensor out, lse, weights;
  Outputs(const Problem& p, int weights_rank) {
    out = Tensor(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv});
    lse = Tensor(DType::kF32, {p.B, p.Hq, p.Tq});
    if (weights_rank == 4) weights = Tensor(DType::kF32, {p.B, p.Hq, p.Tq, p.Tk});
    if (weights_rank == 3) weights = Tensor(DType::kF32, {p.B, p.Tq, p.Tk});
  }
  AttentionOutputs views() {
    return {out.view<float>(), lse.view<float>(), weights.defined() ? weights.view<float>() : View<float>()};
  }
};

// The reference templated on float: the plain float32 implementation.
void run_plain(const Problem& pr, Outputs& o) {
  const kernels::AttentionParams p = ops::make_attention_params(pr.in, o.views(), pr.opt);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.q_len; ++i) kernels::attention_ref_row<float>(p, b, i);
}

// Checks the fast path against the float64 reference with the 2x-plain rule, for out, lse
// and (if weights_rank) the weights.
void check(Problem& pr, int weights_rank = 0) {
  SCOPED_TRACE(pr.describe());
  if (std::getenv("MHA_TEST_VERBOSE")) std::fprintf(stderr, "check %s\n", pr.describe().c_str());
  Outputs fast(pr, weights_rank), ref(pr, weights_rank), plain(pr, weights_rank);
  AttentionOptions fo = pr.opt, ro = pr.opt;
  fo.backend = Backend::kFast;
  ro.backend = Backend::kReference;
  attention(pr.in, fast.views(), fo);
  attention(pr.in, ref.views(), ro);
  run_plain(pr, plain);
  // The floor: the probabilities' extra relative error (< 8u: exp2's 3.4u and the rounding of
  // (s - m)·log2 e) moves an output by up to 8u·max|v| (docs/numerics.md), which relative to
  // max|out| is 8u·max|v|/max|out| — at least 8u.
  auto expect_bound = [&](const Tensor& f, const Tensor& r, const Tensor& pl, const char* what, double floor) {
    const double scale = std::max(finite_max_abs(r), 1e-30);
    const double ef = abs_error(f, r) / scale, ep = abs_error(pl, r) / scale;
    EXPECT_LE(ef, 2 * ep + floor * kU / scale) << what << ": fast " << ef << " vs plain float32 " << ep;
  };
  const double drop_scale = pr.opt.dropout_p > 0 && pr.opt.dropout_p < 1 ? 1.0 / (1.0 - pr.opt.dropout_p) : 1.0;
  const double v_max = std::max(finite_max_abs(ref.out), finite_max_abs(pr.v) * drop_scale);
  expect_bound(fast.out, ref.out, plain.out, "out", 8 * v_max);
  // The LSE: 4u of max|lse|, or where that does not hold, the floor of its terms (lse_floor,
  // test_util.h; it costs Tq·Tk·D a head). Seed 118 drew rows that each see one key, so that
  // lse is a single score, |lse| ≤ 0.34 (a softcap), from a dot product of 51 terms whose
  // absolute values add to ~13× it: fast 5.5e-7 of max|lse| against plain's 8.9e-8.
  const double lse_max = finite_max_abs(ref.lse);
  double lse_floor_u = 4 * std::max(lse_max, 1e-30);  // in u, as expect_bound takes it
  if (abs_error(fast.lse, ref.lse) > 2 * abs_error(plain.lse, ref.lse) + lse_floor_u * kU)
    lse_floor_u = std::max(lse_floor_u, lse_floor(pr.in, pr.opt, lse_max) / kU);
  expect_bound(fast.lse, ref.lse, plain.lse, "lse", lse_floor_u);
  // Weights are exp2((s - lse)·log2 e) from the float32 LSE: the LSE's rounding (|lse|·u/2) and
  // the product's (|s - lse|·u) move each one, relative, beyond exp2's own error.
  if (weights_rank) {
    expect_bound(fast.weights, ref.weights, plain.weights, "weights",
                 (8 + 2 * lse_max) * std::max(finite_max_abs(ref.weights), 1e-30));
  }
}

TEST_P(FlashTest, SequenceLengthsAroundTileEdges) {
  Rng rng(base_seed() + 10);
  for (int64_t T : {1, 2, 47, 48, 49, 63, 64, 65, 97, 113, 257, 1025}) {
    for (Causal c : {Causal::kNone, Causal::kTopLeft}) {
      Problem p;
      p.Tq = p.Tk = T;
      p.D = p.Dv = 64;
      p.opt.causal = c;
      p.make(rng);
      check(p);
    }
  }
}

TEST_P(FlashTest, HeadDims) {
  Rng rng(base_seed() + 11);
  for (int64_t D : {1, 3, 8, 16, 32, 33, 64, 80, 96, 128, 256}) {
    Problem p;
    p.Tq = 65;
    p.Tk = 113;
    p.D = D;
    p.Dv = D;
    p.make(rng);
    check(p);
    Problem q;  // Dqk != Dv
    q.Tq = q.Tk = 70;
    q.D = D;
    q.Dv = D % 7 + 5;
    q.opt.causal = Causal::kBottomRight;
    q.make(rng);
    check(q);
  }
}

TEST_P(FlashTest, GroupedQueryRatiosAndAlignments) {
  Rng rng(base_seed() + 12);
  for (int64_t G : {1, 2, 4, 8}) {
    for (Causal c : {Causal::kNone, Causal::kTopLeft, Causal::kBottomRight}) {
      for (auto [Tq, Tk] : {std::pair<int64_t, int64_t>{33, 97}, {97, 33}, {1, 130}, {64, 64}}) {
        Problem p;
        p.B = 2;
        p.Hkv = 2;
        p.Hq = 2 * G;
        p.Tq = Tq;
        p.Tk = Tk;
        p.D = 32;
        p.Dv = 24;
        p.bthd = true;
        p.opt.causal = c;
        p.make(rng);
        check(p);
      }
    }
  }
}

TEST_P(FlashTest, MasksWithFullyMaskedRowsAndBlocks) {
  Rng rng(base_seed() + 13);
  Problem p;
  p.B = 2;
  p.Hq = 4;
  p.Hkv = 2;
  p.Tq = 100;
  p.Tk = 200;
  p.D = p.Dv = 16;
  p.make(rng);
  p.keep = random_mask(rng, {p.B, 1, p.Tq, p.Tk}, 0.6);
  uint8_t* m = p.keep.data<uint8_t>();
  for (int64_t j = 0; j < p.Tk; ++j) m[5 * p.Tk + j] = 0;            // row 5 of batch 0: fully masked
  for (int64_t i = 0; i < p.Tq; ++i)
    for (int64_t j = 64; j < 128; ++j) m[i * p.Tk + j] = 0;           // a fully masked key block
  for (int64_t i = 0; i < 48; ++i)
    for (int64_t j = 128; j < 192; ++j) m[(p.Tq + i) * p.Tk + j] = 1;  // a fully kept block
  p.in.keep_mask = p.keep.view<uint8_t>();
  check(p, 4);
  p.bias = random_tensor(rng, {p.Hq, 1, p.Tk});
  p.in.attn_bias = p.bias.view<float>();
  p.lengths = Tensor(DType::kI64, {p.B});
  p.lengths.data<int64_t>()[0] = 150;
  p.lengths.data<int64_t>()[1] = 0;  // batch 1: every row fully masked
  p.in.key_lengths = p.lengths.view<int64_t>();
  p.opt.causal = Causal::kBottomRight;
  p.opt.window = 40;
  check(p, 3);
  // Fully masked rows: zeros, LSE -inf.
  Outputs o(p, 0);
  attention(p.in, o.views(), p.opt);
  for (int64_t x = 0; x < p.Hq * p.Tq * p.Dv; ++x) ASSERT_EQ(o.out.data<float>()[p.Hq * p.Tq * p.Dv + x], 0.0f);
  for (int64_t x = 0; x < p.Hq * p.Tq; ++x) ASSERT_EQ(o.lse.data<float>()[p.Hq * p.Tq + x], -kInf);
}

TEST_P(FlashTest, RandomProblems) {
  const uint64_t seed = base_seed() + 14;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with MHA_TEST_SEED)");
  Rng rng(seed);
  const int trials = GetParam() == "SCALAR" ? 30 : 120;
  for (int trial = 0; trial < trials; ++trial) {
    Problem p;
    p.B = rng.range(1, 2);
    p.Hkv = rng.range(1, 3);
    p.Hq = p.Hkv * rng.range(1, 4);
    p.Tq = rng.range(1, 150);
    p.Tk = rng.coin(0.3) ? p.Tq : rng.range(1, 150);
    p.D = rng.range(1, 72);
    p.Dv = rng.coin(0.5) ? p.D : rng.range(1, 72);
    p.bthd = rng.coin(0.5);
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.3)) {
      p.keep = random_mask(rng, broadcast_shape(rng, full), rng.coin(0.5) ? 0.9 : 0.3);
      p.in.keep_mask = p.keep.view<uint8_t>();
    }
    if (rng.coin(0.3)) {
      p.bias = random_tensor(rng, broadcast_shape(rng, full));
      p.in.attn_bias = p.bias.view<float>();
    }
    if (rng.coin(0.3)) {
      p.lengths = random_lengths(rng, p.B, p.Tk);
      p.in.key_lengths = p.lengths.view<int64_t>();
    }
    p.opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (p.opt.causal != Causal::kNone && rng.coin(0.3)) p.opt.window = rng.range(1, 80);
    if (rng.coin(0.2)) p.opt.dropout_p = 0.25f, p.opt.dropout_seed = rng.next();
    if (rng.coin(0.2)) p.opt.scale = static_cast<float>(rng.uniform());
    p.add_variants(rng, 0.25);
    if (p.opt.window > 0 && rng.coin(0.5)) p.opt.sink_tokens = rng.range(1, 70);  // StreamingLLM
    check(p, static_cast<int>(rng.range(0, 2)) == 0 ? 0 : (rng.coin(0.5) ? 3 : 4));
  }
}

// Softcap, ALiBi and sinks together at the tile edges (rows 47/48/49, keys 63/64/65), with
// both alignments, key lengths, a window, masks with fully masked rows, weights and dropout.
TEST_P(FlashTest, ScoreVariantsAtTileEdges) {
  Rng rng(base_seed() + 20);
  for (int64_t Tq : {1, 47, 48, 49, 97}) {
    for (int64_t Tk : {Tq, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{130}}) {
      Problem p;
      p.B = 2;
      p.Hkv = 2;
      p.Hq = 4;
      p.Tq = Tq;
      p.Tk = std::max(Tk, Tq);
      p.D = 24;
      p.Dv = 17;
      p.make(rng);
      p.add_variants(rng, 1.0);
      p.opt.causal = Tk % 2 ? Causal::kTopLeft : Causal::kBottomRight;
      if (Tk == 130) {
        p.lengths = random_lengths(rng, p.B, p.Tk);
        p.in.key_lengths = p.lengths.view<int64_t>();
        p.opt.window = 40;
      }
      if (Tk == 64) {
        p.keep = random_mask(rng, {p.B, 1, p.Tq, p.Tk}, 0.3);  // some rows fully masked
        p.in.keep_mask = p.keep.view<uint8_t>();
        p.opt.dropout_p = 0.2f;
        p.opt.dropout_seed = 5;
      }
      check(p, Tq == 49 ? 4 : 0);
    }
  }
}

// The decode kernel (few rows against many keys, split into chunks) with every variant.
TEST_P(FlashTest, ScoreVariantsInDecode) {
  Rng rng(base_seed() + 21);
  for (int64_t G : {1, 4, 8}) {
    for (int64_t Tk : {1, 17, 300, 5000}) {
      Problem p;
      p.B = 2;
      p.Hkv = 2;
      p.Hq = 2 * G;
      p.Tq = G == 8 ? 1 : 2;
      p.Tk = std::max(Tk, p.Tq);
      p.D = p.Dv = Tk == 17 ? 20 : 64;
      p.opt.causal = Causal::kBottomRight;
      p.make(rng);
      p.add_variants(rng, 0.7);
      if (Tk == 5000) {
        p.lengths = random_lengths(rng, p.B, p.Tk);
        p.in.key_lengths = p.lengths.view<int64_t>();
        p.opt.window = G == 4 ? 1000 : 0;
      }
      check(p);
      if (Tk >= 300) {  // a window with 4 sink tokens (the keys between are skipped)
        p.opt.window = 100;
        p.opt.sink_tokens = 4;
        check(p);
      }
    }
  }
}

// Few query rows per kv head run the decode kernel (keys in lanes, split over chunks).
TEST_P(FlashTest, DecodeShapes) {
  Rng rng(base_seed() + 18);
  for (int64_t G : {1, 2, 4, 8, 16}) {
    for (int64_t Tq : {1, 2, 3}) {
      if (G * Tq > 16) continue;
      for (int64_t Tk : {1, 17, 300, 3000}) {
        Problem p;
        p.B = 2;
        p.Hkv = 2;
        p.Hq = 2 * G;
        p.Tq = Tq;
        p.Tk = std::max(Tk, Tq);
        p.D = Tk == 300 ? 33 : 64;
        p.Dv = Tk == 17 ? 20 : p.D;
        p.bthd = Tk == 300;
        p.opt.causal = Causal::kBottomRight;
        p.make(rng);
        check(p);
      }
    }
  }
  // Key lengths and a sliding window; one kv head, so the keys are split into chunks.
  Problem p;
  p.Hq = 4;
  p.Hkv = 1;
  p.Tq = 1;
  p.Tk = 5000;
  p.D = p.Dv = 96;
  p.make(rng);
  p.lengths = Tensor(DType::kI64, {1});
  p.lengths.data<int64_t>()[0] = 4321;
  p.in.key_lengths = p.lengths.view<int64_t>();
  p.opt.causal = Causal::kBottomRight;
  check(p);
  p.opt.window = 700;
  check(p);
  p.lengths.data<int64_t>()[0] = 0;  // nothing to see: zeros, LSE -inf
  check(p);
}

TEST_P(FlashTest, NonUnitInnerStrides) {
  Rng rng(base_seed() + 15);
  // K and V whose head dimension is strided (every other float).
  Problem p;
  p.Tq = 70;
  p.Tk = 90;
  p.D = 12;
  p.Dv = 10;
  p.make(rng);
  Tensor k2 = random_tensor(rng, {1, 2, 90, 24}), v2 = random_tensor(rng, {1, 2, 90, 20});
  p.in.key = View<const float>(k2.data<float>(), {1, 2, 90, 12}, {2 * 90 * 24, 90 * 24, 24, 2});
  p.in.value = View<const float>(v2.data<float>(), {1, 2, 90, 10}, {2 * 90 * 20, 90 * 20, 20, 2});
  check(p, 4);
}

// Keys and values of >= 1024 rows that are not adjacent ((B, T, H, D) memory) are gathered
// head-major before the forward (src/ops/attention.cc): the result is within the bound of the
// reference, and bit for bit the one computed from contiguous copies of the same values.
TEST_P(FlashTest, GatheredKeysGiveTheContiguousBits) {
  Rng rng(base_seed() + 17);
  auto contiguous = [](const View<const float>& x) {
    Tensor t(DType::kF32, {x.shape[0], x.shape[1], x.shape[2], x.shape[3]});
    float* o = t.data<float>();
    for (int64_t b = 0; b < x.shape[0]; ++b)
      for (int64_t h = 0; h < x.shape[1]; ++h)
        for (int64_t i = 0; i < x.shape[2]; ++i)
          for (int64_t c = 0; c < x.shape[3]; ++c)
            *o++ = x.data[b * x.stride[0] + h * x.stride[1] + i * x.stride[2] + c * x.stride[3]];
    return t;
  };
  auto& ws = kernels::Workspace::local();
  for (int64_t Tk : {1023, 1024, 1537}) {
    Problem p;
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = 40;
    p.Tk = Tk;
    p.D = 24;
    p.Dv = 20;
    p.bthd = true;
    p.opt.causal = Causal::kBottomRight;
    p.make(rng);
    Tensor spread;  // at 1537 keys, values whose elements lie 2 apart beside the keys' rows H·D apart
    if (Tk == 1537) {
      spread = random_tensor(rng, {p.B, p.Hkv, p.Tk, 2 * p.Dv});
      p.in.value = View<const float>(spread.data<float>(), {p.B, p.Hkv, p.Tk, p.Dv},
                                     {p.Hkv * p.Tk * 2 * p.Dv, p.Tk * 2 * p.Dv, 2 * p.Dv, 2});
    }
    check(p, 4);
    ws.release(kernels::Workspace::kGatherKey);
    Outputs strided(p, 4), packed(p, 4);
    p.opt.backend = Backend::kFast;
    attention(p.in, strided.views(), p.opt);
    EXPECT_EQ(ws.size(kernels::Workspace::kGatherKey) > 0, Tk >= 1024) << "Tk " << Tk;
    const Tensor q = contiguous(p.in.query), k = contiguous(p.in.key), v = contiguous(p.in.value);
    AttentionInputs in = p.in;
    in.query = q.view<float>();
    in.key = k.view<float>();
    in.value = v.view<float>();
    attention(in, packed.views(), p.opt);
    EXPECT_TRUE(bitwise_equal(strided.out, packed.out)) << "Tk " << Tk;
    EXPECT_TRUE(bitwise_equal(strided.lse, packed.lse)) << "Tk " << Tk;
    EXPECT_TRUE(bitwise_equal(strided.weights, packed.weights)) << "Tk " << Tk;
  }
}

TEST_P(FlashTest, SameBitsForOneAndTwoThreads) {
  Rng rng(base_seed() + 16);
  Problem p;
  p.B = 2;
  p.Hq = 6;
  p.Hkv = 3;
  p.Tq = 300;
  p.Tk = 260;
  p.D = p.Dv = 40;
  p.opt.causal = Causal::kBottomRight;
  p.opt.dropout_p = 0.1f;
  p.opt.dropout_seed = 7;
  p.make(rng);
  Outputs a(p, 3), b(p, 3);
  p.opt.num_threads = 1;
  attention(p.in, a.views(), p.opt);
  p.opt.num_threads = 2;
  attention(p.in, b.views(), p.opt);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
  EXPECT_TRUE(bitwise_equal(a.weights, b.weights));

  // Decoding one kv head: its keys are split into chunks merged in a fixed order.
  Problem dec;
  dec.Hq = 8;
  dec.Hkv = 1;
  dec.Tq = 1;
  dec.Tk = 4000;
  dec.D = dec.Dv = 64;
  dec.opt.causal = Causal::kBottomRight;
  dec.make(rng);
  Outputs c(dec, 0), e(dec, 0);
  dec.opt.num_threads = 1;
  attention(dec.in, c.views(), dec.opt);
  dec.opt.num_threads = 2;
  attention(dec.in, e.views(), dec.opt);
  EXPECT_TRUE(bitwise_equal(c.out, e.out));
  EXPECT_TRUE(bitwise_equal(c.lse, e.lse));
}

TEST_P(FlashTest, NaNPropagatesInfinitiesBehave) {
  Rng rng(base_seed() + 17);
  Problem p;
  p.Tq = 5;
  p.Tk = 70;
  p.make(rng);
  p.q.data<float>()[2 * 8 + 1] = std::nanf("");  // head 0, row 2
  Outputs o(p, 0);
  attention(p.in, o.views(), p.opt);
  for (int64_t d = 0; d < 8; ++d) EXPECT_TRUE(std::isnan(o.out.data<float>()[2 * 8 + d]));
  EXPECT_TRUE(std::isnan(o.lse.data<float>()[2]));
  EXPECT_FALSE(std::isnan(o.out.data<float>()[0]));
  // Large logits (±1e4 after scaling) do not overflow.
  Problem big;
  big.Tq = 3;
  big.Tk = 80;
  big.make(rng);
  big.opt.scale = 1e4f;
  check(big);
}

INSTANTIATE_TEST_SUITE_P(Targets, FlashTest, ::testing::ValuesIn(kernels::simd_targets()), target_name);

}  // namespace
}  // namespace mha::test

namespace mha::test {
namespace {

// Memory is O((D + Dv + key block) · rows) per thread: the scratch does not grow with T.
TEST(FlashMemory, ScratchDoesNotGrowWithSequenceLength) {
  auto run = [](int64_t T) {
    Rng rng(1);
    const Tensor q = random_tensor(rng, {1, 2, T, 64}), k = random_tensor(rng, {1, 2, T, 64});
    Tensor out(DType::kF32, {1, 2, T, 64});
    AttentionOptions opt;
    opt.num_threads = 1;  // runs on this thread, so its workspace is the one measured
    opt.causal = Causal::kTopLeft;
    attention({q.view<float>(), k.view<float>(), k.view<float>()}, {out.view<float>()}, opt);
    return kernels::Workspace::local().bytes();
  };
  // In a fresh thread, so the workspace starts empty whatever ran before.
  size_t small = 0, large = 0;
  std::thread([&] {
    small = run(256);
    large = run(8192);
  }).join();
  EXPECT_GT(small, 0u);
  EXPECT_EQ(small, large);
  EXPECT_LT(large, size_t{1} << 20);
}

}  // namespace
}  // namespace mha::test
