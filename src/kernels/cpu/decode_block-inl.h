// The inner loops of the decode kernel (flash_decode.cc) over one block of keys: the scores of N
// keys for one query row (DotScores from the K rows, StagedScores from keys widened or dequantized
// into a stage) or, for plain keys on AVX2, every row's (GroupedKeyScores), head dim in the lanes
// and the N sums reduced together; the online softmax of a block's scores (BlockSoftmax: softcap,
// ALiBi, mask); and the output pass (DecodeOutputCols), value columns in the lanes, each V row
// loaded once per block and broadcast-multiplied into every row's accumulator (VisibleOutput: one
// row over only the keys it sees); and the query rows they read (LoadQueryRow). Kv: how K and V are
// stored (decode_kv-inl.h).
#if defined(MHA_KERNELS_CPU_DECODE_BLOCK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_BLOCK_INL_H_
#undef MHA_KERNELS_CPU_DECODE_BLOCK_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_BLOCK_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/decode_merge-inl.h"
#include "kernels/cpu/decode_value_scales-inl.h"
#include "kernels/cpu/exp2-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "mha/half.h"
#include "util/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

constexpr size_t kOutVecs = 4;  // value columns per output pass: 4 vectors (DecodeOutputCols)
constexpr int64_t kTileRows = 4;  // query rows per pass over a key tile (TileScores) or an integer value pass
#if HWY_TARGET <= HWY_AVX3
constexpr size_t kRowGroup = 6;   // query rows per float output pass: 6 rows × 4 vectors = 24 accumulators
#else
constexpr size_t kRowGroup = 2;   // 8 accumulators of 16 registers
#endif

template <class F>
HWY_INLINE void ForRowGroups(size_t rows, const F& f) {
  for (size_t r0 = 0; r0 < rows; r0 += kRowGroup) f(r0, std::min(kRowGroup, rows - r0));
}

// The passes take their counts of rows and of vectors as template arguments (their accumulators
// are arrays of registers). These call f(std::integral_constant<size_t, n>()) for a count found
// at run time: WithRowGroup for n = rg, 1 ... kRowGroup (as ForRowGroups gives them);
// WithTileRows for n = min(rows, kTileRows); WithPassVectors for n = min(nv, kOutVecs), nv ≥ 1.
template <class F>
HWY_INLINE void WithRowGroup(size_t rg, const F& f) {
  static_assert(kRowGroup == (HWY_TARGET <= HWY_AVX3 ? 6 : 2), "a case for each row count up to kRowGroup");
  switch (rg) {
    case 1: f(std::integral_constant<size_t, 1>()); break;
#if HWY_TARGET <= HWY_AVX3
    case 2: f(std::integral_constant<size_t, 2>()); break;
    case 3: f(std::integral_constant<size_t, 3>()); break;
    case 4: f(std::integral_constant<size_t, 4>()); break;
    case 5: f(std::integral_constant<size_t, 5>()); break;
#endif
    default: f(std::integral_constant<size_t, kRowGroup>()); break;
  }
}

template <class F>
HWY_INLINE void WithTileRows(int64_t rows, const F& f) {
  static_assert(kTileRows == 4, "a case for each row count up to kTileRows");
  switch (std::min<int64_t>(kTileRows, rows)) {
    case 1: f(std::integral_constant<size_t, 1>()); break;
    case 2: f(std::integral_constant<size_t, 2>()); break;
    case 3: f(std::integral_constant<size_t, 3>()); break;
    default: f(std::integral_constant<size_t, kTileRows>()); break;
  }
}

template <class F>
HWY_INLINE void WithPassVectors(size_t nv, const F& f) {
  static_assert(kOutVecs == 4, "a case for each vector count up to kOutVecs");
  switch (nv) {
    case 1: f(std::integral_constant<size_t, 1>()); break;
    case 2: f(std::integral_constant<size_t, 2>()); break;
    case 3: f(std::integral_constant<size_t, 3>()); break;
    default: f(std::integral_constant<size_t, kOutVecs>()); break;
  }
}

// S[r][x] for one row and N keys widened or dequantized into the stage (16-bit and quantized
// keys: each key is converted once, not once per query row; measured at GQA 32/8, 256 MiB: int8
// step 12.0 → 9.7 ms). The stage interleaves the keys by vector: vector c of key x at
// stage + (c·N + x)·N, so the N loads of a step are one pointer's constant offsets (N row
// pointers did not fit the registers: their reloads were a third of the scores' time). The
// products and their order are DotScores's: the same bits.
HWY_INLINE hn::Vec<DF> StagedScores(DF d, const float* q, const float* HWY_RESTRICT stage, size_t vecs) {
  using V = hn::Vec<DF>;
  const size_t N = hn::Lanes(d);
  V acc[hn::MaxLanes(DF())];
  for (size_t x = 0; x < N; ++x) acc[x] = hn::Zero(d);
  for (size_t c = 0; c < vecs; ++c) {
    const V qc = hn::Load(d, q + c * N);
    const float* sc = stage + c * N * N;
    for (size_t x = 0; x < N; ++x) acc[x] = hn::MulAdd(qc, hn::Load(d, sc + x * N), acc[x]);
  }
  return SumLanesOfEach(d, acc);
}

// Whether the value pass of int8/int4 values takes the groups' scales into its weights
// (FoldValueWeights): where a pass of kOutVecs vectors is one quantization group (AVX2's 32
// columns). Elsewhere each value is dequantized in registers (QuantKv::Load).
template <class Kv>
constexpr bool FoldsValueScales() {
  return Kv::kKeyTiles && !HWY_HAVE_SCALABLE && kOutVecs * hn::MaxLanes(DF()) == static_cast<size_t>(kCacheQuantGroup);
}

// Whether a value pass of NV whole vectors reads bfloat16 values by pairs (DecodeOutput): on
// AVX2, a 32-bit lane holds columns 2i and 2i + 1 as its low and high halves, and each half is a
// float once the other half is cleared (a shift, an and), where widening takes two instructions
// per vector of 8 values. The accumulators then hold the even and the odd columns of 2N columns;
// they are split that way from O before the keys and joined back after them (a few shuffles
// per pair of vectors and row, once per block). The products and their order per column are those
// of the widening pass: the same bits.
#if HWY_TARGET == HWY_AVX2
constexpr bool kBf16Pairs = true;
// Columns [0, 2N) of bfloat16 values at p as floats: the even columns, then the odd.
HWY_INLINE void LoadBf16Pairs(DF d, const bfloat16* p, hn::Vec<DF>& even, hn::Vec<DF>& odd) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Repartition<uint16_t, DF> du16;
  const auto w = hn::BitCast(du, hn::LoadU(du16, reinterpret_cast<const uint16_t*>(p)));
  even = hn::BitCast(d, hn::ShiftLeft<16>(w));
  odd = hn::BitCast(d, hn::And(w, hn::Set(du, 0xFFFF0000u)));
}
// Columns [0, 2N) of floats at p: the even columns, then the odd.
HWY_INLINE void SplitPairs(DF d, const float* p, hn::Vec<DF>& even, hn::Vec<DF>& odd) {
  const auto lo = hn::Load(d, p), hi = hn::Load(d, p + hn::Lanes(d));
  even = hn::ConcatEven(d, hi, lo);
  odd = hn::ConcatOdd(d, hi, lo);
}
// SplitPairs undone: the even and the odd columns interleaved into columns [0, N) (first) and
// [N, 2N) (second), through AVX2's 128-bit halves. Also joins Int8Output256's sums.
HWY_INLINE void JoinedPairs(DF d, hn::Vec<DF> even, hn::Vec<DF> odd, hn::Vec<DF>& first, hn::Vec<DF>& second) {
  const auto lo = hn::InterleaveLower(d, even, odd), hi = hn::InterleaveUpper(d, even, odd);
  first = hn::ConcatLowerLower(d, hi, lo);
  second = hn::ConcatUpperUpper(d, hi, lo);
}
// The same, stored at p.
HWY_INLINE void JoinPairs(DF d, hn::Vec<DF> even, hn::Vec<DF> odd, float* p) {
  hn::Vec<DF> first, second;
  JoinedPairs(d, even, odd, first, second);
  hn::Store(first, d, p);
  hn::Store(second, d, p + hn::Lanes(d));
}
#else
constexpr bool kBf16Pairs = false;  // elsewhere the pass widens (these are never called)
HWY_INLINE void LoadBf16Pairs(DF, const bfloat16*, hn::Vec<DF>&, hn::Vec<DF>&) {}
HWY_INLINE void SplitPairs(DF, const float*, hn::Vec<DF>&, hn::Vec<DF>&) {}
HWY_INLINE void JoinPairs(DF, hn::Vec<DF>, hn::Vec<DF>, float*) {}
#endif

template <class Kv, size_t NV, bool kTail>
constexpr bool ReadsBf16Pairs() {
  return kBf16Pairs && std::is_same_v<Kv, PlainKv<bfloat16>> && !kTail && NV % 2 == 0;
}

// O[r][c0 + c·N ..] = alpha[r]·O + Σ_{j < jn} P[r][j] · V_j[c0 + c·N ..] for rows [r0, r0 + RG)
// and NV vectors of columns, V_j = vrows[j]. kTail: the last vector is partial (ncols % N != 0).
// Each key asks `ahead` for its multiply-adds' share of the next block's lines.
// Folded (FoldsValueScales, columns of one group): pr holds that group's weights P·scale and
// mins[r] the rows' Σ P·minimum (FoldValueWeights), and the values are read as their codes.
// ReadsBf16Pairs: the accumulators hold pairs of vectors as even and odd columns.
template <size_t RG, size_t NV, bool kTail, class Kv>
HWY_INLINE void DecodeOutput(DF d, const float* pr, size_t ldp, const Kv& kv, const typename Kv::Row* vrows, size_t c0,
                             size_t ncols, size_t jn, const float* alpha, float* o, size_t ldo, LineStream& ahead,
                             const float* mins) {
  using V = hn::Vec<DF>;
  constexpr bool kFolded = FoldsValueScales<Kv>();
  constexpr bool kPairs = ReadsBf16Pairs<Kv, NV, kTail>();
  const size_t N = hn::Lanes(d);
  V acc[RG][NV];
  for (size_t r = 0; r < RG; ++r) {
    const V a = hn::Set(d, alpha[r]);
    V x[NV];
    for (size_t c = 0; c < NV; ++c) {
      if constexpr (kPairs) {  // vectors c, c + 1: the even, then the odd columns of both
        if (c % 2 == 0) SplitPairs(d, o + r * ldo + c * N, x[c], x[c + 1]);
      } else {
        x[c] = hn::Load(d, o + r * ldo + c * N);
      }
    }
    for (size_t c = 0; c < NV; ++c) {
      if constexpr (kFolded) {
        acc[r][c] = hn::MulAdd(x[c], a, hn::Set(d, mins[r]));
      } else {
        acc[r][c] = hn::Mul(x[c], a);
      }
    }
  }
  const size_t tail = ncols - (NV - 1) * N;
  // Each row advanced to column c0 (to its last Columns boundary, with the rest in `skip`), so
  // that the loads below are constant offsets from it. A pass of kOutVecs whole vectors starts
  // at a boundary (on AVX3 and AVX2: 64 and 32 columns, quantized groups of 32): skip is 0 at
  // compile time. (Offsets computed per load, spilled for want of registers, took ~6% of the
  // cache-resident int8 step; docs/benchmarks.md.)
  constexpr size_t kAlign = Kv::kColumnAlign;
  const size_t skip = !HWY_HAVE_SCALABLE && kOutVecs * hn::MaxLanes(DF()) % kAlign == 0 ? 0 : c0 % kAlign;
  for (size_t j = 0; j < jn; ++j) {
    const auto vj = Kv::Columns(vrows[j], c0 - skip);
    ahead.Issue(kFloatWork * RG * ncols);
    V x[NV];
    for (size_t c = 0; c < NV; ++c) {
      if constexpr (kPairs) {
        if (c % 2 == 0) LoadBf16Pairs(d, vj + skip + c * N, x[c], x[c + 1]);
      } else if constexpr (kFolded) {
        x[c] = Kv::Codes(d, vj, 0, c * N);  // whole groups: the padded row has the codes
      } else {
        x[c] = kTail && c + 1 == NV ? kv.LoadPartial(d, vj, skip + c * N, tail) : kv.Load(d, vj, skip + c * N);
      }
    }
    for (size_t r = 0; r < RG; ++r) {
      const V pb = hn::Set(d, pr[r * ldp + j]);
      for (size_t c = 0; c < NV; ++c) acc[r][c] = hn::MulAdd(pb, x[c], acc[r][c]);
    }
  }
  for (size_t r = 0; r < RG; ++r) {
    for (size_t c = 0; c < NV; ++c) {
      if constexpr (kPairs) {  // columns in order again: even and odd interleaved
        if (c % 2 == 0) JoinPairs(d, acc[r][c], acc[r][c + 1], o + r * ldo + c * N);
      } else {
        hn::Store(acc[r][c], d, o + r * ldo + c * N);
      }
    }
  }
}

template <size_t RG, class Kv>
HWY_INLINE void DecodeOutputCols(DF d, const float* pr, size_t ldp, const Kv& kv, const typename Kv::Row* vrows,
                                 size_t c0, size_t ncols, size_t jn, const float* alpha, float* o, size_t ldo,
                                 LineStream& ahead, const float* mins) {
  const size_t N = hn::Lanes(d), nv = (ncols + N - 1) / N;
  const bool tail = ncols % N != 0;
  WithPassVectors(nv, [&](auto v) {
    constexpr size_t NV = decltype(v)::value;
    if (tail) {
      DecodeOutput<RG, NV, true>(d, pr, ldp, kv, vrows, c0, ncols, jn, alpha, o, ldo, ahead, mins);
    } else {
      DecodeOutput<RG, NV, false>(d, pr, ldp, kv, vrows, c0, ncols, jn, alpha, o, ldo, ahead, mins);
    }
  });
}

// The online softmax of a block of keys from j0 (jn of them; the scores past jn are -inf) for
// rows r < R, scores in place at s + r·block, block = kVecs·N (keys in the lanes: horizontal max
// and sum): softcap and ALiBi, the mask of each row's visible keys (seen[r]; skipped where the
// row sees the whole block), then P = exp(S − m_new) in place, alpha[r] = exp(m_old − m_new),
// and m, l updated. pmax (unless null): each row's largest P of the block, for the integer value passes'
// weights; not finite where a P is not (a score of +inf or NaN: it shows in the sum, where the
// max may drop a NaN), which gives the block to the float pass.
template <size_t kVecs>
HWY_INLINE void BlockSoftmax(DF d, const AttentionParams& p, int64_t b, int64_t hk, const DecodeRows& rows, int64_t R,
                             int64_t j0, int64_t jn, const KeyRange* seen, float* s, float* m, float* l, float* alpha,
                             float* pmax) {
  const hn::RebindToSigned<DF> di;
  const size_t N = hn::Lanes(d), block = kVecs * N;
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * block;
    if (p.softcap > 0 || p.alibi) {
      const int64_t h = rows.head(p, hk, r);
      const auto cap = hn::Set(d, p.softcap), inv = hn::Set(d, p.softcap > 0 ? 1.0f / p.softcap : 0.0f);
      const auto slope = hn::Set(d, alibi_slope(p, b, h));
      // Distances as float, exact below 2^24 keys (as in the prefill kernels).
      const auto pos = hn::Set(d, static_cast<float>(query_position(p, b, rows.query(p, r)) - j0));
      for (size_t kv = 0; kv < kVecs; ++kv) {
        auto x = hn::Load(d, sr + kv * N);
        if (p.softcap > 0) x = hn::Mul(cap, SoftcapTanh(d, hn::Mul(x, inv)));
        if (p.alibi) x = hn::NegMulAdd(slope, hn::Abs(hn::Sub(pos, hn::Iota(d, static_cast<float>(kv * N)))), x);
        hn::Store(x, d, sr + kv * N);
      }
    }
    auto mx = hn::Set(d, kNegInf);
    const KeyRange& k = seen[r];
    if (k.covers(j0, j0 + static_cast<int64_t>(block))) {
      // Every key of the block visible (most blocks): no mask. Masking every block took ~4% of
      // the cache-resident int8 and int4 steps (docs/benchmarks.md).
      for (size_t kv = 0; kv < kVecs; ++kv) mx = hn::Max(mx, hn::Load(d, sr + kv * N));
    } else {
      // Key indices relative to the block fit int32 lanes whatever the key count (> 2^31 too).
      const auto lo_rel = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(k.lo - j0, -1, jn) - 1));
      const auto hi_rel = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(k.hi - j0, -1, jn)));
      const auto sink_rel = hn::Set(di, static_cast<int32_t>(std::clamp<int64_t>(k.sink_hi - j0, 0, jn)));
      for (size_t kv = 0; kv < kVecs; ++kv) {
        const auto j = hn::Iota(di, static_cast<int32_t>(kv * N));
        const auto vis = hn::Or(hn::And(hn::Lt(lo_rel, j), hn::Lt(j, hi_rel)), hn::Lt(j, sink_rel));
        const auto x = hn::IfThenElse(hn::RebindMask(d, vis), hn::Load(d, sr + kv * N), hn::Set(d, kNegInf));
        hn::Store(x, d, sr + kv * N);
        mx = hn::Max(mx, x);
      }
    }
    const float m_new = std::max(m[r], hn::GetLane(hn::MaxOfLanes(d, mx)));
    // Nothing visible yet: shift by 0, so P = 2^-inf = 0 — but a NaN score still gives NaN
    // (the horizontal max may have dropped it) and reaches l.
    const float shift = m_new == kNegInf ? 0.0f : m_new;
    alpha[r] = m_new == kNegInf ? 1.0f : m[r] == kNegInf ? 0.0f : std::exp2((m[r] - m_new) * kLog2e);
    auto sum = hn::Zero(d), top = hn::Zero(d);
    for (size_t kv = 0; kv < kVecs; ++kv) {
      const auto e = Exp2(d, hn::Mul(hn::Sub(hn::Load(d, sr + kv * N), hn::Set(d, shift)), hn::Set(d, kLog2e)));
      hn::Store(e, d, sr + kv * N);
      sum = hn::Add(sum, e);
      if (pmax) top = hn::Max(top, e);
    }
    const float block_sum = hn::GetLane(hn::SumOfLanes(d, sum));
    if (pmax) pmax[r] = std::isfinite(block_sum) ? hn::GetLane(hn::MaxOfLanes(d, top)) : block_sum;
    l[r] = l[r] * alpha[r] + block_sum;
    m[r] = m_new;
  }
}

// O[0 .. Dv) = alpha·O + Σ P[j] · V_j over the keys j0 + j (j < jn) that the row sees
// (vis.visible), V_j = vrows[j]; the others are skipped, not weighted by 0 (a non-finite value
// there must not reach the row). One row and one key at a time: the kernel takes this only for a
// block whose passes left a row not finite.
template <class Kv>
HWY_INLINE void VisibleOutput(DF d, const float* pr, const Kv& kv, const typename Kv::Row* vrows, size_t Dv, int64_t j0,
                              size_t jn, KeyRange vis, float alpha, float* o) {
  const size_t N = hn::Lanes(d);
  for (size_t c = 0; c < Dv; c += N) {
    auto acc = hn::Mul(hn::Load(d, o + c), hn::Set(d, alpha));
    for (size_t j = 0; j < jn; ++j) {
      if (!vis.visible(j0 + static_cast<int64_t>(j))) continue;
      const auto x = c + N <= Dv ? kv.Load(d, vrows[j], c) : kv.LoadPartial(d, vrows[j], c, Dv - c);
      acc = hn::MulAdd(hn::Set(d, pr[j]), x, acc);
    }
    hn::Store(acc, d, o + c);
  }
}

// S[r][x] for one row and the N keys krows[x] (head dim in the lanes): N dot products,
// reduced together. K rows are read in memory order.
template <bool kTail, class Kv>
HWY_INLINE hn::Vec<DF> DotScores(DF d, const float* q, const Kv& kv, const typename Kv::Row* krows, size_t depth) {
  using V = hn::Vec<DF>;
  const size_t N = hn::Lanes(d);
  V acc[hn::MaxLanes(DF())];
  for (size_t x = 0; x < N; ++x) acc[x] = hn::Zero(d);
  const size_t full = kTail ? depth / N * N : depth;
  for (size_t c = 0; c < full; c += N) {
    const V qc = hn::Load(d, q + c);
    for (size_t x = 0; x < N; ++x) acc[x] = hn::MulAdd(qc, kv.Load(d, krows[x], c), acc[x]);
  }
  if (kTail) {
    const V qc = hn::Load(d, q + full);  // zero past depth (padded)
    for (size_t x = 0; x < N; ++x) acc[x] = hn::MulAdd(qc, kv.LoadPartial(d, krows[x], full, depth - full), acc[x]);
  }
  return SumLanesOfEach(d, acc);
}

// DotScores with a partial last vector or not, as tail says.
template <class Kv>
HWY_INLINE hn::Vec<DF> DotScores(DF d, bool tail, const float* q, const Kv& kv, const typename Kv::Row* krows,
                                 size_t depth) {
  return tail ? DotScores<true>(d, q, kv, krows, depth) : DotScores<false>(d, q, kv, krows, depth);
}

// Whether the scores of Kv's keys take GroupedKeyScores: float32, bfloat16 and float16 keys on
// AVX2, whose 16 registers fit three keys' accumulators for kTileRows rows (two keys at a time,
// float32 keys had stayed with DotScores, which reads 8 key rows per query row: paired, the
// float32 step from memory took 6–8% longer on an AMD EPYC; three at a time it took 6–8% less,
// docs/benchmarks.md), and on AVX3 four keys at a time (GroupedKeyScores16: the cache-resident
// float32 and float16 steps 16–19% below DotScores and StagedScores on an AMD EPYC Zen 4).
// bfloat16 keys take Bf16Scores where the CPU has AVX-512 BF16.
template <class Kv>
constexpr bool GroupKeys() {
  return (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3) &&
         (std::is_same_v<Kv, PlainKv<float>> || std::is_same_v<Kv, PlainKv<bfloat16>> ||
          std::is_same_v<Kv, PlainKv<float16>>);
}

// Keeps v in a register: the compiler may not fold the load that made it into each
// instruction that reads it (GCC 12 did, loading GroupedKeyScores's query vectors once per key).
template <class V>
HWY_INLINE void KeepInRegister(V& v) {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
  asm("" : "+x"(v.raw));
#elif HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// S[r][x] for the query rows [0, R) (rows ldq apart from q) and the N keys krows[x], into s +
// r·lds: three keys at a time (the last two of 8 as a pair) against up to kTileRows rows, each
// vector of a key loaded (and widened) once for those rows. Per 12 multiply-adds that is 3 key and
// 4 query loads, where DotScores loads 12 key and 1.5 query vectors (and StagedScores writes its
// stage first). Two keys at a time (8 accumulators, just as many as FMA's latency of 4 cycles needs
// at 2 a cycle) took the cache-resident bfloat16 and float16 steps 10–13% below StagedScores on an
// AMD EPYC's AVX2; three (12 accumulators) took the bfloat16 step ~4% lower again, float16's the
// same, and the float32 step from memory 6–8% below DotScores's (docs/benchmarks.md). Per row and
// key the products, their order and the sum across lanes are DotScores's: the same bits. Each group
// of keys asks `ahead` for its share of the next block's lines: asked per tile of N keys, a
// bfloat16 block's were bursts of 32 prefetches, and the steps from memory took 4–9% longer
// (bfloat16), 1–5% (float16) on the AMD EPYC (docs/benchmarks.md).
template <bool kTail, class Kv>
HWY_INLINE void GroupedKeyScores(DF d, const float* q, size_t ldq, int64_t R, const Kv& kv,
                                 const typename Kv::Row* krows, size_t depth, float* HWY_RESTRICT s, size_t lds,
                                 LineStream& ahead) {
  using V = hn::Vec<DF>;
  const size_t N = hn::Lanes(d), full = kTail ? depth / N * N : depth;
  for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
    WithTileRows(R - r0, [&](auto rt) {
      constexpr size_t RT = decltype(rt)::value;
      const float* qr = q + r0 * static_cast<int64_t>(ldq);
      V acc[RT][hn::MaxLanes(DF())];
      // K keys from x: each vector of theirs loaded once for the RT rows.
      auto keys = [&](size_t x, auto kk) HWY_ATTR {
        constexpr size_t K = decltype(kk)::value;
        ahead.Issue(kFloatWork * RT * K * depth);
        V a[RT][K];
        for (size_t r = 0; r < RT; ++r)
          for (size_t k = 0; k < K; ++k) a[r][k] = hn::Zero(d);
        for (size_t c = 0; c < full; c += N) {
          V kc[K];
          for (size_t k = 0; k < K; ++k) kc[k] = kv.Load(d, krows[x + k], c);
          for (size_t r = 0; r < RT; ++r) {
            V qc = hn::Load(d, qr + r * ldq + c);
            KeepInRegister(qc);
            for (size_t k = 0; k < K; ++k) a[r][k] = hn::MulAdd(qc, kc[k], a[r][k]);
          }
        }
        if (kTail) {  // the query is zero past depth (padded)
          V kc[K];
          for (size_t k = 0; k < K; ++k) kc[k] = kv.LoadPartial(d, krows[x + k], full, depth - full);
          for (size_t r = 0; r < RT; ++r) {
            const V qc = hn::Load(d, qr + r * ldq + full);
            for (size_t k = 0; k < K; ++k) a[r][k] = hn::MulAdd(qc, kc[k], a[r][k]);
          }
        }
        for (size_t r = 0; r < RT; ++r)
          for (size_t k = 0; k < K; ++k) acc[r][x + k] = a[r][k];
      };
      size_t x = 0;
      for (; x + 3 <= N; x += 3) keys(x, std::integral_constant<size_t, 3>());
      if (N - x == 2) keys(x, std::integral_constant<size_t, 2>());
      if (N - x == 1) keys(x, std::integral_constant<size_t, 1>());
      for (size_t r = 0; r < RT; ++r) {
        hn::Store(SumLanesOfEach(d, acc[r]), d, s + (r0 + static_cast<int64_t>(r)) * static_cast<int64_t>(lds));
      }
    });
  }
}

#if HWY_TARGET == HWY_AVX3
// GroupedKeyScores on AVX-512: four keys at a time against up to kTileRows rows (16 sums), each
// key vector loaded (and widened) once for those rows and each query vector once per four keys,
// where DotScores loads every key vector once per row (and StagedScores writes its stage first).
// A row's four sums are reduced at once by SumLanesOfFour, and the row's four such vectors by
// JoinFours: together SumLanesOfEach over its 16 keys, so per row and key the products, their
// order and the sum across lanes are DotScores's: the same bits. (Holding all 16 keys' sums of 4
// rows would take 64 registers.)
template <bool kTail, class Kv>
HWY_INLINE void GroupedKeyScores16(DF d, const float* q, size_t ldq, int64_t R, const Kv& kv,
                                   const typename Kv::Row* krows, size_t depth, float* HWY_RESTRICT s, size_t lds,
                                   LineStream& ahead) {
  using V = hn::Vec<DF>;
  const size_t N = hn::Lanes(d), full = kTail ? depth / N * N : depth;
  for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
    WithTileRows(R - r0, [&](auto rt) HWY_ATTR {
      constexpr size_t RT = decltype(rt)::value;
      const float* qr = q + r0 * static_cast<int64_t>(ldq);
      __m512 part[RT][4];
      for (size_t g = 0; g < 4; ++g) {
        ahead.Issue(kFloatWork * RT * 4 * depth);
        const typename Kv::Row k[4] = {krows[4 * g], krows[4 * g + 1], krows[4 * g + 2], krows[4 * g + 3]};
        __m512 a[RT][4];
        for (size_t r = 0; r < RT; ++r)
          for (size_t x = 0; x < 4; ++x) a[r][x] = _mm512_setzero_ps();
        auto step = [&](size_t c, auto tail) HWY_ATTR {
          V kc[4];
          for (size_t x = 0; x < 4; ++x)
            kc[x] = decltype(tail)::value ? kv.LoadPartial(d, k[x], c, depth - c) : kv.Load(d, k[x], c);
          for (size_t r = 0; r < RT; ++r) {
            V qc = hn::Load(d, qr + r * ldq + c);  // zero past depth (padded)
            KeepInRegister(qc);
            for (size_t x = 0; x < 4; ++x) a[r][x] = hn::MulAdd(qc, kc[x], V{a[r][x]}).raw;
          }
        };
        for (size_t c = 0; c < full; c += N) step(c, std::false_type());
        if (kTail) step(full, std::true_type());
        for (size_t r = 0; r < RT; ++r) part[r][g] = SumLanesOfFour(a[r]);
      }
      for (size_t r = 0; r < RT; ++r) {
        _mm512_storeu_ps(s + (r0 + static_cast<int64_t>(r)) * static_cast<int64_t>(lds), JoinFours(part[r]));
      }
    });
  }
}
#endif

// GroupedKeyScores with a partial last vector or not, as tail says.
template <class Kv>
HWY_INLINE void GroupedKeyScores(DF d, bool tail, const float* q, size_t ldq, int64_t R, const Kv& kv,
                                 const typename Kv::Row* krows, size_t depth, float* HWY_RESTRICT s, size_t lds,
                                 LineStream& ahead) {
#if HWY_TARGET == HWY_AVX3
  if (tail) {
    GroupedKeyScores16<true>(d, q, ldq, R, kv, krows, depth, s, lds, ahead);
  } else {
    GroupedKeyScores16<false>(d, q, ldq, R, kv, krows, depth, s, lds, ahead);
  }
#else
  if (tail) {
    GroupedKeyScores<true>(d, q, ldq, R, kv, krows, depth, s, lds, ahead);
  } else {
    GroupedKeyScores<false>(d, q, ldq, R, kv, krows, depth, s, lds, ahead);
  }
#endif
}

// Query row at element q of p.q, times `scale` (then times the keys' channel scales of a
// quantized cache), into dst with zeros from D to ldq. Per element the products of the scalar
// form, (q·scale)·channel: the same bits.
HWY_INLINE void LoadQueryRow(DF d, const AttentionParams& p, int64_t q, float scale, const float* channel, size_t D,
                             size_t ldq, float* HWY_RESTRICT dst) {
  const int64_t stride = p.q_stride[3];
  switch (p.dtype) {
    case DType::kBF16: RowToFloat(static_cast<const bfloat16*>(p.q) + q, stride, D, dst); break;
    case DType::kF16: RowToFloat(static_cast<const float16*>(p.q) + q, stride, D, dst); break;
    default: RowToFloat(static_cast<const float*>(p.q) + q, stride, D, dst); break;
  }
  const size_t N = hn::Lanes(d);
  const int64_t cstride = channel ? p.k_channel_stride[2] : 0;
  size_t i = 0;
  if (!channel || cstride == 1) {
    for (; i + N <= D; i += N) {
      auto x = hn::Mul(hn::LoadU(d, dst + i), hn::Set(d, scale));
      if (channel) x = hn::Mul(x, hn::LoadU(d, channel + i));
      hn::StoreU(x, d, dst + i);
    }
  }
  for (; i < D; ++i) {
    dst[i] *= scale;
    if (channel) dst[i] *= channel[static_cast<int64_t>(i) * cstride];
  }
  std::fill(dst + D, dst + ldq, 0.0f);
}

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_BLOCK_INL_H_
