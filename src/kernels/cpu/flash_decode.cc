// Attention for decoding: a few query rows (Tq·G <= kMaxDecodeRows, e.g. one new token of
// every query head of a kv group) against a long key cache. It is bound by reading K and V,
// so the layout differs from flash_fwd.cc:
//   scores  S[r][j]  as dot products with the head dim in the SIMD lanes, K rows read in
//                    memory order; N keys' products are reduced together (one transpose of
//                    the N accumulators), leaving keys in the lanes for the softmax;
//   output  O[r][c]  with value columns in the lanes: each V row is loaded once per block and
//                    broadcast-multiplied into every row's accumulator.
// Each K/V byte is read from memory once per step; 16-bit K and V are widened and int8/int4
// cache codes dequantized in registers (PlainKv, QuantKv: decode_kv-inl.h; the scores of N keys,
// the block's online softmax and the output pass over a block: decode_block-inl.h; int8/int4 keys
// by tiles and bfloat16 keys with dot products: decode_quant-inl.h; int4 and int8 values with
// dot products: decode_int4_values-inl.h, decode_int8_values-inl.h, and the value scales they
// read: decode_value_scales-inl.h; bfloat16 values with dot products: decode_bf16_values-inl.h).
// This file runs the blocks of a chunk (prefetches, the passes each block takes; its query rows:
// decode_query-inl.h) and the chunks as tasks. The keys of a (batch, kv head) may be cut into S
// chunks (S depends on the shape alone, never on threads) that run as separate tasks; their
// partial (O, m, l) are merged in chunk order through their log-sum-exp (decode_merge-inl.h), so
// the result has the same bits for any thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_decode.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "hwy/highway.h"
#include "kernels/cpu/decode_amx-inl.h"
#include "kernels/cpu/decode_bf16_values-inl.h"
#include "kernels/cpu/decode_block-inl.h"
#include "kernels/cpu/decode_int4_values-inl.h"
#include "kernels/cpu/decode_int8_values-inl.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/decode_merge-inl.h"
#include "kernels/cpu/decode_quant-inl.h"
#include "kernels/cpu/decode_query-inl.h"
#include "kernels/cpu/decode_value_scales-inl.h"
#include "kernels/cpu/exp2-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/workspace.h"
#include "mha/kv_cache.h"
#include "util/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using decode::ChunkQuery;
using decode::DecodeOutputCols;
using decode::DecodeRows;
using decode::DotScores;
using decode::ForRowGroups;
using decode::GroupedKeyScores;
using decode::KeyTileScores;
using decode::kLog2e;
using decode::kNegInf;
using decode::kOutVecs;
using decode::kTileRows;
using decode::LoadChunkQuery;
using decode::Merge;
using decode::PlainKv;
using decode::QuantKv;
using decode::StagedScores;
using decode::WithPassVectors;
using decode::WithRowGroup;
using decode::WithTileRows;
#if HWY_TARGET == HWY_AVX2
using decode::Int4Output256;
#endif
#if MHA_DECODE_DOTS
using decode::Bf16OutputCols;
using decode::Int4Output;
using decode::Int4OutputVnni;
using decode::PairWeights;
#endif

// Keys per block (each pays a softmax update per row and each pass's setup): 8 vectors, 16 for
// int8/int4 on AVX2 (others were slower, docs/benchmarks.md); 16-bit keys as float's (same bits).
template <class Kv>
constexpr size_t kBlockVecs = HWY_TARGET == HWY_AVX2 && Kv::kKeyTiles ? 16 : 8;
constexpr int64_t kMaxChunkKeys = int64_t{1} << 16;  // keys per chunk at most (a multiple of any block)

struct Split {
  int64_t parts, chunk;  // chunks per (b, kv head); keys per chunk, a multiple of the block
};

Split ChooseSplit(const AttentionParams& p, size_t block) {
  // Enough tasks for the cores when B·Hkv is small, chunks of >= 256 keys; of the shape alone.
  const int64_t heads = p.batch * p.kv_heads;
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>((8 + heads - 1) / heads, (p.kv_len + 255) / 256));
  // A chunk sums at most kMaxChunkKeys keys in float (o and l stay accurate: 2^24 terms of 1.0
  // would stop growing); chunks are merged in double.
  parts = std::max(parts, (p.kv_len + kMaxChunkKeys - 1) / kMaxChunkKeys);
  int64_t chunk = (p.kv_len + parts - 1) / parts;
  chunk = (chunk + static_cast<int64_t>(block) - 1) / static_cast<int64_t>(block) * static_cast<int64_t>(block);
  parts = chunk > 0 ? (p.kv_len + chunk - 1) / chunk : 1;
  return {std::max<int64_t>(parts, 1), std::max<int64_t>(chunk, static_cast<int64_t>(block))};
}

// The keys that the R rows of batch b see within [k0, k1): each row's in seen[r], and the span
// [ua, ub) of them all (ua >= ub where no row sees one). Key tiles are read N keys at a time
// from a multiple of N (N divides the tile), so for them ua is rounded down to one; the masks
// drop keys before a row's first.
template <class Kv>
std::pair<int64_t, int64_t> ChunkSpan(const AttentionParams& p, int64_t b, int64_t R, int64_t k0, int64_t k1,
                                      KeyRange* seen) {
  const DecodeRows rows{R};
  int64_t ua = k1, ub = k0;
  for (int64_t r = 0; r < R; ++r) {
    const KeyRange k = visible_keys(p, b, rows.query(p, r));
    seen[r] = KeyRange{std::max(k.lo, k0), std::min(k.hi, k1), std::min(k.sink_hi, k1)};  // sinks: [k0, sink_hi)
    if (seen[r].hi > seen[r].lo) ua = std::min(ua, seen[r].lo), ub = std::max(ub, seen[r].hi);
    if (seen[r].sink_hi > k0) ua = std::min(ua, k0), ub = std::max(ub, seen[r].sink_hi);
  }
  const auto N = static_cast<int64_t>(hn::Lanes(DF()));
  if constexpr (Kv::kKeyTiles) ua = ua / N * N;
  return {ua, ub};
}

// Queues into `ahead` the lines of the first block that DecodeChunk reads over keys [k0, k1) of
// (b, hk): the last block of the task before it on the same thread asks for them
// (parallel_for_ahead), so that the task does not start by waiting for its first block.
template <class Kv>
void QueueFirstBlock(const AttentionParams& p, int64_t b, int64_t hk, int64_t k0, int64_t k1, LineStream& ahead) {
  KeyRange seen[kMaxDecodeRows];
  const auto [ua, ub] = ChunkSpan<Kv>(p, b, p.group() * p.q_len, k0, k1, seen);
  const int64_t hi = std::min<int64_t>(ub, ua + static_cast<int64_t>(kBlockVecs<Kv> * hn::Lanes(DF())));
  if (ua >= hi) return;
  const Kv kv(p, b, hk);
  kv.AheadKeys(ahead, ua, hi);
  kv.AheadValues(ahead, ua, hi);
}

// What queues the first block of the task that runs next on this thread: a reference to a
// callable f(LineStream&), without making DecodeChunk a template of its type (each of its
// callers' lambdas would be a copy of the kernel).
class QueueNext {
 public:
  template <class F>
  explicit QueueNext(const F& f)
      : f_(&f), call_([](const void* f, LineStream& ahead) { (*static_cast<const F*>(f))(ahead); }) {}
  void operator()(LineStream& ahead) const { call_(f_, ahead); }

 private:
  const void* f_;
  void (*call_)(const void*, LineStream&);
};

// Partial attention of rows of (b, hk) over keys [k0, k1): unnormalised O (rows × dvp), m, l.
// Kv: how K and V are stored (PlainKv<T>, QuantKv<bits>). first_queued: whether the task before
// this one queued its first block's lines (QueueFirstBlock); queue_next queues the next task's,
// during the last block.
template <class Kv>
void DecodeChunk(const AttentionParams& p, int64_t b, int64_t hk, int64_t k0, int64_t k1, float* o, float* m,
                 float* l, bool first_queued, const QueueNext& queue_next) {
  const DF d;
  const size_t N = hn::Lanes(d), block = kBlockVecs<Kv> * N;
  const int64_t R = p.group() * p.q_len;
  const size_t Dv = static_cast<size_t>(p.head_dim_v);
  const size_t dvp = (Dv + N - 1) / N * N;
  Workspace& ws = Workspace::local();
  ChunkQuery q;
  LoadChunkQuery<Kv>(d, p, b, hk, R, q);
  const size_t ldq = q.ld, depth = q.depth;
  float* s = ws.get<float>(Workspace::kDecodeScores, R * block);
  float* alpha = ws.get<float>(Workspace::kDecodeRescale, R);
  KeyRange* seen = ws.get<KeyRange>(Workspace::kDecodeSeen, R);  // each row's visible keys within [k0, k1)
  float* saved = ws.get<float>(Workspace::kDecodeSavedOut, static_cast<size_t>(R) * dvp);  // see `partial`
  const DecodeRows rows{R};
  int64_t ua, ub;
  std::tie(ua, ub) = ChunkSpan<Kv>(p, b, R, k0, k1, seen);
  for (int64_t r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
    std::fill(o + r * dvp, o + (r + 1) * dvp, 0.0f);
  }
#if MHA_DECODE_DOTS
  // bfloat16 keys with AMX's tile products where the CPU has them (AmxBf16Scores): the tile
  // state is held for the chunk, with the query's tiles loaded once.
  const bool amx_keys = q.bf16 && decode::AmxDepth(depth) && decode_amx_bf16();
  std::optional<decode::AmxTiles> tiles;
  if (amx_keys) tiles.emplace(q.pairs, q.ldb, R, depth);
  // bfloat16 values with the same tiles (AmxBf16Values) for up to 8 rows and Dv % 32 == 0.
  const bool amx_values = amx_keys && decode::AmxValueShape(R, Dv) && decode_amx_bf16_values();
  static_assert(kBlockVecs<PlainKv<bfloat16>> * hn::MaxLanes(DF()) <= decode::kAmxValueKeys, "a block per call");
  uint32_t* vtiles = amx_values ? ws.get<uint32_t>(Workspace::kDecodeValueTiles, block * 16) : nullptr;
  bfloat16* vtstage = amx_values ? ws.get<bfloat16>(Workspace::kDecodeValueStage, block * Dv) : nullptr;
  float* vsums = amx_values ? ws.get<float>(Workspace::kDecodeValueSums, Dv / 32 * 256) : nullptr;
  // int4 values with bfloat16 dot products where the CPU has them (Int4Output), unless they are
  // taken on byte weights by VNNI (Int4OutputVnni, below).
  const bool pairs = std::is_same_v<Kv, QuantKv<4>> && decode_bf16_dots() && !decode_vnni_byte_values();
  // bfloat16 values with bfloat16 dot products where AMX does not take them (Bf16Output), on the
  // same bfloat16 pairs of P.
  const bool bf16_values =
      std::is_same_v<Kv, PlainKv<bfloat16>> && !amx_values && decode::Bf16Passes(Dv) && decode_bf16_values();
  uint32_t* pw = pairs || bf16_values
                     ? ws.get<uint32_t>(Workspace::kDecodeWeightPairs, static_cast<size_t>(R) * block / 2)
                     : nullptr;
#endif
  const Kv kv(p, b, hk);
  typename Kv::Row krows[hn::MaxLanes(DF())];
  typename Kv::Row vrows[kBlockVecs<Kv> * hn::MaxLanes(DF()) + 3];
  // Keys not of float are widened or dequantized once per N keys into a stage interleaved by
  // vector, which every query row reads (StagedScores; on AVX2 and AVX3, GroupedKeyScores: no
  // stage).
  constexpr bool kStage = !std::is_same_v<typename Kv::Row, const float*> && !Kv::kKeyTiles && !decode::GroupKeys<Kv>();
  float* kstage = kStage ? ws.get<float>(Workspace::kDecodeKeyStage, N * ldq) : nullptr;
  // int8/int4 values on AVX2: the value pass's weights with the groups' scales folded in
  // (FoldValueWeights), per group of the padded value row.
  constexpr bool kFold = decode::FoldsValueScales<Kv>();
  const size_t vgroups = (Dv + kCacheQuantGroup - 1) / kCacheQuantGroup;
  float* vstage = kFold ? ws.get<float>(Workspace::kDecodeValueScales, 2 * vgroups * block) : nullptr;
  float* vweights = kFold ? ws.get<float>(Workspace::kDecodeValueWeights, vgroups * R * block) : nullptr;
  float* vmins = kFold ? ws.get<float>(Workspace::kDecodeValueMins, vgroups * R) : nullptr;
  // int4 values with 8-bit integer products where allowed: the folded weights rounded to bytes,
  // per block (ByteValueWeights), passes of kTileRows rows: AVX2's vpmaddubsw (Int4Output256) or
  // AVX-512 VNNI (Int4OutputVnni).
#if MHA_DECODE_BYTE_VALUES
  const bool byte_values =
      std::is_same_v<Kv, QuantKv<4>> && (HWY_TARGET == HWY_AVX2 ? decode_byte_values() : decode_vnni_byte_values());
  uint8_t* vbytes = byte_values ? ws.get<uint8_t>(Workspace::kDecodeValueBytes, vgroups * R * block) : nullptr;
#else
  constexpr bool byte_values = false;
#endif
  // int8 values with 16-bit integer products where allowed: the folded weights rounded to words,
  // per block (WordValueWeights), passes of kTileRows rows: AVX2's vpmaddwd (Int8Output256) or
  // AVX-512 VNNI (Int8OutputVnni).
#if MHA_DECODE_WORD_VALUES
  static_assert(kBlockVecs<Kv> * hn::MaxLanes(DF()) <= decode::kWordPassKeys, "the word passes sum a block in int32");
  const bool word_values = std::is_same_v<Kv, QuantKv<8>> &&
                           (HWY_TARGET == HWY_AVX2 ? decode_byte_values() : decode_vnni_word_values());
  int16_t* vwords = word_values ? ws.get<int16_t>(Workspace::kDecodeValueWords, vgroups * R * block) : nullptr;
#else
  constexpr bool word_values = false;
#endif
  const bool int_values = byte_values || word_values;
  if (int_values && !vstage) {
    vstage = ws.get<float>(Workspace::kDecodeValueScales, 2 * vgroups * block);
    vmins = ws.get<float>(Workspace::kDecodeValueMins, vgroups * R);
  }
  [[maybe_unused]] float* vsteps =
      int_values ? ws.get<float>(Workspace::kDecodeValueSteps, vgroups * (R + 1)) : nullptr;
  // Each row's largest P in the block (the integer value passes' weights; unused by the others).
  [[maybe_unused]] float pmax[kMaxDecodeRows];

  // The next block's K and V lines are prefetched through this block's work (LineStream), paced
  // by multiply-adds (weighted by what they cost: decode::kFloatWork ...): the score calls and
  // each key of the value passes ask for their share.
  uint64_t score_work = decode::kFloatWork, value_work = decode::kFloatWork;
#if MHA_DECODE_INT_DOTS
  if (q.dots) score_work = q.vnni ? decode::kVnniWork : decode::kAvx2IntWork;
#endif
  if (byte_values) value_work = HWY_TARGET == HWY_AVX2 ? decode::kAvx2IntWork : decode::kInt4VnniValueWork;
  if (word_values) value_work = HWY_TARGET == HWY_AVX2 ? decode::kAvx2IntWork : decode::kInt8VnniValueWork;
  LineStream ahead;
  // Queues the lines of the block of keys from j (none past ub).
  const auto queue_block = [&](int64_t j) {
    ahead.Clear();
    const int64_t hi = std::min(ub, j + static_cast<int64_t>(block));
    if (j < hi) {
      kv.AheadKeys(ahead, j, hi);
      kv.AheadValues(ahead, j, hi);
    }
  };
  if (!first_queued) {  // the first block's lines, which no earlier block prefetched: at once
    queue_block(ua);
    ahead.IssueAll();
  }
  for (int64_t j0 = ua; j0 < ub; j0 += static_cast<int64_t>(block)) {
    const int64_t jn = std::min<int64_t>(static_cast<int64_t>(block), ub - j0);
    if (p.sink_tokens > 0) {  // a block in the gap between sink tokens and every row's window: skip
      bool any = false;
      for (int64_t r = 0; r < R && !any; ++r) {
        const KeyRange& k = seen[r];
        any = (k.lo < j0 + jn && k.hi > j0 && k.hi > k.lo) || k.sink_hi > j0;
      }
      if (!any) continue;
    }
    if (j0 + static_cast<int64_t>(block) < ub) {
      queue_block(j0 + static_cast<int64_t>(block));
    } else {  // the last block: the first of this thread's next task
      ahead.Clear();
      queue_next(ahead);
    }
    const uint64_t score_macs = static_cast<uint64_t>(R) * ((static_cast<size_t>(jn) + N - 1) / N * N) * depth;
    ahead.Plan(score_macs * score_work + static_cast<uint64_t>(R) * static_cast<uint64_t>(jn) * Dv * value_work);
    // Scores: for each N keys, every row's N dot products (head dim in the lanes), K rows read
    // in memory order. Lanes past the block's last key read that key again; the mask below drops
    // them. Vectors of the block past its last key (a short chunk or the cache's end) are not
    // computed: their scores are -inf, which the mask below keeps.
    const size_t nkb = (static_cast<size_t>(jn) + N - 1) / N;
    for (size_t kb = nkb; kb < kBlockVecs<Kv>; ++kb)
      for (int64_t r = 0; r < R; ++r) hn::Store(hn::Set(d, kNegInf), d, s + r * block + kb * N);
    for (size_t kb = 0; kb < nkb; ++kb) {
      const int64_t first = j0 + static_cast<int64_t>(kb * N);
      if constexpr (!Kv::kKeyTiles) {
        for (size_t x = 0; x < N; ++x) krows[x] = kv.key(std::min(first + static_cast<int64_t>(x), j0 + jn - 1));
      }
#if MHA_DECODE_DOTS
      if constexpr (std::is_same_v<Kv, PlainKv<bfloat16>>) {
        if (q.bf16) {
          // Rows with a score that is not finite (an Inf or NaN key, a sum past the float range)
          // take the float path's scores for these keys: Inf and NaN land where they land there.
          uint32_t redo = decode::Bf16KeyScores(amx_keys, q.pairs, q.ldb, R, krows, depth, p.scale,
                                                s + static_cast<int64_t>(kb * N), block, ahead);
          for (int64_t r = 0; redo != 0; ++r, redo >>= 1) {
            if (!(redo & 1)) continue;
            const auto sc = DotScores(d, q.tail, q.rows + r * ldq, kv, krows, depth);
            hn::Store(sc, d, s + r * block + kb * N);
          }
          continue;
        }
      }
#endif
      if constexpr (Kv::kKeyTiles) {
        KeyTileScores<Kv::kCodeBits>(d, q, kv.KeyTile(first / kCacheKeyTile * kCacheKeyTile),
                                     static_cast<size_t>(first % kCacheKeyTile), R, s + kb * N, block, ahead);
      } else if constexpr (kStage) {
        // Widen or dequantize the N keys once into the stage (L1), which every query row reads.
        for (size_t x = 0; x < N; ++x) kv.Stage(d, krows[x], depth, kstage + x * N, N * N);
        for (int64_t r = 0; r < R; ++r) {
          ahead.Issue(decode::kFloatWork * N * depth);
          hn::Store(StagedScores(d, q.rows + r * ldq, kstage, ldq / N), d, s + r * block + kb * N);
        }
      } else if constexpr (decode::GroupKeys<Kv>()) {
        GroupedKeyScores(d, q.tail, q.rows, ldq, R, kv, krows, depth, s + kb * N, block, ahead);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          ahead.Issue(decode::kFloatWork * N * depth);
          const auto sc = DotScores(d, q.tail, q.rows + r * ldq, kv, krows, depth);
          hn::Store(sc, d, s + r * block + kb * N);
        }
      }
    }
    // Softcap and ALiBi, mask, then the online softmax of each row.
    decode::BlockSoftmax<kBlockVecs<Kv>>(d, p, b, hk, rows, R, j0, jn, seen, s, m, l, alpha,
                                         int_values ? pmax : nullptr);
    // The block's value rows, found once for every pass below; quantized and bfloat16, at jn ..
    // jn + 2 the last again: the partners (weighted 0) of the last keys in the passes that take
    // keys by pairs or by fours.
    for (int64_t j = 0; j < jn; ++j) vrows[j] = kv.value(j0 + j);
    if constexpr (Kv::kKeyTiles || std::is_same_v<Kv, PlainKv<bfloat16>>)
      std::fill(vrows + jn, vrows + jn + 3, vrows[jn - 1]);
    // A key of the block that a row does not see (a window's first block, a causal last block of
    // several queries, a sink gap; for key tiles, keys before the first, read from a multiple of
    // N) has P = 0 in that row, and 0 times a non-finite value is NaN. For such blocks the rows'
    // outputs are kept; a row the passes leave not finite is redone by VisibleOutput.
    bool partial = false;
    for (int64_t r = 0; r < R && !partial; ++r) partial = !seen[r].covers(j0, j0 + jn);
    if (partial) std::copy(o, o + R * static_cast<int64_t>(dvp), saved);
#if MHA_DECODE_DOTS
    if (pw != nullptr) PairWeights(s, R, block, pw);  // for Int4Output or Bf16OutputCols
#endif
    // The block's values taken on byte or word weights (Int4Output256, Int4OutputVnni,
    // Int8WordPass) or by AMX tiles (AmxBf16Values), else by the passes below (values_taken):
    // pass(rt, c0, nc, r0, i) for each pass of kOutVecs vectors of columns
    // from c0 (nc of them) and kTileRows rows from r0 (RT = rt of them), i = g·R + r0 the index
    // of their weights, steps and mins (g = c0 / 32).
    bool values_taken = false;
    [[maybe_unused]] const auto integer_passes = [&](const auto& pass) {
      for (size_t c0 = 0; c0 < Dv; c0 += kOutVecs * N) {
        const size_t nc = std::min(kOutVecs * N, Dv - c0), g = c0 / kCacheQuantGroup;
        for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
          const size_t i = g * static_cast<size_t>(R) + static_cast<size_t>(r0);
          WithTileRows(R - r0, [&](auto rt) { pass(rt, c0, nc, r0, i); });
        }
      }
    };
#if MHA_DECODE_BYTE_VALUES
    if constexpr (std::is_same_v<Kv, QuantKv<4>>) {
      values_taken = byte_values && decode::ByteValueWeights<Kv>(d, s, block, static_cast<size_t>(R), pmax, vrows,
                                                                 static_cast<size_t>(jn), vgroups, vstage, vbytes,
                                                                 vsteps, vmins);
      if (values_taken) {
        integer_passes([&](auto rt, size_t c0, size_t nc, int64_t r0, size_t i) {
          constexpr size_t RT = decltype(rt)::value;
          const uint8_t* u = vbytes + i * block;
          float* oc = o + r0 * dvp + c0;
#if HWY_TARGET == HWY_AVX2
          if (nc == kOutVecs * N) {
            Int4Output256<RT, true>(u, block, vrows, c0, nc, static_cast<size_t>(jn), alpha + r0, vmins + i,
                                    vsteps + i, oc, dvp, ahead);
          } else {
            Int4Output256<RT, false>(u, block, vrows, c0, nc, static_cast<size_t>(jn), alpha + r0, vmins + i,
                                     vsteps + i, oc, dvp, ahead);
          }
#else  // AVX3: two groups a pass
          WithPassVectors((nc + N - 1) / N, [&](auto nv) {
            Int4OutputVnni<RT, decltype(nv)::value>(u, block, static_cast<size_t>(R), vrows, c0,
                                                     static_cast<size_t>(jn), alpha + r0, vmins + i, vsteps + i, oc,
                                                     dvp, ahead);
          });
#endif
        });
      }
    }
#endif
#if MHA_DECODE_WORD_VALUES
    if constexpr (std::is_same_v<Kv, QuantKv<8>>) {
      values_taken = word_values && decode::WordValueWeights(d, s, block, static_cast<size_t>(R), pmax, vrows,
                                                             static_cast<size_t>(jn), vgroups, vstage, vwords, vsteps,
                                                             vmins);
      if (values_taken) {
        integer_passes([&](auto rt, size_t c0, size_t nc, int64_t r0, size_t i) {
          decode::Int8WordPass<decltype(rt)::value>(vwords + i * block, block, static_cast<size_t>(R), vrows, c0, nc,
                                                    static_cast<size_t>(jn), alpha + r0, vmins + i, vsteps + i,
                                                    o + r0 * dvp + c0, dvp, ahead);
        });
      }
    }
#endif
    if constexpr (kFold) {
      if (!values_taken)
        decode::FoldValueWeights<Kv>(d, s, block, static_cast<size_t>(R), vrows, static_cast<size_t>(jn), vgroups,
                                     vstage, vweights, vmins);
    }
#if MHA_DECODE_DOTS
    if constexpr (std::is_same_v<Kv, PlainKv<bfloat16>>) {
      if (amx_values) {
        values_taken = decode::AmxBf16Values(s, block, R, vrows, static_cast<size_t>(jn), Dv, alpha, o, dvp, vtiles,
                                             vtstage, vsums, ahead);
        tiles->LoadQuery();
      }
    }
#endif
    for (size_t c0 = 0; !values_taken && c0 < Dv; c0 += kOutVecs * N) {
      const size_t nc = std::min(kOutVecs * N, Dv - c0);
      ForRowGroups(static_cast<size_t>(R), [&](size_t r0, size_t rg) {
        float* oc = o + r0 * dvp + c0;
        const float* pr = s + r0 * block;
        const float* mins = nullptr;
        if constexpr (kFold) {  // a pass is group c0 / 32
          const size_t g = c0 / kCacheQuantGroup;
          pr = vweights + (g * R + r0) * block;
          mins = vmins + g * R + r0;
        }
#if MHA_DECODE_DOTS
        if constexpr (std::is_same_v<Kv, QuantKv<4>>) {
          if (pairs) {
            const uint32_t* w = pw + r0 * block / 2;
            WithRowGroup(rg, [&](auto g) {
              WithPassVectors((nc + N - 1) / N, [&](auto nv) {
                Int4Output<decltype(g)::value, decltype(nv)::value>(w, block / 2, vrows, c0, static_cast<size_t>(jn),
                                                                    alpha + r0, oc, dvp, ahead);
              });
            });
            return;
          }
        }
        if constexpr (std::is_same_v<Kv, PlainKv<bfloat16>>) {
          if (bf16_values && Bf16OutputCols(rg, pw + r0 * block / 2, block / 2, vrows, c0, nc, static_cast<size_t>(jn),
                                            alpha + r0, oc, dvp, ahead)) {
            return;
          }
        }
#endif
        WithRowGroup(rg, [&](auto g) {
          DecodeOutputCols<decltype(g)::value>(d, pr, block, kv, vrows, c0, nc, jn, alpha + r0, oc, dvp, ahead,
                                               mins);
        });
      });
    }
    ahead.IssueAll();  // what the shares left (none, when the counts above are right)
    if (!partial) continue;
    for (int64_t r = 0; r < R; ++r) {
      float* orow = o + r * static_cast<int64_t>(dvp);
      if (std::all_of(orow, orow + Dv, [](float x) { return std::isfinite(x); })) continue;
      std::copy(saved + r * static_cast<int64_t>(dvp), saved + (r + 1) * static_cast<int64_t>(dvp), orow);
      decode::VisibleOutput(d, s + r * static_cast<int64_t>(block), kv, vrows, Dv, j0, static_cast<size_t>(jn),
                            seen[r], alpha[r], orow);
    }
  }
}

template <class Kv>
void DecodeOf(const AttentionParams& p, int num_threads) {
  const DF d;
  const size_t N = hn::Lanes(d), block = kBlockVecs<Kv> * N;
  const Split split = ChooseSplit(p, block);
  const int64_t heads = p.batch * p.kv_heads, R = p.group() * p.q_len;
  const size_t dvp = (static_cast<size_t>(p.head_dim_v) + N - 1) / N * N;
  // Task t's keys: chunk t % parts of (b, kv head) t / parts. Each task's last block prefetches
  // the first of the task its thread runs next (parallel_for_ahead, QueueFirstBlock): with many
  // short tasks (a batch of short sequences) their first blocks' waits added up.
  const auto task_keys = [&](int64_t t) {
    const int64_t part = t % split.parts;
    return std::pair<int64_t, int64_t>{part * split.chunk, std::min(p.kv_len, (part + 1) * split.chunk)};
  };
  const int64_t tasks = heads * split.parts;
  const auto queue_task = [&](int64_t t, LineStream& ahead) {
    if (t >= tasks) return;
    const int64_t bh = t / split.parts;
    int64_t k0, k1;
    std::tie(k0, k1) = task_keys(t);
    QueueFirstBlock<Kv>(p, bh / p.kv_heads, bh % p.kv_heads, k0, k1, ahead);
  };
  if (split.parts == 1) {
    // One chunk per (b, kv head): each task merges (normalises) its own result, one region.
    parallel_for_ahead(heads, num_threads, [&](int64_t bh, const auto& claim, bool queued) {
      Workspace& ws = Workspace::local();
      float* o = ws.get<float>(Workspace::kDecodeOut, static_cast<size_t>(R) * dvp);
      float* m = ws.get<float>(Workspace::kDecodeMax, static_cast<size_t>(R));
      float* l = ws.get<float>(Workspace::kDecodeSum, static_cast<size_t>(R));
      const auto queue = [&](LineStream& ahead) { queue_task(claim(), ahead); };
      DecodeChunk<Kv>(p, bh / p.kv_heads, bh % p.kv_heads, 0, p.kv_len, o, m, l, queued, QueueNext(queue));
      Merge(p, bh / p.kv_heads, bh % p.kv_heads, 1, o, m, l, dvp);
    });
    return;
  }
  // Partial results of every chunk, in this thread's workspace (reused across calls): O(B·Hkv·S·R·Dv)
  // floats, the size of the output times S; 64-byte aligned.
  const size_t rows = static_cast<size_t>(heads * split.parts * R);
  Workspace& ws = Workspace::local();
  float* o = ws.get<float>(Workspace::kDecodeOut, rows * dvp);
  float* m = ws.get<float>(Workspace::kDecodeMax, rows);
  float* l = ws.get<float>(Workspace::kDecodeSum, rows);
  parallel_for_ahead(tasks, num_threads, [&](int64_t t, const auto& claim, bool queued) {
    const int64_t bh = t / split.parts;
    int64_t k0, k1;
    std::tie(k0, k1) = task_keys(t);
    const size_t at = static_cast<size_t>(t * R);
    const auto queue = [&](LineStream& ahead) { queue_task(claim(), ahead); };
    DecodeChunk<Kv>(p, bh / p.kv_heads, bh % p.kv_heads, k0, k1, o + at * dvp, m + at, l + at, queued,
                    QueueNext(queue));
  });
  parallel_for(heads, num_threads, [&](int64_t bh) {
    const size_t at = static_cast<size_t>(bh * split.parts * R);
    Merge(p, bh / p.kv_heads, bh % p.kv_heads, split.parts, o + at * dvp, m + at, l + at, dvp);
  });
}

}  // namespace

void FlashDecode(const AttentionParams& p, int num_threads) {
  if (p.kv_bits == 8) return DecodeOf<QuantKv<8>>(p, num_threads);
  if (p.kv_bits == 4) return DecodeOf<QuantKv<4>>(p, num_threads);
  switch (p.dtype) {
    case DType::kBF16: DecodeOf<PlainKv<bfloat16>>(p, num_threads); break;
    case DType::kF16: DecodeOf<PlainKv<float16>>(p, num_threads); break;
    default: DecodeOf<PlainKv<float>>(p, num_threads); break;
  }
}

// The kernel and, for the cache types with dot-product paths, which one runs on this CPU.
std::string FlashDecodeName() {
  std::string keys = "float FMAs", int8_values = "float FMAs", values = "float FMAs", bf16_keys = "widened to float",
              bf16_values = "float FMAs";
#if MHA_DECODE_INT_DOTS
  if (decode_int8_dots()) keys = "AVX2 integer products";
#endif
#if HWY_TARGET == HWY_AVX2
  if (decode_byte_values()) values = "AVX2 integer products on byte weights";
#endif
#if MHA_DECODE_DOTS
  if (decode_avx512_vnni()) keys = "AVX-512 VNNI";
  if (decode_bf16_dots()) values = bf16_keys = "AVX-512 BF16 dot products";
  if (decode_amx_bf16()) bf16_keys = "AMX tiles (head dims 32, 64, 96, 128; else AVX-512 BF16 dot products)";
  if (decode_bf16_values())
    bf16_values = "AVX-512 BF16 dot products on key pairs (passes of 64 or 32 columns; else float FMAs)";
  if (decode_amx_bf16_values())
    bf16_values = "AMX tiles (with the keys', up to 8 query rows per kv head, Dv % 32 == 0; else float FMAs)";
  if (decode_vnni_byte_values()) values = "AVX-512 VNNI on byte weights";
#endif
#if MHA_DECODE_WORD_VALUES
  if (decode_vnni_word_values()) int8_values = "AVX-512 VNNI on 16-bit weights";
#endif
  return std::string("flash_decode_f32_") + hwy::TargetName(HWY_TARGET) + " (int8/int4 keys: " + keys +
         "; int8 values: " + int8_values + "; int4 values: " + values + "; bfloat16 keys: " + bf16_keys +
         "; bfloat16 values: " + bf16_values + ")";
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {

HWY_EXPORT(FlashDecode);
HWY_EXPORT(FlashDecodeName);

void flash_decode(const AttentionParams& p, int num_threads) { HWY_DYNAMIC_DISPATCH(FlashDecode)(p, num_threads); }
std::string flash_decode_name() { return HWY_DYNAMIC_DISPATCH(FlashDecodeName)(); }

bool decode_applies(const AttentionParams& p) {
  return p.group() * p.q_len <= kMaxDecodeRows && p.kv_len >= p.q_len && !p.keep && !p.attn_bias && !p.weights &&
         p.dropout_p == 0.0f && p.q_len > 0 && p.batch > 0 && p.k_stride[3] == 1 && p.v_stride[3] == 1;
}

}  // namespace mha::kernels
#endif  // HWY_ONCE
