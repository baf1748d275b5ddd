// How the decode kernel (flash_decode.cc) reads the keys and values of one (batch, kv head):
// PlainKv<T> (elements of T, widened on load) or QuantKv<kBits> (int8/int4 cache codes,
// dequantized on load as minimum + scale · code), contiguous or through a paged pool's block
// table. key(j) / value(j) is the Row of key or value j (QuantKv's keys are tiles instead:
// KeyTile(j), kv_cache.h has the layout); Columns(row, c0) is that row from
// column c0 on (c0 a multiple of kColumnAlign); Load(d, row, c) gives values [c, c + N) as
// floats; PlainKv's Stage writes a whole row's floats; AheadKeys / AheadValues add the lines of
// a range of keys (of their key tiles, for QuantKv) and values to a LineStream (prefetch.h).
#if defined(MHA_KERNELS_CPU_DECODE_KV_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_KV_INL_H_
#undef MHA_KERNELS_CPU_DECODE_KV_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_KV_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/prefetch.h"
#include "mha/kv_cache.h"
#include "util/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The work that paces the kernel's prefetches (LineStream): multiply-adds weighted by what they
// cost: 4 for a float FMA's (and for bfloat16 dot products, which ran no faster on the Xeon), 2 for
// AVX2's 16-bit integer products (key tiles, and the int4 and int8 value passes), 1 for VNNI's key
// tiles (four per 32-bit lane at the FMA's rate). The int4 value pass on VNNI (Int4OutputVnni)
// counts as float: its byte gathers (vpermt2b, a third of the FMA's rate) and nibble splits, with
// the block's byte weights before it, make its multiply-adds as slow; counted as VNNI's, the int4
// step at 256 MiB took 2.94 ms against 2.75 (docs/benchmarks.md). The int8 VNNI value pass
// (Int8OutputVnni: two products per lane at the FMA's instruction rate) counts 2; 1 or 4 measured
// the same (4.23–4.31 ms). AMX's bfloat16 key tiles (AmxBf16Scores) count as float too, though they
// ran ~5× as fast as vdpbf16ps's loop: counted 1, the bfloat16 step at 256 MiB took 6.06 ms against
// 5.64 (the scores then asked for too few lines, docs/benchmarks.md).
constexpr uint64_t kFloatWork = 4, kAvx2IntWork = 2, kVnniWork = 1, kInt4VnniValueWork = 4, kInt8VnniValueWork = 2;
constexpr float kLog2e = 1.4426950408889634f;

#if HWY_TARGET == HWY_AVX3
// The lanes of x that are not finite (|x| >= inf, or unordered: NaN).
HWY_INLINE __mmask16 NotFinite(__m512 x) {
  return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ);
}
#endif

// Element offset of key/value row j of one (batch, kv head) plane: j · row, or through the block
// table of a paged pool (page stride `page`).
struct RowOffset {
  const int64_t* table;
  int shift;
  int64_t mask, page, row;
  RowOffset(const AttentionParams& p, int64_t b, int64_t page_stride, int64_t row_stride)
      : table(p.block_tables ? p.block_tables[b] : nullptr), shift(p.page_shift),
        mask((int64_t{1} << p.page_shift) - 1), page(page_stride), row(row_stride) {}
  HWY_INLINE int64_t operator()(int64_t j) const { return table ? table[j >> shift] * page + (j & mask) * row : j * row; }
  // f(offset, bytes) for the runs of adjacent rows among [lo, hi) (rows of `bytes` bytes of
  // `elem`-byte elements): one per page, or one per row where rows are strided apart.
  template <class F>
  void Runs(int64_t lo, int64_t hi, size_t elem, size_t bytes, const F& f) const {
    const bool adjacent = static_cast<size_t>(row) * elem == bytes;
    while (lo < hi) {
      const int64_t end = !adjacent ? lo + 1 : table ? std::min(hi, ((lo >> shift) + 1) << shift) : hi;
      f((*this)(lo), static_cast<size_t>(end - lo) * bytes);
      lo = end;
    }
  }
};

// The start of (b, hk)'s plane: paged pools start every batch at page 0 (the table says where).
inline int64_t PlaneStart(const AttentionParams& p, const Strides4& stride, int64_t b, int64_t hk) {
  return (p.block_tables ? 0 : b * stride[0]) + hk * stride[1];
}

template <typename T>
struct PlainKv {
  using Row = const T*;
  static constexpr bool kPadded = false;  // rows end at D: a partial last vector needs LoadPartial
  static constexpr bool kOutliers = false;
  static constexpr bool kKeyTiles = false;  // keys are rows
  const T* k;
  const T* v;
  RowOffset kr, vr;
  size_t kdim, vdim;
  PlainKv(const AttentionParams& p, int64_t b, int64_t hk)
      : k(static_cast<const T*>(p.k) + PlaneStart(p, p.k_stride, b, hk)),
        v(static_cast<const T*>(p.v) + PlaneStart(p, p.v_stride, b, hk)),
        kr(p, b, p.k_stride[0], p.k_stride[2]), vr(p, b, p.v_stride[0], p.v_stride[2]),
        kdim(static_cast<size_t>(p.head_dim_qk)), vdim(static_cast<size_t>(p.head_dim_v)) {}
  Row key(int64_t j) const { return k + kr(j); }
  Row value(int64_t j) const { return v + vr(j); }
  static constexpr size_t kColumnAlign = 1;
  static Row Columns(Row r, size_t c0) { return r + c0; }
  HWY_INLINE hn::Vec<DF> Load(DF d, Row r, size_t c) const { return LoadAsFloat(d, r + c); }
  HWY_INLINE hn::Vec<DF> LoadPartial(DF d, Row r, size_t c, size_t n) const { return LoadTailAsFloat(d, r + c, n); }
  // Values [0, depth) of row r widened to float, zeros after them up to whole vectors, vector i
  // at dst + i·stride.
  HWY_INLINE void Stage(DF d, Row r, size_t depth, float* HWY_RESTRICT dst, size_t stride) const {
    const size_t N = hn::Lanes(d);
    size_t c = 0, i = 0;  // i: vector c / N
    // By 4 vectors: one address per 4 (the loop by one spent more instructions on its indices
    // than on the widening: the cache-resident bfloat16 and float16 steps took ~10% less time).
    for (; c + 4 * N <= depth; c += 4 * N, i += 4) {
      float* out = dst + i * stride;
      const auto a = Load(d, r, c), b = Load(d, r, c + N), e = Load(d, r, c + 2 * N), f = Load(d, r, c + 3 * N);
      hn::Store(a, d, out);
      hn::Store(b, d, out + stride);
      hn::Store(e, d, out + 2 * stride);
      hn::Store(f, d, out + 3 * stride);
    }
    for (; c + N <= depth; c += N, ++i) hn::Store(Load(d, r, c), d, dst + i * stride);
    if (c < depth) hn::Store(LoadPartial(d, r, c, depth - c), d, dst + i * stride);
  }
  // The lines of keys / values [lo, hi), into the streams of `ahead`.
  void AheadKeys(LineStream& ahead, int64_t lo, int64_t hi) const {
    kr.Runs(lo, hi, sizeof(T), kdim * sizeof(T), [&](int64_t at, size_t bytes) { ahead.Add(0, k + at, bytes); });
  }
  void AheadValues(LineStream& ahead, int64_t lo, int64_t hi) const {
    vr.Runs(lo, hi, sizeof(T), vdim * sizeof(T), [&](int64_t at, size_t bytes) { ahead.Add(2, v + at, bytes); });
  }
};

// Scale words per group of a kBits cache (kv_cache.h).
template <int kBits>
constexpr size_t kScaleWords = static_cast<size_t>(cache_group_words(kBits));

// Group g's scales and minima for the lanes from lane0 of a tile's scale words (word e of lane l
// at words[kCacheKeyTile · e + l]): int4's bfloat16 halves widened by a shift and an and. D: a
// float descriptor (the intrinsics paths take Full256's or DF's .raw).
template <int kBits, class D>
HWY_INLINE void GroupScales(D d, const uint32_t* words, size_t g, size_t lane0, hn::Vec<D>& step, hn::Vec<D>& lo) {
  const hn::RebindToUnsigned<D> du;
  constexpr size_t kTile = static_cast<size_t>(kCacheKeyTile);
  if constexpr (kBits == 8) {
    step = hn::BitCast(d, hn::LoadU(du, words + 2 * g * kTile + lane0));
    lo = hn::BitCast(d, hn::LoadU(du, words + (2 * g + 1) * kTile + lane0));
  } else {
    const auto word = hn::LoadU(du, words + g * kTile + lane0);
    step = hn::BitCast(d, hn::ShiftLeft<16>(word));
    lo = hn::BitCast(d, hn::And(word, hn::Set(du, 0xFFFF0000u)));
  }
}

template <int kBits>
struct QuantKv {
  // A value row: its codes, and its scale words in its lane of their tile (kv_cache.h: word e
  // at scales[kCacheKeyTile · e]); scale(2g) and scale(2g + 1) are group g's scale and minimum.
  struct Row {
    const uint8_t* codes;
    const uint32_t* scales;
    float scale(size_t e) const {
      constexpr size_t kTile = static_cast<size_t>(kCacheKeyTile);
      if constexpr (kBits == 8) return cache_word_float(scales[kTile * e]);
      const uint32_t word = scales[kTile * (e / 2)];
      return e % 2 ? cache_group_minimum(word) : cache_group_scale(word);
    }
  };
  // The codes and transposed scales of the kCacheKeyTile keys of a tile (kv_cache.h).
  struct Tile {
    const uint8_t* codes;
    const uint32_t* scales;
  };
  static constexpr bool kPadded = true;  // rows hold whole groups of 32 values (N divides 32)
  static constexpr bool kOutliers = true;  // keys may have outlier channels (after the groups' scales)
  static constexpr bool kKeyTiles = true;
  static constexpr int kCodeBits = kBits;
  static constexpr size_t kGroup = static_cast<size_t>(kCacheQuantGroup);
  static constexpr size_t kGroupBytes = kGroup * kBits / 8;  // a group's codes
  const uint8_t* k;
  const uint8_t* v;
  const uint32_t* ksc;
  const uint32_t* vsc;
  RowOffset kr, vr, ksr, vsr;
  size_t kbytes, vbytes;  // a key's / value's codes: whole groups of kBits each
  size_t kgroups;         // a key's groups (of its padded row)
  QuantKv(const AttentionParams& p, int64_t b, int64_t hk)
      : k(static_cast<const uint8_t*>(p.k) + PlaneStart(p, p.k_stride, b, hk)),
        v(static_cast<const uint8_t*>(p.v) + PlaneStart(p, p.v_stride, b, hk)),
        ksc(p.k_scales + PlaneStart(p, p.k_scale_stride, b, hk)),
        vsc(p.v_scales + PlaneStart(p, p.v_scale_stride, b, hk)),
        kr(p, b, p.k_stride[0], p.k_stride[2]), vr(p, b, p.v_stride[0], p.v_stride[2]),
        ksr(p, b, p.k_scale_stride[0], p.k_scale_stride[2]), vsr(p, b, p.v_scale_stride[0], p.v_scale_stride[2]),
        kbytes(RowBytes(p.head_dim_qk)), vbytes(RowBytes(p.head_dim_v)), kgroups(kbytes / kGroupBytes) {}
  static size_t RowBytes(int64_t dim) {
    return (static_cast<size_t>(dim) + kGroup - 1) / kGroup * kGroupBytes;
  }
  // The tile of keys j .. j + kCacheKeyTile (j a multiple of it): row j of a plane or a page is
  // where its tile starts.
  Tile KeyTile(int64_t j) const { return {k + kr(j), ksc + ksr(j)}; }
  // Value j's codes and its lane of its scales' tile (tile start: row j − lane of the plane or page).
  Row value(int64_t j) const {
    const int64_t lane = j % kCacheKeyTile;
    return {v + vr(j), vsc + vsr(j - lane) + lane};
  }
  static constexpr size_t kColumnAlign = kGroup;  // Columns starts at a group
  static Row Columns(Row r, size_t c0) {
    return {r.codes + c0 / kGroup * kGroupBytes, r.scales + c0 / kGroup * kScaleWords<kBits> * kCacheKeyTile};
  }
  // Codes [i, i + N) of group g as float (i a multiple of N, N divides the group).
  HWY_INLINE static hn::Vec<DF> Codes(DF d, Row r, size_t g, size_t i) {
    const hn::Rebind<uint8_t, DF> d8;
    const hn::RebindToSigned<DF> di;
    hn::Vec<decltype(di)> x;
    if constexpr (kBits == 8) {
      x = hn::PromoteTo(di, hn::LoadU(d8, r.codes + g * kGroupBytes + i));
    } else {  // byte i of the group's 16 holds value i (low nibble) and value i + 16 (high)
      x = hn::PromoteTo(di, hn::LoadU(d8, r.codes + g * kGroupBytes + i % (kGroup / 2)));
      x = i < kGroup / 2 ? hn::And(x, hn::Set(di, 0xF)) : hn::ShiftRight<4>(x);
    }
    return hn::ConvertTo(d, x);
  }
  HWY_INLINE hn::Vec<DF> Load(DF d, Row r, size_t c) const {
    const size_t g = c / kGroup;
    return hn::MulAdd(Codes(d, r, g, c % kGroup), hn::Set(d, r.scale(2 * g)), hn::Set(d, r.scale(2 * g + 1)));
  }
  HWY_INLINE hn::Vec<DF> LoadPartial(DF d, Row r, size_t c, size_t) const { return Load(d, r, c); }
  // The lines of the key tiles that hold keys [lo, hi) / of values [lo, hi), into the streams of
  // `ahead`.
  void AheadKeys(LineStream& ahead, int64_t lo, int64_t hi) const {
    lo = lo / kCacheKeyTile * kCacheKeyTile;
    hi = (hi + kCacheKeyTile - 1) / kCacheKeyTile * kCacheKeyTile;
    const size_t scales = (kgroups * kScaleWords<kBits> + kCacheKeyOutliers) * sizeof(uint32_t);
    kr.Runs(lo, hi, 1, kbytes, [&](int64_t at, size_t bytes) { ahead.Add(0, k + at, bytes); });
    ksr.Runs(lo, hi, sizeof(uint32_t), scales, [&](int64_t at, size_t bytes) { ahead.Add(1, ksc + at, bytes); });
  }
  void AheadValues(LineStream& ahead, int64_t lo, int64_t hi) const {
    const size_t scales = vbytes / kGroupBytes * kScaleWords<kBits> * sizeof(uint32_t);
    vr.Runs(lo, hi, 1, vbytes, [&](int64_t at, size_t bytes) { ahead.Add(2, v + at, bytes); });
    lo = lo / kCacheKeyTile * kCacheKeyTile;  // the scales' tiles
    hi = (hi + kCacheKeyTile - 1) / kCacheKeyTile * kCacheKeyTile;
    vsr.Runs(lo, hi, sizeof(uint32_t), scales, [&](int64_t at, size_t bytes) { ahead.Add(3, vsc + at, bytes); });
  }
};

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_KV_INL_H_
