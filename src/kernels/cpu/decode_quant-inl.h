// The parts of the decode kernel (flash_decode.cc) with dot-product instructions or their own
// layout: int8/int4 key tiles scored with float FMAs on every target (TileScores) or with integer
// dot products on a query rounded to 16 or 8 bits by QueryDots (TileDots: AVX-512 VNNI;
// TileDots256: AVX2's vpmaddubsw / vpmaddwd, on the AVX2 target and on AVX3 CPUs without VNNI; the
// same integer sums), an int4 cache's values with bfloat16 dot products (Int4Output, on weights
// rounded by PairWeights) or 8-bit integer products on weights rounded to bytes by ByteValueWeights
// (Int4Output256: AVX2; Int4OutputVnni: AVX-512 VNNI), and bfloat16 keys with bfloat16 dot products
// (Bf16Scores, on the query's words from QueryBf16). The dot products are intrinsics: AVX-512 VNNI
// / BF16 ones in functions compiled for those features on top of the AVX3 target's flags (Highway
// 1.0 has no 8-bit or bfloat16 dot product op; docs/ARCHITECTURE.md), AVX2 ones in the AVX2 and
// AVX3 targets' own code. The kernel takes them where the CPU has them (decode_int8_dots(),
// decode_avx512_vnni(), decode_bf16_dots(), decode_byte_values(), decode_vnni_byte_values()):
// MHA_DECODE_INT_DOTS says whether this target has the integer ones at all, MHA_DECODE_DOTS whether
// it has the AVX-512 ones, MHA_DECODE_BYTE_VALUES whether it has ByteValueWeights.
#if defined(MHA_KERNELS_CPU_DECODE_QUANT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
#undef MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_QUANT_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
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
HWY_INLINE void TileScores(DF d, const uint8_t* codes, const float* scales, size_t lane0, size_t groups,
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
    const V step = hn::LoadU(d, scales + 2 * g * kTile + lane0);
    const V lo = hn::LoadU(d, scales + (2 * g + 1) * kTile + lane0);
    for (size_t r = 0; r < RT; ++r)
      acc[r] = hn::MulAdd(sum[r], step, hn::MulAdd(lo, hn::Set(d, qsum[r * groups + g]), acc[r]));
  }
  for (size_t i = 0; i < nout; ++i) {
    const V x = hn::LoadU(d, scales + (2 * groups + i) * kTile + lane0);
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
HWY_INLINE void TileDots256(const uint8_t* codes, const float* scales, size_t lane0, size_t groups,
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
  __m256 acc[RT];
  for (size_t r = 0; r < RT; ++r) acc[r] = _mm256_setzero_ps();
  for (size_t g = 0; g < groups; ++g) {
    ahead.Issue(kAvx2IntWork * RT * 8 * kCacheQuantGroup);  // the group's multiply-adds: 8 keys
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
    const __m256 step = _mm256_loadu_ps(scales + 2 * g * kTile + lane0);
    const __m256 lo = _mm256_loadu_ps(scales + (2 * g + 1) * kTile + lane0);
    for (size_t r = 0; r < RT; ++r) {
      acc[r] = _mm256_fmadd_ps(lo, _mm256_set1_ps(qsum[r * groups + g]), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(step, _mm256_set1_ps(qscale[r])), acc[r]);
    }
  }
  for (size_t i = 0; i < nout; ++i) {
    const __m256 x = _mm256_loadu_ps(scales + (2 * groups + i) * kTile + lane0);
    for (size_t r = 0; r < RT; ++r)
      acc[r] = _mm256_fmadd_ps(x, _mm256_set1_ps(qo[r * static_cast<size_t>(kCacheKeyOutliers) + i]), acc[r]);
  }
  for (size_t r = 0; r < RT; ++r) _mm256_storeu_ps(s + r * lds, acc[r]);
}

#define MHA_DECODE_INT_DOTS 1
#else
#define MHA_DECODE_INT_DOTS 0
#endif

#undef MHA_DECODE_BYTE_VALUES
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3
// The weights of Int4Output256 and Int4OutputVnni for rows r < R (P at pr + r·ldp, the block's keys
// j < jn) and value groups g < groups: w_j = P_j·scale_g(j) rounded to a byte, u_j = round(w_j /
// step) with step the power of two at or above Pmax_r·Smax_g / 255 (Pmax_r: the row's largest P in
// the block, from the softmax; Smax_g: the keys' largest scale in the group), so that no weight
// passes 255 steps (Pmax_r·Smax_g would take 128 to 255): u[(g·R + r)·ldp + j] (zeros from jn up to
// a whole vector), steps[g·R + r]. A power of two keeps w / step exact, so weights of 1 and 0, or
// all equal, are exact bytes. mins[g·R + r] = Σ_j P_j·(minimum_g(j) + 8·scale_g(j)), for the pass
// multiplies each u_j by code − 8. The keys' scales are first transposed into st (as
// FoldValueWeights does). False where a Pmax is not finite, or a scale is negative or a scale or
// minimum not finite: the float pass then takes the block. steps needs groups · (R + 1).
template <class Kv>
HWY_INLINE bool ByteValueWeights(DF d, const float* pr, size_t ldp, size_t R, const float* pmax,
                                 const typename Kv::Row* vrows, size_t jn, size_t groups, float* HWY_RESTRICT st,
                                 uint8_t* HWY_RESTRICT u, float* steps, float* mins) {
  for (size_t r = 0; r < R; ++r)
    if (!std::isfinite(pmax[r])) return false;
  TransposeValueScales<Kv>(d, ldp, vrows, jn, groups, st);
  // 256-bit vectors on both targets (AVX2's packs and permutes below).
  const hn::Full256<float> d8;
  using V = hn::Vec<decltype(d8)>;
  const size_t N = hn::Lanes(d8), jv = (jn + N - 1) / N * N;
  float* smax = steps + groups * R;
  if (!ValueScaleMaxima(d8, st, ldp, jv, groups, smax)) return false;  // before any weight is written
  // Bytes 0-3 of each 128-bit half after the packs: keys 0-3, 8-11 | 4-7, 12-15 (words), then
  // 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31 (bytes): dwords 0, 4, 1, 5, 2, 6, 3, 7 in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t g = 0; g < groups; ++g) {
    const float* scale = st + 2 * g * ldp;
    float* mid = st + (2 * g + 1) * ldp;
    for (size_t j = 0; j < jv; j += N)  // minimum + 8·scale
      hn::Store(hn::MulAdd(hn::Load(d8, scale + j), hn::Set(d8, 8.0f), hn::Load(d8, mid + j)), d8, mid + j);
    for (size_t r = 0; r < R; ++r) {
      const float* p = pr + r * ldp;
      const size_t i = g * R + r;
      steps[i] = PowerOfTwoAtOrAbove(pmax[r] * (smax[g] / 255.0f));  // finite, below 2^122
      const V inv = hn::Set(d8, steps[i] > 0.0f ? 1.0f / steps[i] : 0.0f);
      for (size_t j = 0; j < jv; j += 4 * N) {  // a last part may read past jv: its bytes are never used
        __m256i c[4];
        for (size_t k = 0; k < 4; ++k) {
          const V w = hn::Mul(hn::Load(d8, p + j + k * N), hn::Load(d8, scale + j + k * N));
          c[k] = _mm256_cvtps_epi32(hn::Mul(w, inv).raw);
        }
        const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + i * ldp + j), _mm256_permutevar8x32_epi32(b, order));
      }
    }
  }
  // mins: each row against 4 groups' mid rows at a time (4 independent sums), then the 4 sums
  // reduced together.
  for (size_t r = 0; r < R; ++r) {
    const float* p = pr + r * ldp;
    for (size_t g0 = 0; g0 < groups; g0 += 4) {
      const size_t ng = std::min<size_t>(4, groups - g0);
      __m256 m[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (size_t j = 0; j < jv; j += N) {
        const __m256 x = _mm256_loadu_ps(p + j);
        for (size_t k = 0; k < 4; ++k)
          if (k < ng) m[k] = _mm256_fmadd_ps(x, _mm256_loadu_ps(st + (2 * (g0 + k) + 1) * ldp + j), m[k]);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(m[0], m[1]), _mm256_hadd_ps(m[2], m[3]));
      float sums[4];
      _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      for (size_t k = 0; k < ng; ++k) mins[(g0 + k) * R + r] = sums[k];
    }
  }
  return true;
}

#define MHA_DECODE_BYTE_VALUES 1
#else
#define MHA_DECODE_BYTE_VALUES 0
#endif

#if HWY_TARGET == HWY_AVX2
// The value pass over an int4 cache with AVX2's 8-bit integer products, RT rows and the columns
// [c0, c0 + ncols) of one group (ncols ≤ 32): O = alpha·O + mins + Σ_j step·u_j·(code_j − 8)
// (ByteValueWeights's bytes u, steps and mins of the rows). Keys in pairs: the two keys' 16 bytes
// of the group interleaved, so that each 16-bit lane holds a column's two codes (low nibbles:
// columns 0-15, high: 16-31), and vpmaddubsw multiplies them by the pair's two weights and adds
// the products: 32 products per instruction, where an FMA has 8. The 16-bit sums take 8 pairs:
// |Σ| ≤ 16·255·8 = 32640, then are widened and added into O in float, times the step.
template <size_t RT, bool kWhole>
HWY_INLINE void Int4Output256(const uint8_t* u, size_t ldu, const QuantKv<4>::Row* vrows,
                              size_t c0, size_t ncols, size_t jn, const float* alpha, const float* mins,
                              const float* steps, float* o, size_t ldo, LineStream& ahead) {
  const size_t nv = kWhole ? 4 : (ncols + 7) / 8;
  for (size_t r = 0; r < RT; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]), m = _mm256_set1_ps(mins[r]);
    for (size_t v = 0; v < nv; ++v)
      _mm256_storeu_ps(o + r * ldo + v * 8, _mm256_fmadd_ps(_mm256_loadu_ps(o + r * ldo + v * 8), a, m));
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  // Key pairs [j, j1) into the rows' 16-bit sums.
  auto add_pairs = [&](size_t j, size_t j1, __m256i* lo, __m256i* hi) HWY_ATTR {
    for (; j < j1; j += 2) {
      ahead.Issue(kAvx2IntWork * 2 * RT * ncols);
      // An odd last key pairs with itself, weighted by u[jn] = 0.
      const __m128i xa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(QuantKv<4>::Columns(vrows[j], c0).codes));
      const __m128i xb = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(QuantKv<4>::Columns(vrows[std::min(j + 1, jn - 1)], c0).codes));
      const __m256i x = _mm256_set_m128i(_mm_unpackhi_epi8(xa, xb), _mm_unpacklo_epi8(xa, xb));
      const __m256i cl = _mm256_sub_epi8(_mm256_and_si256(x, nibble), eight);
      const __m256i ch = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), nibble), eight);
      for (size_t r = 0; r < RT; ++r) {
        int16_t pair;
        std::memcpy(&pair, u + r * ldu + j, sizeof(pair));
        const __m256i wv = _mm256_set1_epi16(pair);
        lo[r] = _mm256_add_epi16(_mm256_maddubs_epi16(wv, cl), lo[r]);
        hi[r] = _mm256_add_epi16(_mm256_maddubs_epi16(wv, ch), hi[r]);
      }
    }
  };
  for (size_t j0 = 0; j0 < jn; j0 += 16) {
    __m256i lo[RT], hi[RT];
    for (size_t r = 0; r < RT; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    add_pairs(j0, std::min(jn, j0 + 16), lo, hi);
    for (size_t r = 0; r < RT; ++r) {
      const __m256 st = _mm256_set1_ps(steps[r]);
      float* out = o + r * ldo;
      const __m256i s32[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[r])),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[r], 1)),
                              _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[r])),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[r], 1))};
      for (size_t v = 0; v < nv; ++v)
        _mm256_storeu_ps(out + v * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[v]), st, _mm256_loadu_ps(out + v * 8)));
    }
  }
}
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
    const uint8_t* codes, const float* scales, size_t groups, const int32_t* qh, const int32_t* ql, size_t ldw,
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
    const __m512 step = _mm512_loadu_ps(scales + 2 * g * kTile), lo = _mm512_loadu_ps(scales + (2 * g + 1) * kTile);
    for (size_t r = 0; r < RT; ++r) {
      const __m512i high = kBits == 8 ? _mm512_slli_epi32(sh[r], 8) : sh[r];  // int8: 256·Σh + Σl
      const __m512i sum = _mm512_add_epi32(high, sl[r]);
      const __m512 dot = _mm512_cvtepi32_ps(sum);
      acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(qsum[r * groups + g]), acc[r]);
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(step, _mm512_set1_ps(qscale[r])), acc[r]);
    }
  }
  for (size_t i = 0; i < nout; ++i) {
    const __m512 x = _mm512_loadu_ps(scales + (2 * groups + i) * kTile);
    for (size_t r = 0; r < RT; ++r)
      acc[r] = _mm512_fmadd_ps(x, _mm512_set1_ps(qo[r * static_cast<size_t>(kCacheKeyOutliers) + i]), acc[r]);
  }
  for (size_t r = 0; r < RT; ++r) _mm512_storeu_ps(s + r * lds, acc[r]);
}
// The value pass over an int4 cache with bfloat16 dot products (AVX-512 BF16, checked at run
// time): keys in pairs (j, j + 1), so that one vdpbf16ps adds P_j·V_j[c] + P_{j+1}·V_{j+1}[c]
// to column c's lane, 32 products per instruction where the float pass has 16 and a dequantizing
// FMA. P comes as bfloat16 pairs (PairWeights: the dword jp of a row holds P[2jp], P[2jp + 1]).
// The values come from a table per group and key pair: the 16 values min + scale·code of key
// j, then of key j + 1, as bfloat16 (32 words); vpermw picks each lane's word by its 4-bit code,
// plus 16 for key j + 1. Each rounding to bfloat16 (nearest even) moves its factor by at most
// 2^-8 of it, a product by at most 2^-7 (docs/numerics.md); the sums stay float32.
template <size_t RG, size_t NV>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) void Int4Output(
    const uint32_t* pw, size_t ldw, const QuantKv<4>::Row* vrows, size_t c0, size_t jn,
    const float* alpha, float* o, size_t ldo, LineStream& ahead) {
  static_assert(kCacheQuantGroup == 32, "a group is two vectors of 16 columns");
  constexpr size_t NG = (NV + 1) / 2;  // groups of the pass
  __m512 acc[RG][NV];
  for (size_t r = 0; r < RG; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (size_t c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + c * 16), a);
  }
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i second = _mm512_set1_epi32(0x00100000);  // word 2i + 1: key j + 1's half of the table
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  for (size_t j = 0; j < jn; j += 2) {
    // An odd last key pairs with itself, weighted by P[jn] = 0 (masked: keys past jn are -inf).
    const QuantKv<4>::Row a = QuantKv<4>::Columns(vrows[j], c0);
    const QuantKv<4>::Row b = QuantKv<4>::Columns(vrows[std::min(j + 1, jn - 1)], c0);
    ahead.Issue(kFloatWork * 2 * RG * NV * 16);
    for (size_t g = 0; g < NG; ++g) {
      const __m512 ta = _mm512_fmadd_ps(iota, _mm512_set1_ps(a.scales[2 * g]), _mm512_set1_ps(a.scales[2 * g + 1]));
      const __m512 tb = _mm512_fmadd_ps(iota, _mm512_set1_ps(b.scales[2 * g]), _mm512_set1_ps(b.scales[2 * g + 1]));
      const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(tb, ta));  // words 0-15: key j's
      // Byte i of a group's 16 holds column i (low nibble) and i + 16 (high): key j's bytes in the
      // low words of dwords, key j + 1's in the high.
      const __m512i w = _mm512_or_si512(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.codes + g * 16))),
          _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes + g * 16))),
                            16));
      const __m512i lo = _mm512_ternarylogic_epi32(w, nibble, second, 0xEA);  // (w & nibble) | second
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(w, 4), second);   // vpermw reads bits 0-4
      const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(lo, table));
      const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(hi, table));
      for (size_t r = 0; r < RG; ++r) {
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[r * ldw + j / 2])));
        acc[r][2 * g] = _mm512_dpbf16_ps(acc[r][2 * g], x0, p);
        if (2 * g + 1 < NV) acc[r][2 * g + 1] = _mm512_dpbf16_ps(acc[r][2 * g + 1], x1, p);
      }
    }
  }
  for (size_t r = 0; r < RG; ++r)
    for (size_t c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * ldo + c * 16, acc[r][c]);
}

// The value pass over an int4 cache with AVX-512 VNNI, RT rows and the NV vectors of 16 columns
// from c0 (a multiple of 64: groups c0 / 32 and, for NV > 2, the next): O = alpha·O + mins +
// Σ_j step·u_j·(code_j − 8) per group, on ByteValueWeights's bytes u, steps and mins (a row's
// at +1, a group's at +ldg, bytes of a row ldu apart). Keys by fours: vpermt2b (AVX-512 VBMI)
// gathers the four keys' bytes of a column pair into a dword, and vpdpbusd adds the four products
// weight × (code − 8) into the column's 32-bit lane: 64 products per instruction, where the
// bfloat16 pass has 32 (and vdpbf16ps ran at a quarter of the FMAs' rate on the Xeon that
// measured this, docs/benchmarks.md). The sums stay exact in int32 over a block (|Σ| ≤ 255·8
// per key), then are converted and added into O in float, times the step, once.
// O = alpha·O + mins for RT rows and NV vectors of 16 columns (a group's mins, at +ldg, for each
// two): where the integer value passes over two groups (Int4OutputVnni, Int8OutputVnni) start.
template <size_t RT, size_t NV>
HWY_INLINE void ScaleAndAddMins(const float* alpha, const float* mins, size_t ldg, float* o, size_t ldo) {
  for (size_t r = 0; r < RT; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (size_t c = 0; c < NV; ++c) {
      float* out = o + r * ldo + c * 16;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), a, _mm512_set1_ps(mins[c / 2 * ldg + r])));
    }
  }
}

template <size_t RT, size_t NV>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512vnni,avx512vbmi"))) void Int4OutputVnni(
    const uint8_t* u, size_t ldu, size_t ldg, const QuantKv<4>::Row* vrows, size_t c0,
    size_t jn, const float* alpha, const float* mins, const float* steps, float* o, size_t ldo, LineStream& ahead) {
  static_assert(kCacheQuantGroup == 32 && NV <= 4, "a group is two vectors of 16 columns; two groups a pass");
  constexpr size_t NG = (NV + 1) / 2;  // groups of the pass
  ScaleAndAddMins<RT, NV>(alpha, mins, ldg, o, ldo);
  // The four keys' 32 bytes (two groups) as [key 0 | key 1] and [key 2 | key 3]; dword i of the
  // gathers holds byte i (first) or 16 + i (second) of keys 0-3. Byte i of a group holds its
  // column i (low nibble) and i + 16 (high).
  __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
  {
    alignas(64) uint8_t idx[2][64];
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 4; ++k) {
        idx[0][4 * i + k] = static_cast<uint8_t>(32 * k + i);
        idx[1][4 * i + k] = static_cast<uint8_t>(32 * k + 16 + i);
      }
    first = _mm512_load_si512(idx[0]);
    second = _mm512_load_si512(idx[1]);
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  __m512i acc[RT][NV];
  for (size_t r = 0; r < RT; ++r)
    for (size_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_si512();
  auto load = [&](size_t j) HWY_ATTR {  // key j's bytes of the pass (keys past jn: the last, weighted 0)
    const uint8_t* p = QuantKv<4>::Columns(vrows[std::min(j, jn - 1)], c0).codes;
    if constexpr (NG == 2) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  for (size_t j = 0; j < jn; j += 4) {  // u holds zeros from jn up to a multiple of 8
    ahead.Issue(kInt4VnniValueWork * 4 * RT * NV * 16);
    const __m512i k01 = _mm512_inserti64x4(_mm512_castsi256_si512(load(j)), load(j + 1), 1);
    const __m512i k23 = _mm512_inserti64x4(_mm512_castsi256_si512(load(j + 2)), load(j + 3), 1);
    __m512i x[2 * NG];
    for (size_t g = 0; g < NG; ++g) {
      const __m512i w = _mm512_permutex2var_epi8(k01, g == 0 ? first : second, k23);
      x[2 * g] = _mm512_sub_epi8(_mm512_and_si512(w, nibble), eight);
      x[2 * g + 1] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(w, 4), nibble), eight);
    }
    for (size_t r = 0; r < RT; ++r)
      for (size_t g = 0; g < NG; ++g) {
        int32_t quad;
        std::memcpy(&quad, u + g * ldg * ldu + r * ldu + j, sizeof(quad));
        const __m512i wv = _mm512_set1_epi32(quad);
        acc[r][2 * g] = _mm512_dpbusd_epi32(acc[r][2 * g], wv, x[2 * g]);
        if (2 * g + 1 < NV) acc[r][2 * g + 1] = _mm512_dpbusd_epi32(acc[r][2 * g + 1], wv, x[2 * g + 1]);
      }
  }
  for (size_t r = 0; r < RT; ++r)
    for (size_t c = 0; c < NV; ++c) {
      float* out = o + r * ldo + c * 16;
      const __m512 st = _mm512_set1_ps(steps[c / 2 * ldg + r]);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), st, _mm512_loadu_ps(out)));
    }
}

// The rows' P (R rows of `block` floats, block a multiple of 32) as bfloat16, rounded to
// nearest even, in order: dword jp of a row holds P[2jp] (low half) and P[2jp + 1].
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) inline void PairWeights(const float* s, int64_t R,
                                                                                  size_t block, uint32_t* pw) {
  for (int64_t r = 0; r < R; ++r)
    for (size_t k = 0; k < block; k += 32) {
      const float* x = s + r * static_cast<int64_t>(block) + k;
      const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
      _mm512_storeu_si512(pw + r * static_cast<int64_t>(block / 2) + k / 2, reinterpret_cast<__m512i>(p));
    }
}

// The query rows of Bf16Scores: row r of q (ldq floats, unscaled, zeros past the head dim) as
// bfloat16, 2 channels to a dword, a row's words at r · ldw (2 · ldw ≥ ldq channels, zeros past
// ldq). Exact: the kernel meets bfloat16 keys only with a bfloat16 query (p.dtype). False if a
// value is not finite (the float path then keeps its Inf or NaN).
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) inline bool QueryBf16(const float* q, size_t ldq, int64_t R,
                                                                                 uint32_t* qw, size_t ldw) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < R; ++r) {
    const float* x = q + r * static_cast<int64_t>(ldq);
    for (size_t c = 0; c < 2 * ldw; c += 32) {
      const __m512 x0 = c < ldq ? _mm512_loadu_ps(x + c) : _mm512_setzero_ps();
      const __m512 x1 = c + 16 < ldq ? _mm512_loadu_ps(x + c + 16) : _mm512_setzero_ps();
      // |x| >= inf or unordered: not finite.
      const __mmask16 bad0 = _mm512_cmp_ps_mask(_mm512_abs_ps(x0), inf, _CMP_NLT_UQ);
      if (bad0 | _mm512_cmp_ps_mask(_mm512_abs_ps(x1), inf, _CMP_NLT_UQ)) return false;
      _mm512_storeu_si512(qw + r * static_cast<int64_t>(ldw) + c / 2,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x1, x0)));
    }
  }
  return true;
}

// S[r][x] for R rows and the N = 16 keys krows[x] of a bfloat16 cache with bfloat16 dot
// products (AVX-512 BF16, checked at run time): per row, key and 32 channels one vdpbf16ps adds
// 32 products to 16 float32 lanes (QueryBf16's words against the key's as stored; D % 32
// channels of a last vector by a masked load), no stage. The products of two bfloat16 are exact
// in float32; the sums are float32 in another order than the float path's, and the scale
// multiplies the sums (the query comes unscaled), so the scores are not its bits (docs/numerics.md).
// vdpbf16ps takes denormal inputs as zero and flushes denormal results. Returns the rows (bit r)
// with a score that is not finite, for the caller to score with the float path.
template <bool kMasked>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) HWY_INLINE void Bf16Step(const uint32_t* q,
                                                                                   const bfloat16* const* krows,
                                                                                   size_t v, __mmask32 tail,
                                                                                   __m512* acc) {
  const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + v * 16));
  for (size_t x = 0; x < 16; ++x) {
    const bfloat16* p = krows[x] + v * 32;
    const __m512i k = kMasked ? _mm512_maskz_loadu_epi16(tail, p) : _mm512_loadu_si512(p);
    acc[x] = _mm512_dpbf16_ps(acc[x], reinterpret_cast<__m512bh>(k), qv);
  }
}

__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) inline uint32_t Bf16Scores(const uint32_t* qw,
                                                                                     size_t ldw, int64_t R,
                                                                                     const bfloat16* const* krows,
                                                                                     size_t depth, float scale,
                                                                                     float* s, size_t lds,
                                                                                     LineStream& ahead) {
  static_assert(kMaxDecodeRows <= 32, "a bit per row");
  const DF d;
  const size_t full = depth / 32, rest = depth % 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << rest) - 1);
  uint32_t bad = 0;
  for (int64_t r = 0; r < R; ++r) {
    const uint32_t* q = qw + r * static_cast<int64_t>(ldw);
    __m512 acc[16];
    for (size_t x = 0; x < 16; ++x) acc[x] = _mm512_setzero_ps();
    ahead.Issue(kFloatWork * 16 * depth);  // the row's multiply-adds
    for (size_t v = 0; v < full; ++v) Bf16Step<false>(q, krows, v, tail, acc);
    if (rest) Bf16Step<true>(q, krows, full, tail, acc);
    hn::Vec<DF> sums[16];
    for (size_t x = 0; x < 16; ++x) sums[x].raw = acc[x];
    const auto scores = hn::Mul(SumLanesOfEach(d, sums), hn::Set(d, scale));
    hn::Store(scores, d, s + r * static_cast<int64_t>(lds));
    if (!hn::AllTrue(d, hn::IsFinite(scores))) bad |= uint32_t{1} << r;
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
