// The key scores of the decode kernel (flash_decode.cc) with dot-product instructions or their
// own layout: int8/int4 key tiles scored with float FMAs on every target (TileScores) or with
// integer dot products on a query rounded to 16 or 8 bits by QueryDots (TileDots: AVX-512 VNNI;
// TileDots256: AVX2's vpmaddubsw / vpmaddwd, on the AVX2 target and on AVX3 CPUs without VNNI; the
// same integer sums), and bfloat16 keys with bfloat16 dot products (Bf16Scores, on the query's
// words from QueryBf16). The value passes with dot products are in decode_int4_values-inl.h and
// decode_int8_values-inl.h. The dot products are intrinsics: AVX-512 VNNI / BF16 ones in functions
// compiled for those features on top of the AVX3 target's flags (Highway 1.0 has no 8-bit or
// bfloat16 dot product op; docs/ARCHITECTURE.md), AVX2 ones in the AVX2 and AVX3 targets' own
// code. The kernel takes them where the CPU has them (decode_int8_dots(), decode_avx512_vnni(),
// decode_bf16_dots()): MHA_DECODE_INT_DOTS says whether this target has the integer ones at all,
// MHA_DECODE_DOTS whether it has the AVX-512 ones (the int4 value passes' AVX-512 ones with them).
#if defined(MHA_KERNELS_CPU_DECODE_QUANT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
#undef MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/decode_block-inl.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/transpose-inl.h"
#include "mha/half.h"
#include "mha/kv_cache.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

// S[r][x] for RT rows and the N keys of a tile from lane0 (a multiple of N) of an int8/int4
// cache (kv_cache.h: the codes of 16 keys by words of 4 bytes per key, the scales transposed).
// Each word is split into its channels' codes as floats, keys in the lanes, and multiplied into
// each row's sum for the group; a group's sums are then scaled, and its minimum times the row's
// sum of the group's query entries (qsum) added: S = Σ_g scale_g·Σ_c q_c·code_c + minimum_g·Σ_c q_c,
// then the outlier channels' exact values times their query entries (qo). No stage and no
// horizontal sums: the scale and minimum apply once per group of 32 channels.
template <int kBits, size_t RT>
HWY_INLINE void TileScores(DF d, const uint8_t* codes, const uint32_t* scales, size_t lane0, size_t groups,
                           const float* q, size_t ldq, const float* qsum, const float* qo, size_t nout, float* s,
                           size_t lds, LineStream& ahead) {
  using V = hn::Vec<DF>;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  constexpr size_t kTile = static_cast<size_t>(kCacheKeyTile), kWordBytes = static_cast<size_t>(kCacheKeyTileBytes);
  constexpr size_t kPerWord = 32 / kBits, kWords = static_cast<size_t>(kCacheQuantGroup) / kPerWord;
  const auto mask = hn::Set(du, (1u << kBits) - 1);
  V acc[RT];
  for (size_t r = 0; r < RT; ++r) acc[r] = hn::Zero(d);
  for (size_t g = 0; g < groups; ++g) {
    ahead.Issue(kFloatWork * RT * hn::Lanes(d) * kCacheQuantGroup);  // the group's multiply-adds
    V sum[RT];
    for (size_t r = 0; r < RT; ++r) sum[r] = hn::Zero(d);
    for (size_t w = 0; w < kWords; ++w) {
      // The lanes' words (4-byte aligned; LoadU reads them as bytes, whatever their type).
      const auto x = hn::LoadU(du, reinterpret_cast<const uint32_t*>(codes + (g * kWords + w) * kWordBytes) + lane0);
      for (size_t k = 0; k < kPerWord; ++k) {
        // int8: byte k is channel k; int4: byte k % 4, the high nibble from k = 4 on.
        const int shift = static_cast<int>(k % 4 * 8 + k / 4 * 4);
        const V code = hn::ConvertTo(d, hn::BitCast(di, hn::And(hn::ShiftRightSame(x, shift), mask)));
        const float* qc = q + g * static_cast<size_t>(kCacheQuantGroup) + w * kPerWord + k;
        for (size_t r = 0; r < RT; ++r) sum[r] = hn::MulAdd(code, hn::Set(d, qc[r * ldq]), sum[r]);
      }
    }
    V step, lo;
    GroupScales<kBits>(d, scales, g, lane0, step, lo);
    for (size_t r = 0; r < RT; ++r)
      acc[r] = hn::MulAdd(sum[r], step, hn::MulAdd(lo, hn::Set(d, qsum[r * groups + g]), acc[r]));
  }
  for (size_t i = 0; i < nout; ++i) {
    const V x = hn::BitCast(d, hn::LoadU(du, scales + (kScaleWords<kBits> * groups + i) * kTile + lane0));
    for (size_t r = 0; r < RT; ++r)
      acc[r] = hn::MulAdd(x, hn::Set(d, qo[r * static_cast<size_t>(kCacheKeyOutliers) + i]), acc[r]);
  }
  for (size_t r = 0; r < RT; ++r) hn::Store(acc[r], d, s + r * lds);
}

#undef MHA_DECODE_INT_DOTS
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
// The query rows of TileDots and TileDots256, each rounded to integers q ≈ qscale[r] · code:
// kBytes (int4 keys): 8-bit codes (|·| ≤ 127), packed 4 channels (bytes) to a word of qh;
// kSplit (int8 keys, VNNI): 16-bit codes 256·h + l (|·| ≤ 127·256, h ∈ [-127, 127], l ∈ [-128,
// 127]), h's bytes in qh and l's in ql, as kBytes packs them; kHalves (int8 keys, AVX2): the same
// 16-bit codes whole, 2 channels to a word of qh (a row's 2 · ldw words, ql unused). A row's words
// start at r · ldw for bytes, r · 2 · ldw for halves (ldw = ldq / 4). False if a row has a value
// that is not finite (the float path then keeps its NaN). ql may be null unless the form is kSplit.
enum class QueryForm { kBytes, kSplit, kHalves };
inline bool QueryDots(DF d, const float* q, size_t ldq, int64_t R, QueryForm form, int32_t* qh, int32_t* ql,
                      float* qscale) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<int8_t, decltype(di)> d8;
  const hn::Rebind<int16_t, decltype(di)> d16;
  const size_t N = hn::Lanes(d);
  const float top_code = form == QueryForm::kBytes ? 127.0f : 32512.0f;  // 127 or 127 · 256
  for (int64_t r = 0; r < R; ++r) {
    const float* x = q + r * static_cast<int64_t>(ldq);
    auto top = hn::Zero(d);
    for (size_t c = 0; c < ldq; c += N) {
      const auto v = hn::Load(d, x + c);
      if (!hn::AllTrue(d, hn::IsFinite(v))) return false;
      top = hn::Max(top, hn::Abs(v));
    }
    const float t = hn::GetLane(hn::MaxOfLanes(d, top));
    qscale[r] = t > 0.0f ? t / top_code : 1.0f;
    const auto inv = hn::Set(d, 1.0f / qscale[r]);
    const auto limit = hn::Set(di, static_cast<int32_t>(top_code));
    // Bytes in channel order: byte k of word w is channel 4w + k (little-endian words); halves
    // likewise, half k of word w channel 2w + k.
    auto* h8 = reinterpret_cast<int8_t*>(qh + r * static_cast<int64_t>(ldq / 4));
    auto* l8 = form == QueryForm::kSplit ? reinterpret_cast<int8_t*>(ql + r * static_cast<int64_t>(ldq / 4)) : nullptr;
    auto* h16 = reinterpret_cast<int16_t*>(qh + r * static_cast<int64_t>(ldq / 2));
    for (size_t c = 0; c < ldq; c += N) {
      auto v = hn::NearestInt(hn::Mul(hn::Load(d, x + c), inv));
      v = hn::Min(hn::Max(v, hn::Neg(limit)), limit);
      if (form == QueryForm::kBytes) {
        hn::StoreU(hn::DemoteTo(d8, v), d8, h8 + c);
      } else if (form == QueryForm::kHalves) {
        hn::StoreU(hn::DemoteTo(d16, v), d16, h16 + c);
      } else {
        const auto h = hn::ShiftRight<8>(hn::Add(v, hn::Set(di, 128)));  // ⌊(v + 128) / 256⌋
        const auto l = hn::Sub(v, hn::ShiftLeft<8>(h));
        hn::StoreU(hn::DemoteTo(d8, h), d8, h8 + c);
        hn::StoreU(hn::DemoteTo(d8, l), d8, l8 + c);
      }
    }
  }
  return true;
}

// QueryDots's words (R rows of ldw) for TileDots256: each word repeated in the 8 lanes of a
// 256-bit vector (a row's at r · 8 · ldw), which its integer products then read from memory
// (L1). Broadcasting a word per product took a register and an instruction each: GCC spilled
// the int8 tile's accumulators to the stack, and each store-to-load round trip sat on a sum's
// chain.
inline void RepeatWords(const int32_t* qw, size_t ldw, int64_t R, int32_t* qv) {
  for (size_t i = 0; i < static_cast<size_t>(R) * ldw; ++i) std::fill_n(qv + i * 8, 8, qw[i]);
}

// TileScores with the 8-bit and 16-bit integer products of AVX2, for the 8 keys of a tile from
// lane0 (0 or 8; the AVX3 target takes this where its CPU has no VNNI, a call per half tile).
// The query rows are QueryDots's words repeated as vectors (RepeatWords; a row's at r · ldv).
// The integer sums are TileDots's, exactly; then scaled as there. int4 keys: vpmaddubsw multiplies
// the codes (unsigned bytes) by QueryDots's bytes (kBytes) and adds pairs into 16-bit lanes, with
// no saturation: a group's 8 products per lane stay within 8 · 15 · 127 = 15240 per nibble half,
// 30480 for both; vpmaddwd then adds the lane pairs into a key's 32-bit sum. int8 keys: a key's
// word of 4 codes is shuffled into two 32-bit lanes of 16-bit codes (channels 0 and 1 in one
// vector, 2 and 3 in another: a key per lane), which meet the 16-bit query (kHalves) in vpmaddwd
// (|Σ| ≤ 32 · 255 · 32512 < 2^31, as in TileDots). Widening the codes to 16 bits in channel order
// put a key in two lanes, joined by vphaddd and vpermq per group: two accumulators per row, of
// which GCC spilled two of 4 rows' 8; the cache-resident int8 step took 0.34 ms where this takes
// 0.30.
template <int kBits, size_t RT>
HWY_INLINE void TileDots256(const uint8_t* codes, const uint32_t* scales, size_t lane0, size_t groups,
                            const int32_t* qv, size_t ldv, const float* qscale, const float* qsum, const float* qo,
                            size_t nout, float* s, size_t lds, LineStream& ahead) {
  constexpr size_t kTile = static_cast<size_t>(kCacheKeyTile), kWordBytes = static_cast<size_t>(kCacheKeyTileBytes);
  constexpr size_t kWords = static_cast<size_t>(kCacheQuantGroup) * kBits / 32;  // tile words per group
  // Query words (vectors of qv) per group: 8 of bytes (int4), 16 of halves (int8).
  constexpr size_t kGroupWords = static_cast<size_t>(kCacheQuantGroup) / (kBits == 4 ? 4 : 2);
  static_assert(kCacheQuantGroup == 32 && kCacheKeyTile == 16, "4 int4 words or 8 int8 words per group");
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  // A key's word of 4 int8 codes as two 16-bit pairs: channels 0 and 1, channels 2 and 3.
  const __m256i even_pair = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4,
                                             -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const __m256i odd_pair = _mm256_add_epi8(even_pair, _mm256_set1_epi16(2));
  // The call's multiply-adds (8 keys), asked for once: per group, the call (it clobbers every
  // vector register) made GCC spill and reload the rows' accumulators around it each time.
  ahead.Issue(kAvx2IntWork * RT * 8 * kCacheQuantGroup * groups);
  __m256 acc[RT];
  for (size_t r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
  for (size_t g = 0; g < groups; ++g) {
    __m256i sum[RT];
    if constexpr (kBits == 4) {
      __m256i pairs[RT];  // 16-bit pair sums of the group's products
      for (size_t r = 0; r < RT; ++r) pairs[r] = _mm256_setzero_si256();
      // Not unrolled: GCC 12 unrolled the 4 words and regrouped the 16-bit sums (integer adds
      // reassociate) into a tree over all 32 products of a row group, which spilled them to the
      // stack; the cache-resident int4 step took 0.290 ms, not 0.270.
#pragma GCC unroll 1
      for (size_t w = 0; w < kWords; ++w) {  // low nibbles: channels 8w .. 8w + 3; high: 8w + 4 .. 8w + 7
        const uint8_t* p = codes + (g * kWords + w) * kWordBytes + lane0 * 4;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i lo = _mm256_and_si256(x, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble);
        const int32_t* q0 = qv + (g * kGroupWords + 2 * w) * 8;
        for (size_t r = 0; r < RT; ++r) {
          const auto* q = reinterpret_cast<const __m256i*>(q0 + r * ldv);
          const __m256i a = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(q));
          const __m256i b = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(q + 1));
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_add_epi16(a, b));
        }
      }
      for (size_t r = 0; r < RT; ++r) sum[r] = _mm256_madd_epi16(pairs[r], ones);
    } else {
      for (size_t r = 0; r < RT; ++r) sum[r] = _mm256_setzero_si256();
      for (size_t w = 0; w < kWords; ++w) {  // channels 4w .. 4w + 3 of the group
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (g * kWords + w) * kWordBytes + lane0 * 4));
        const __m256i x01 = _mm256_shuffle_epi8(x, even_pair), x23 = _mm256_shuffle_epi8(x, odd_pair);
        const int32_t* q0 = qv + (g * kGroupWords + 2 * w) * 8;  // channels 4w and 4w + 1, then 4w + 2 and 4w + 3
        for (size_t r = 0; r < RT; ++r) {
          const auto* q = reinterpret_cast<const __m256i*>(q0 + r * ldv);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(x01, _mm256_loadu_si256(q)),
                                                             _mm256_madd_epi16(x23, _mm256_loadu_si256(q + 1))));
        }
      }
    }
    const hn::Full256<float> d256;  // 8 lanes, whatever the target
    hn::Vec<decltype(d256)> group_step, group_lo;
    GroupScales<kBits>(d256, scales, g, lane0, group_step, group_lo);
    const __m256 step = group_step.raw, lo = group_lo.raw;
    for (size_t r = 0; r < RT; ++r) {
      acc[r] = _mm256_fmadd_ps(lo, _mm256_set1_ps(qsum[r * groups + g]), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(step, _mm256_set1_ps(qscale[r])), acc[r]);
    }
  }
  for (size_t i = 0; i < nout; ++i) {
    const auto* at = reinterpret_cast<const __m256i*>(scales + (kScaleWords<kBits> * groups + i) * kTile + lane0);
    const __m256 x = _mm256_castsi256_ps(_mm256_loadu_si256(at));
    for (size_t r = 0; r < RT; ++r)
      acc[r] = _mm256_fmadd_ps(x, _mm256_set1_ps(qo[r * static_cast<size_t>(kCacheKeyOutliers) + i]), acc[r]);
  }
  for (size_t r = 0; r < RT; ++r) _mm256_storeu_ps(s + r * lds, acc[r]);
}

#define MHA_DECODE_INT_DOTS 1
#else
#define MHA_DECODE_INT_DOTS 0
#endif

#undef MHA_DECODE_DOTS
#if HWY_TARGET == HWY_AVX3
// TileScores with 8-bit integer dot products (AVX-512 VNNI, checked at run time: the AVX3 target
// does not imply it). int8 keys meet the query rows as 16-bit integers q ≈ qscale · (256·h + l), h
// and l signed bytes, packed 4 channels to a word (qh, ql: a row's words at r · ldw): per group
// vpdpbusd sums 4 code × byte products per key into 32-bit lanes, for h and for l; 256·Σh + Σl is
// exact in int32 (|Σ| ≤ 32 · 255 · 127 · 257 < 2^31), then scaled as in TileScores. int4 keys meet
// them as 8-bit integers q ≈ qscale · h (ql unused): half the dot products, and a rounding an
// order of magnitude below the int4 codes' own (docs/numerics.md). Rounding q moves a score by at
// most qscale/2 · Σ_c scale_g·code_c. 16 lanes: a tile per vector.
template <int kBits, size_t RT>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512vnni"))) void TileDots(
    const uint8_t* codes, const uint32_t* scales, size_t groups, const int32_t* qh, const int32_t* ql, size_t ldw,
    const float* qscale, const float* qsum, const float* qo, size_t nout, float* s, size_t lds, LineStream& ahead) {
  constexpr size_t kTile = static_cast<size_t>(kCacheKeyTile), kWordBytes = static_cast<size_t>(kCacheKeyTileBytes);
  constexpr size_t kWords = static_cast<size_t>(kCacheQuantGroup) * kBits / 32;  // tile words per group
  constexpr size_t kGroupWords = static_cast<size_t>(kCacheQuantGroup) / 4;     // query words per group
  static_assert(kCacheKeyTile == 16, "a tile per vector of 16 lanes");
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[RT];
  for (size_t r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (size_t g = 0; g < groups; ++g) {
    ahead.Issue(kVnniWork * RT * 16 * kCacheQuantGroup);  // the group's multiply-adds: 16 keys
    __m512i sh[RT], sl[RT];
    for (size_t r = 0; r < RT; ++r) sh[r] = sl[r] = _mm512_setzero_si512();
    for (size_t w = 0; w < kWords; ++w) {
      const __m512i x = _mm512_loadu_si512(codes + (g * kWords + w) * kWordBytes);
      if constexpr (kBits == 8) {  // byte k: channel 4w + k of the group
        const size_t qw = g * kGroupWords + w;
        for (size_t r = 0; r < RT; ++r) {
          sh[r] = _mm512_dpbusd_epi32(sh[r], x, _mm512_set1_epi32(qh[r * ldw + qw]));
          sl[r] = _mm512_dpbusd_epi32(sl[r], x, _mm512_set1_epi32(ql[r * ldw + qw]));
        }
      } else {  // low nibbles: channels 8w .. 8w + 3 of the group; high nibbles: 8w + 4 .. 8w + 7
        const __m512i lo = _mm512_and_si512(x, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
        const size_t qw = g * kGroupWords + 2 * w;
        for (size_t r = 0; r < RT; ++r) {  // low and high nibbles into separate sums: two chains
          sh[r] = _mm512_dpbusd_epi32(sh[r], lo, _mm512_set1_epi32(qh[r * ldw + qw]));
          sl[r] = _mm512_dpbusd_epi32(sl[r], hi, _mm512_set1_epi32(qh[r * ldw + qw + 1]));
        }
      }
    }
    hn::Vec<DF> group_step, group_lo;  // DF: 16 lanes (AVX3), a tile
    GroupScales<kBits>(DF(), scales, g, 0, group_step, group_lo);
    const __m512 step = group_step.raw, lo = group_lo.raw;
    for (size_t r = 0; r < RT; ++r) {
      const __m512i high = kBits == 8 ? _mm512_slli_epi32(sh[r], 8) : sh[r];  // int8: 256·Σh + Σl
      const __m512i sum = _mm512_add_epi32(high, sl[r]);
      const __m512 dot = _mm512_cvtepi32_ps(sum);
      acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(qsum[r * groups + g]), acc[r]);
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(step, _mm512_set1_ps(qscale[r])), acc[r]);
    }
  }
  for (size_t i = 0; i < nout; ++i) {
    const __m512 x = _mm512_castsi512_ps(_mm512_loadu_si512(scales + (kScaleWords<kBits> * groups + i) * kTile));
    for (size_t r = 0; r < RT; ++r)
      acc[r] = _mm512_fmadd_ps(x, _mm512_set1_ps(qo[r * static_cast<size_t>(kCacheKeyOutliers) + i]), acc[r]);
  }
  for (size_t r = 0; r < RT; ++r) _mm512_storeu_ps(s + r * lds, acc[r]);
}

// The query rows of Bf16Scores: row r of q (ldq floats, unscaled, zeros past the head dim) as
// bfloat16, 2 channels to a dword, a row's words at r · ldw (2 · ldw ≥ ldq channels, zeros past
// ldq). Exact: the kernel meets bfloat16 keys only with a bfloat16 query (p.dtype). False if a
// value is not finite (the float path then keeps its Inf or NaN).
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) inline bool QueryBf16(const float* q, size_t ldq, int64_t R,
                                                                                 uint32_t* qw, size_t ldw) {
  for (int64_t r = 0; r < R; ++r) {
    const float* x = q + r * static_cast<int64_t>(ldq);
    for (size_t c = 0; c < 2 * ldw; c += 32) {
      const __m512 x0 = c < ldq ? _mm512_loadu_ps(x + c) : _mm512_setzero_ps();
      const __m512 x1 = c + 16 < ldq ? _mm512_loadu_ps(x + c + 16) : _mm512_setzero_ps();
      if ((NotFinite(x0) | NotFinite(x1)) != 0) return false;
      _mm512_storeu_si512(qw + r * static_cast<int64_t>(ldw) + c / 2,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)));
    }
  }
  return true;
}

// Bf16Scores for the RT rows from q (a row's words ldw apart) into s (a row's lds apart): the
// bits of the rows with a score that is not finite.
template <size_t RT>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) HWY_INLINE uint32_t Bf16ScoreRows(
    const uint32_t* q, size_t ldw, const bfloat16* const* krows, size_t depth, float scale, float* s, size_t lds,
    LineStream& ahead) {
  const size_t full = depth / 32, rest = depth % 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << rest) - 1);
  __m512 part[RT][4];  // row r's SumLanesOfFour of keys 4g .. 4g + 3
  for (size_t g = 0; g < 4; ++g) {
    ahead.Issue(kFloatWork * RT * 4 * depth);  // the multiply-adds of four keys
    const bfloat16* k[4] = {krows[4 * g], krows[4 * g + 1], krows[4 * g + 2], krows[4 * g + 3]};
    __m512 acc[RT][4];
    for (size_t r = 0; r < RT; ++r)
      for (size_t x = 0; x < 4; ++x) acc[r][x] = _mm512_setzero_ps();
    for (size_t v = 0; v < full + (rest ? 1 : 0); ++v) {
      __m512bh kv[4];
      for (size_t x = 0; x < 4; ++x) {
        const bfloat16* p = k[x] + v * 32;
        kv[x] = reinterpret_cast<__m512bh>(v < full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(tail, p));
      }
      for (size_t r = 0; r < RT; ++r) {
        const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + r * ldw + v * 16));
        for (size_t x = 0; x < 4; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], kv[x], qv);
      }
    }
    for (size_t r = 0; r < RT; ++r) part[r][g] = SumLanesOfFour(acc[r]);
  }
  uint32_t bad = 0;
  for (size_t r = 0; r < RT; ++r) {
    const __m512 scores = _mm512_mul_ps(JoinFours(part[r]), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + r * lds, scores);
    if (NotFinite(scores) != 0) bad |= uint32_t{1} << r;
  }
  return bad;
}

// S[r][x] for R rows and the N = 16 keys krows[x] of a bfloat16 cache with bfloat16 dot
// products (AVX-512 BF16, checked at run time): per row, key and 32 channels one vdpbf16ps adds
// 32 products to 16 float32 lanes (QueryBf16's words against the key's as stored; D % 32
// channels of a last vector by a masked load), no stage. The products of two bfloat16 are exact
// in float32; the sums are float32 in another order than the float path's, and the scale
// multiplies the sums (the query comes unscaled), so the scores are not its bits (docs/numerics.md).
// vdpbf16ps takes denormal inputs as zero and flushes denormal results. Keys by fours against up
// to kTileRows rows (16 sums), each key vector loaded once for those rows and each query vector
// once per four keys; a row's four sums are then reduced to one vector (SumLanesOfFour), and its
// four such vectors to the 16 scores (JoinFours): a row's sums and their order are
// SumLanesOfEach's over its 16 keys' sums, as when each row took its 16 keys alone (which loaded
// every key vector once per row: 16 key rows' pointers and sums did not fit the registers, and
// the cache-resident bfloat16 step took 18–20% longer on an AMD EPYC Zen 4, docs/benchmarks.md).
// Returns the rows (bit r) with a score that is not finite, for the caller to score with the
// float path.
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) inline uint32_t Bf16Scores(const uint32_t* qw,
                                                                                     size_t ldw, int64_t R,
                                                                                     const bfloat16* const* krows,
                                                                                     size_t depth, float scale,
                                                                                     float* s, size_t lds,
                                                                                     LineStream& ahead) {
  static_assert(kMaxDecodeRows <= 32, "a bit per row");
  // WithTileRows's switch by hand: its lambda would need this function's target attribute, and
  // GCC 12 then calls it instead of inlining it (the cache-resident bfloat16 step 3% slower).
  static_assert(kTileRows == 4, "a case for each row count up to kTileRows");
  uint32_t bad = 0;
  for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
    const uint32_t* q = qw + r0 * static_cast<int64_t>(ldw);
    float* sr = s + r0 * static_cast<int64_t>(lds);
    uint32_t b = 0;
    switch (std::min<int64_t>(kTileRows, R - r0)) {
      case 1: b = Bf16ScoreRows<1>(q, ldw, krows, depth, scale, sr, lds, ahead); break;
      case 2: b = Bf16ScoreRows<2>(q, ldw, krows, depth, scale, sr, lds, ahead); break;
      case 3: b = Bf16ScoreRows<3>(q, ldw, krows, depth, scale, sr, lds, ahead); break;
      default: b = Bf16ScoreRows<4>(q, ldw, krows, depth, scale, sr, lds, ahead); break;
    }
    bad |= b << r0;
  }
  return bad;
}

#define MHA_DECODE_DOTS 1
#else
#define MHA_DECODE_DOTS 0
#endif

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
