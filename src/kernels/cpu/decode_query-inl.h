// The query rows of a chunk of the decode kernel (flash_decode.cc) in every form its score paths
// read (ChunkQuery, made once per chunk by LoadChunkQuery: float rows, per-group sums, the
// integer words of QueryDots, the bfloat16 pairs of QueryBf16), and the scores of a key tile
// from them (KeyTileScores: TileDots, TileDots256 or TileScores; decode_quant-inl.h).
#if defined(MHA_KERNELS_CPU_DECODE_QUERY_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_QUERY_INL_H_
#undef MHA_KERNELS_CPU_DECODE_QUERY_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_QUERY_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/decode_block-inl.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/decode_merge-inl.h"
#include "kernels/cpu/decode_quant-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/workspace.h"
#include "mha/kv_cache.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

// A chunk's query rows in every form its score paths read, made once per chunk (LoadChunkQuery).
struct ChunkQuery {
  // Float rows (LoadQueryRow: scaled, times the key channel scales), padded with zeros to ld
  // (whole vectors; whole groups for padded rows, so that every load is a full one); depth: the
  // products of a dot (D, or ld for padded rows); tail: depth is not whole vectors.
  float* rows = nullptr;
  size_t ld = 0, depth = 0;
  bool tail = false;
  // Outlier key channels (quantized caches): the query meets their exact values (`outliers`,
  // row r's nout at r · kCacheKeyOutliers, times the keys' outlier values, added to the scores),
  // not their codes (its entries in `rows` are zeroed).
  float outliers[kMaxDecodeRows * kCacheKeyOutliers];
  size_t nout = 0;
  // Key tiles: each row's sum of its entries per group of 32 (R rows of `groups`).
  float* group_sums = nullptr;
  size_t groups = 0;
  // Key tiles with integer dot products where the CPU has them (dots: QueryDots made them):
  // TileDots with AVX-512 VNNI (vnni; hi and, int8 keys, lo), TileDots256 with AVX2 (vectors:
  // RepeatWords of hi); ldw words a row, scale[r] its rounding's scale.
  bool dots = false, vnni = false;
  int32_t* hi = nullptr;
  int32_t* lo = nullptr;
  int32_t* vectors = nullptr;
  size_t ldw = 0;
  float scale[kMaxDecodeRows];
  // bfloat16 keys with bfloat16 dot products where the CPU has them (bf16: QueryBf16 made them;
  // false for a value not finite, then the float path throughout): the rows loaded unscaled and
  // rounded to pairs (ldb dwords a row), then `rows` scaled in place for the float path (the
  // same products as LoadQueryRow's: the same bits).
  bool bf16 = false;
  uint32_t* pairs = nullptr;
  size_t ldb = 0;
};

// The R query rows of (b, hk) (DecodeRows) into q, in this thread's workspace.
template <class Kv>
HWY_INLINE void LoadChunkQuery(DF d, const AttentionParams& p, int64_t b, int64_t hk, int64_t R, ChunkQuery& q) {
  const size_t N = hn::Lanes(d), D = static_cast<size_t>(p.head_dim_qk);
  const size_t pad = Kv::kPadded ? static_cast<size_t>(kCacheQuantGroup) : N;
  q.ld = (D + pad - 1) / pad * pad;
  q.depth = Kv::kPadded ? q.ld : D;
  q.tail = q.depth % N != 0;
  Workspace& ws = Workspace::local();
  q.rows = ws.get<float>(Workspace::kDecodeQuery, R * q.ld);
  const float* channel =
      p.k_channel_scales ? p.k_channel_scales + b * p.k_channel_stride[0] + hk * p.k_channel_stride[1] : nullptr;
  constexpr int64_t kOut = kCacheKeyOutliers;
  const int64_t* outliers =
      Kv::kOutliers && p.k_outliers ? p.k_outliers + b * p.k_outlier_stride[0] + hk * p.k_outlier_stride[1] : nullptr;
  while (outliers && q.nout < static_cast<size_t>(kOut) && outliers[q.nout] >= 0) ++q.nout;
  q.groups = q.ld / static_cast<size_t>(kCacheQuantGroup);
  if constexpr (Kv::kKeyTiles)
    q.group_sums = ws.get<float>(Workspace::kDecodeQuerySums, static_cast<size_t>(R) * q.groups);
#if MHA_DECODE_DOTS
  q.bf16 = std::is_same_v<Kv, PlainKv<bfloat16>> && decode_bf16_dots();
#endif
  const DecodeRows rows{R};
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = rows.head(p, hk, r), i = rows.query(p, r);
    float* row = q.rows + r * static_cast<int64_t>(q.ld);
    LoadQueryRow(d, p, b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2], q.bf16 ? 1.0f : p.scale, channel,
                 D, q.ld, row);
    for (size_t x = 0; x < q.nout; ++x) {
      q.outliers[r * kOut + static_cast<int64_t>(x)] = row[outliers[x]];
      row[outliers[x]] = 0.0f;
    }
    for (size_t g = 0; q.group_sums && g < q.groups; ++g) {
      const float* x = row + g * static_cast<size_t>(kCacheQuantGroup);
      q.group_sums[r * static_cast<int64_t>(q.groups) + g] = std::accumulate(x, x + kCacheQuantGroup, 0.0f);
    }
  }
#if MHA_DECODE_INT_DOTS
  if constexpr (Kv::kKeyTiles) {
#if MHA_DECODE_DOTS
    q.vnni = decode_avx512_vnni();
#endif
    const QueryForm form = !std::is_same_v<Kv, QuantKv<8>> ? QueryForm::kBytes
                           : q.vnni                         ? QueryForm::kSplit
                                                            : QueryForm::kHalves;
    q.ldw = form == QueryForm::kHalves ? q.ld / 2 : q.ld / 4;
    if (decode_int8_dots()) {
      q.hi = ws.get<int32_t>(Workspace::kDecodeQueryWords, 2 * static_cast<size_t>(R) * (q.ld / 4));
      q.lo = form == QueryForm::kSplit ? q.hi + R * static_cast<int64_t>(q.ld / 4) : nullptr;  // kSplit's low bytes
      q.dots = QueryDots(d, q.rows, q.ld, R, form, q.hi, q.lo, q.scale);
      if (q.dots && !q.vnni) {
        q.vectors = ws.get<int32_t>(Workspace::kDecodeQueryVectors, 8 * q.ldw * static_cast<size_t>(R));
        RepeatWords(q.hi, q.ldw, R, q.vectors);
      }
    }
  }
#endif
#if MHA_DECODE_DOTS
  if (q.bf16) {
    q.ldb = (D + 31) / 32 * 16;
    q.pairs = ws.get<uint32_t>(Workspace::kDecodeQueryWords, static_cast<size_t>(R) * q.ldb);
    q.bf16 = QueryBf16(q.rows, q.ld, R, q.pairs, q.ldb);
    for (int64_t r = 0; r < R; ++r)
      for (size_t c = 0; c < D; ++c) q.rows[r * static_cast<int64_t>(q.ld) + c] *= p.scale;
  }
#endif
}

// The scores of the N keys of a key tile from its lane lane0 (int8/int4 keys) for the R rows
// into s (rows `block` apart): TileDots, TileDots256 or TileScores, kTileRows rows a call. Keys
// past the last of a partial tile read the tile's other lanes (its storage exists; the block's
// mask drops them).
template <int kBits, class Tile>
HWY_INLINE void KeyTileScores(DF d, const ChunkQuery& q, const Tile& tile, size_t lane0, int64_t R, float* s,
                              size_t block, LineStream& ahead) {
  constexpr int64_t kOut = kCacheKeyOutliers;
  for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
    const float* qg = q.group_sums + r0 * static_cast<int64_t>(q.groups);
    const float* qr = q.outliers + r0 * kOut;
    float* sr = s + r0 * static_cast<int64_t>(block);
#if MHA_DECODE_INT_DOTS
    if (q.dots) {
#if MHA_DECODE_DOTS
      if (q.vnni) {
        const int32_t* h = q.hi + r0 * static_cast<int64_t>(q.ldw);
        const int32_t* l = q.lo ? q.lo + r0 * static_cast<int64_t>(q.ldw) : nullptr;  // int8 keys only
        WithTileRows(R - r0, [&](auto rt) {
          TileDots<kBits, decltype(rt)::value>(tile.codes, tile.scales, q.groups, h, l, q.ldw, q.scale + r0, qg, qr,
                                                q.nout, sr, block, ahead);
        });
        continue;
      }
#endif
      const int32_t* v = q.vectors + r0 * static_cast<int64_t>(8 * q.ldw);
      for (size_t x = 0; x < hn::Lanes(d); x += 8) {  // 8 keys a call
        WithTileRows(R - r0, [&](auto rt) {
          TileDots256<kBits, decltype(rt)::value>(tile.codes, tile.scales, lane0 + x, q.groups, v, 8 * q.ldw,
                                                  q.scale + r0, qg, qr, q.nout, sr + x, block, ahead);
        });
      }
      continue;
    }
#endif
    WithTileRows(R - r0, [&](auto rt) {
      TileScores<kBits, decltype(rt)::value>(d, tile.codes, tile.scales, lane0, q.groups,
                                             q.rows + r0 * static_cast<int64_t>(q.ld), q.ld, qg, qr, q.nout, sr,
                                             block, ahead);
    });
  }
}

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_QUERY_INL_H_
