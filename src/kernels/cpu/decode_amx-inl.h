// bfloat16 keys scored with AMX (Intel's tile matrix multiply, TDPBF16PS) in the decode kernel
// (flash_decode.cc): AVX3 target (with MHA_DECODE_DOTS), where the CPU has AMX-BF16 and the OS
// grants the tile state (decode_amx_bf16()). Bf16Scores (decode_quant-inl.h) takes the same
// products with vdpbf16ps, a row at a time, and sums each key's 16 lanes; on the Xeon that
// measured this, vdpbf16ps ran at a quarter of the FMAs' instruction rate and the scores took
// half of the cache-resident bfloat16 step. Here one tile product takes 16 keys × 32 channels
// against every query row: S^T (16 keys × R) += K (16 keys × 32 channels, loaded from the cache
// rows as they are) · Q^T (16 channel pairs × R, the query's words transposed once per chunk by
// AmxTiles), and the sums need no horizontal adds. With the same tiles AmxBf16Values takes a
// block's value products. The intrinsics need their own target (Highway 1.0 has no tile ops):
// docs/ARCHITECTURE.md.
#if defined(MHA_KERNELS_CPU_DECODE_AMX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_AMX_INL_H_
#undef MHA_KERNELS_CPU_DECODE_AMX_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_AMX_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/cpu/amx_config.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/decode_quant-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/prefetch.h"
#include "mha/half.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

#if HWY_TARGET == HWY_AVX3  // as MHA_DECODE_DOTS

// Tiles, all of 16 rows of 64 bytes (the query rows padded to 16 with zeros, so that every tile
// can take any part): 0 the scores (16 keys × 16 rows' floats), 1-3 the keys (16 keys × 32
// channels, tile 1 again for a fourth 32), 4-7 the query (16 channel pairs × 16 rows' dwords):
// head dims of 32, 64, 96 and 128 (AmxDepth). Between a block's scores and the next block's the
// value pass (AmxBf16Values) takes all eight; AmxTiles::LoadQuery puts the query back.
constexpr size_t kAmxMaxDepth = 128;
constexpr bool AmxDepth(size_t depth) { return depth % 32 == 0 && depth > 0 && depth <= kAmxMaxDepth; }

// Holds the tile state for one chunk: loads the configuration and the query's tiles (depth / 32
// of them) from QueryBf16's words (row r's dword c at qw[r·ldw + c], channels 2c and 2c + 1),
// transposed to the tiles' layout (dword 16·c + r, zeros for r ≥ R); releases the tiles when it
// goes.
class AmxTiles {
 public:
  __attribute__((target(HWY_TARGET_STR_AVX3 ",amx-tile,amx-bf16"))) AmxTiles(const uint32_t* qw, size_t ldw,
                                                                             int64_t R, size_t depth)
      : parts_(depth / 32) {
    const size_t rows = static_cast<size_t>(R);
    std::fill(qt_, qt_ + 16 * depth / 2, 0u);
    for (size_t c = 0; c < depth / 2; ++c)
      for (size_t r = 0; r < rows; ++r) qt_[c * 16 + r] = qw[r * ldw + c];
    AmxTileConfig config;
    for (int t = 0; t <= 7; ++t) {
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    // GCC 12 does not see ldtilecfg read the configuration and drops its stores: the asm
    // statement makes the object escape.
    asm volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
    LoadQuery();
  }
  __attribute__((target(HWY_TARGET_STR_AVX3 ",amx-tile"))) ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

  // The query's tiles (4-7) again, after a value pass took them.
  __attribute__((target(HWY_TARGET_STR_AVX3 ",amx-tile"))) void LoadQuery() const {
    asm volatile("" : : "r"(qt_) : "memory");  // the tile loads read what the constructor wrote
    _tile_loadd(4, qt_, 64);
    if (parts_ > 1) _tile_loadd(5, qt_ + 256, 64);
    if (parts_ > 2) _tile_loadd(6, qt_ + 512, 64);
    if (parts_ > 3) _tile_loadd(7, qt_ + 768, 64);
  }

 private:
  size_t parts_;
  alignas(64) uint32_t qt_[16 * kAmxMaxDepth / 2];
};

// S[r][x] (r < R, at s + r·lds) for the 16 keys at k, k + stride, ... (bfloat16 elements; the
// rows of a contiguous cache or of one page), depth channels each, under AmxTiles: the tile
// products' float32 sums times scale. The products of two bfloat16 are exact in float32; TDPBF16PS
// adds them to the float32 sum one after another (Intel's SDM), flushing denormal inputs and
// results as vdpbf16ps does, so the scores are within Bf16Scores' bound of the exact sums (docs/numerics.md),
// not its bits. Returns the rows (bit r) with a score that is not finite, for the caller to score
// with the float path.
__attribute__((target(HWY_TARGET_STR_AVX3 ",amx-tile,amx-bf16"))) inline uint32_t AmxBf16Scores(
    const bfloat16* k, int64_t stride, int64_t R, size_t depth, float scale, float* s, size_t lds,
    LineStream& ahead) {
  static_assert(kMaxDecodeRows <= 16, "a tile row holds every query row's score");
  ahead.Issue(kFloatWork * 16 * static_cast<uint64_t>(R) * depth);
  const char* a = reinterpret_cast<const char*>(k);
  const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(bfloat16));
  const size_t parts = depth / 32;
  _tile_zero(0);
  _tile_loadd(1, a, row_bytes);
  _tile_dpbf16ps(0, 1, 4);
  if (parts > 1) {
    _tile_loadd(2, a + 64, row_bytes);
    _tile_dpbf16ps(0, 2, 5);
  }
  if (parts > 2) {
    _tile_loadd(3, a + 128, row_bytes);
    _tile_dpbf16ps(0, 3, 6);
  }
  if (parts > 3) {
    _tile_loadd(1, a + 192, row_bytes);
    _tile_dpbf16ps(0, 1, 7);
  }
  alignas(64) float sums[16 * 16];  // key x's scores at 16·x
  _tile_stored(0, sums, 64);
  asm volatile("" : : "r"(sums) : "memory");  // as in AmxTiles: the loads below read what it wrote
  // Row r's scores are column r of the sums. Up to 4 rows: the first 4 floats of the 16 key rows
  // loaded into 4 vectors (4 keys each: lane 4j + r holds row r's score of the vector's key j),
  // then per row two permutes (keys 0-7, 8-15) and a shuffle; more rows: a gather per row. With
  // gathers at 4 rows the cache-resident bfloat16 step took ~4% longer (docs/benchmarks.md).
  const __m512 sc = _mm512_set1_ps(scale);
  uint32_t bad = 0;
  const auto put = [&](int64_t r, __m512 scores) {
    const __m512 row = _mm512_mul_ps(scores, sc);
    _mm512_storeu_ps(s + r * static_cast<int64_t>(lds), row);
    if (NotFinite(row) != 0) bad |= uint32_t{1} << r;
  };
  if (R <= 4) {
    __m512 quad[4];  // keys 4k .. 4k + 3
    for (int k = 0; k < 4; ++k) {
      const float* at = sums + 64 * k;
      __m512 x = _mm512_castps128_ps512(_mm_load_ps(at));
      x = _mm512_insertf32x4(x, _mm_load_ps(at + 16), 1);
      x = _mm512_insertf32x4(x, _mm_load_ps(at + 32), 2);
      quad[k] = _mm512_insertf32x4(x, _mm_load_ps(at + 48), 3);
    }
    for (int r = 0; r < static_cast<int>(R); ++r) {
      // Lanes 0-7: lane 4j + r of the first vector (j < 4), then of the second.
      const __m512i pick =
          _mm512_setr_epi32(r, 4 + r, 8 + r, 12 + r, 16 + r, 20 + r, 24 + r, 28 + r, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512 lo = _mm512_permutex2var_ps(quad[0], pick, quad[1]);
      const __m512 hi = _mm512_permutex2var_ps(quad[2], pick, quad[3]);
      put(r, _mm512_shuffle_f32x4(lo, hi, 0x44));  // lo's lanes 0-7, then hi's
    }
    return bad;
  }
  const __m512i keys = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t r = 0; r < R; ++r) put(r, _mm512_i32gather_ps(keys, sums + r, 4));
  return bad;
}

// Whether the 16 key rows lie `stride` elements apart (stride > 0), as a tile load reads them:
// not so across the pages of a paged pool, nor in a block's last, partial tile (its rows past the
// last key repeat it). Compared as addresses: rows in different pages are different objects.
inline bool EvenlySpaced(const bfloat16* const* krows, int64_t& stride) {
  const auto at = [&](size_t x) { return reinterpret_cast<uintptr_t>(krows[x]); };
  const uintptr_t step = at(1) - at(0);  // wraps when the second row lies below the first
  if (at(1) <= at(0) || step % sizeof(bfloat16) != 0 || step > (uintptr_t{1} << 40)) return false;
  for (size_t x = 2; x < 16; ++x)
    if (at(x) - at(0) != x * step) return false;
  stride = static_cast<int64_t>(step / sizeof(bfloat16));
  return true;
}

// The scores of the 16 bfloat16 keys krows (Bf16Scores' arguments): AmxBf16Scores where amx (an
// AmxTiles held) and the rows are evenly spaced, else Bf16Scores.
inline uint32_t Bf16KeyScores(bool amx, const uint32_t* qw, size_t ldw, int64_t R, const bfloat16* const* krows,
                              size_t depth, float scale, float* s, size_t lds, LineStream& ahead) {
  int64_t stride = 0;
  if (amx && EvenlySpaced(krows, stride)) return AmxBf16Scores(krows[0], stride, R, depth, scale, s, lds, ahead);
  return Bf16Scores(qw, ldw, R, krows, depth, scale, s, lds, ahead);
}

// bfloat16 values with AMX (AmxBf16Values), where the keys took the tiles (AmxTiles' shape, 16 rows
// of 64 bytes, is the one a value product needs). One tile product takes 16 keys × 32 value columns
// against the query rows: sums (2R × 16 floats) += weights (2R rows of 16 words, P rounded to
// bfloat16) · V (16 keys × 32 columns, loaded from the cache rows as they are: dword n of a row
// holds columns 2n and 2n + 1). A tile product adds the even words of a weights row times the even
// columns and the odd words times the odd ones, so row r < R holds row r's weights in its even
// words (odd words 0) and sums even columns, row R + r the same weights in its odd words and sums
// odd columns: no value is moved or widened (the float pass widens each and spends R FMAs on it;
// docs/benchmarks.md). Rows 2R .. 15 of a weights tile hold whatever they held: their sums are
// never read.
constexpr int64_t kAmxValueRows = 8;  // both parities of every row in one tile's 16 rows
constexpr size_t kAmxValueKeys = 128;  // keys per call at most (a block of the decode kernel)
inline bool AmxValueShape(int64_t R, size_t dv) { return R <= kAmxValueRows && dv % 32 == 0 && dv > 0; }

// o[r][c] = alpha[r]·o[r][c] + Σ_{j < jn} P[r][j]·V[j][c] (r < R, c < dv) for a block's keys, P at
// s + r·lds (block entries, jn ≤ block), the value rows vrows[j], under AmxTiles. weights:
// ⌈jn / 16⌉ tiles of 256 dwords; stage: 16 · ⌈jn / 16⌉ rows of dv words, taking the steps of 16 keys
// whose rows are not evenly spaced (across a paged pool's pages) or not all there (the block's last
// keys; zeros after them); sums: dv / 32 tiles of 256 floats. Leaves the tiles to be loaded again
// (AmxTiles::LoadQuery). P is rounded to bfloat16 (nearest even); TDPBF16PS sums its products in
// float32, flushing denormals (docs/numerics.md has the bound). Returns false with o unchanged
// where a sum is not finite: a weight of 0 (an odd word, or a key a row does not see) times an
// infinite or NaN value is NaN in a column the float pass keeps finite, so the caller takes the
// float pass for the block.
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16,amx-tile,amx-bf16"))) inline bool AmxBf16Values(
    const float* s, size_t lds, int64_t R, const bfloat16* const* vrows, size_t jn, size_t dv, const float* alpha,
    float* o, size_t ldo, uint32_t* weights, bfloat16* stage, float* sums, LineStream& ahead) {
  const size_t rows = static_cast<size_t>(R), steps = (jn + 15) / 16, chunks = dv / 32;
  for (size_t t = 0; t < steps; ++t) {
    const __mmask16 live = static_cast<__mmask16>(jn - 16 * t >= 16 ? 0xFFFF : (1u << (jn - 16 * t)) - 1);
    uint32_t* w = weights + t * 256;
    for (size_t r = 0; r < rows; ++r) {
      const __m256bh p = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, s + r * lds + 16 * t));
      const __m512i even = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(p));
      _mm512_store_si512(w + 16 * r, even);
      _mm512_store_si512(w + 16 * (rows + r), _mm512_slli_epi32(even, 16));
    }
  }
  // Each step's rows: as they lie where evenly spaced, else copied into the stage.
  const bfloat16* from[kAmxValueKeys / 16];
  int64_t stride[kAmxValueKeys / 16];
  for (size_t t = 0; t < steps; ++t) {
    if (16 * t + 16 <= jn && EvenlySpaced(vrows + 16 * t, stride[t])) {
      from[t] = vrows[16 * t];
      continue;
    }
    bfloat16* rows_t = stage + 16 * t * dv;
    for (size_t x = 0; x < 16; ++x) {
      bfloat16* row = rows_t + x * dv;
      if (16 * t + x < jn) {
        std::copy(vrows[16 * t + x], vrows[16 * t + x] + dv, row);
      } else {
        std::fill(row, row + dv, bfloat16{});
      }
    }
    from[t] = rows_t;
    stride[t] = static_cast<int64_t>(dv);
  }
  // Two chunks of 32 columns at a time, each its own chain of products (sums in tiles 3 and 5),
  // their weights and value rows loaded into tiles 1, 2, 4 on even steps and 6, 7, 0 on odd
  // ones, so that no load waits for a product still reading its tile. Takes the query's tiles:
  // the caller loads them again (AmxTiles::LoadQuery).
  for (size_t c = 0; c < chunks; c += 2) {
    const bool two = c + 1 < chunks;
    _tile_zero(3);
    _tile_zero(5);
    for (size_t t = 0; t < steps; ++t) {
      ahead.Issue(kFloatWork * 16 * 32 * static_cast<uint64_t>(R) * (two ? 2 : 1));
      const bfloat16* v = from[t] + 32 * c;
      const int64_t row_bytes = stride[t] * static_cast<int64_t>(sizeof(bfloat16));
      // The same step twice with other tiles: the intrinsics paste their tile numbers into the
      // instruction's text (GCC's amxtileintrin.h), so they cannot come from a template.
      if (t % 2 == 0) {
        _tile_loadd(1, weights + t * 256, 64);
        _tile_loadd(2, v, row_bytes);
        _tile_dpbf16ps(3, 1, 2);
        if (two) {
          _tile_loadd(4, v + 32, row_bytes);
          _tile_dpbf16ps(5, 1, 4);
        }
      } else {
        _tile_loadd(6, weights + t * 256, 64);
        _tile_loadd(7, v, row_bytes);
        _tile_dpbf16ps(3, 6, 7);
        if (two) {
          _tile_loadd(0, v + 32, row_bytes);
          _tile_dpbf16ps(5, 6, 0);
        }
      }
    }
    _tile_stored(3, sums + c * 256, 64);
    if (two) _tile_stored(5, sums + (c + 1) * 256, 64);
  }
  asm volatile("" : : "r"(sums) : "memory");  // as in AmxTiles: the loads below read what it wrote
  for (size_t c = 0; c < chunks; ++c)
    for (size_t r = 0; r < 2 * rows; ++r)
      if (NotFinite(_mm512_load_ps(sums + c * 256 + 16 * r)) != 0) return false;
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (size_t r = 0; r < rows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    float* orow = o + r * ldo;
    for (size_t c = 0; c < chunks; ++c) {
      const __m512 even = _mm512_load_ps(sums + c * 256 + 16 * r);
      const __m512 odd = _mm512_load_ps(sums + c * 256 + 16 * (rows + r));
      float* oc = orow + 32 * c;
      _mm512_storeu_ps(oc, _mm512_fmadd_ps(_mm512_loadu_ps(oc), a, _mm512_permutex2var_ps(even, lo, odd)));
      _mm512_storeu_ps(oc + 16, _mm512_fmadd_ps(_mm512_loadu_ps(oc + 16), a, _mm512_permutex2var_ps(even, hi, odd)));
    }
  }
  return true;
}
#endif

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_AMX_INL_H_
