// Pieces shared by the fast attention kernels (forward, weights pass, backward): tile sizes
// per SIMD target, the rows of a task, packing Q, classifying and masking key blocks, dropout
// on a block, and the QKᵀ block product. See tiles-inl.h for the layout (query rows in lanes).
#if defined(MHA_KERNELS_CPU_FLASH_BLOCKS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_FLASH_BLOCKS_INL_H_
#undef MHA_KERNELS_CPU_FLASH_BLOCKS_INL_H_
#else
#define MHA_KERNELS_CPU_FLASH_BLOCKS_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "util/convert-inl.h"
#include "kernels/cpu/exp2-inl.h"
#include "kernels/cpu/flash_plan.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/tiles-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/dropout.h"
#include "kernels/workspace.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace flash {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// Register tiles per target: AVX-512 has 32 vector registers, the others 16.
#if HWY_TARGET <= HWY_AVX3
constexpr size_t kQkKeys = 8;  // QkTile: 8 keys × 3 row vectors = 24 accumulators
constexpr size_t kPvCols = 8;  // PvTile: 8 columns × 3 row vectors
#else
constexpr size_t kQkKeys = 4;  // 4 × 3 = 12 accumulators
constexpr size_t kPvCols = 4;
#endif
constexpr size_t kRowVecs = 3;
// Rows per task and keys per block: measured best of 48/96 rows × 64/128/256 keys here. The
// St tile (64 × 48 floats, 12 KiB), Qt and Ot (D × 48) stay in L1/L2.
constexpr int64_t kTargetRows = 48;
constexpr int64_t kKeyBlock = 64;
constexpr int64_t kSpillBlocks = 1024;  // the forward folds its running sums every 1024 blocks (2^16 keys)

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// St rows 0 .. n (keys a .. a + n, n a multiple of kQkKeys) for row vectors [0, nvec). Keys
// past Tk read the last key; their scores are masked afterwards.
template <bool kUnit>
inline void ScoresBlock(DF d, const float* qt, size_t ldq, size_t nvec, const float* kbase, int64_t ks, int64_t kd,
                        int64_t a, int64_t n, int64_t Tk, size_t depth, float* st) {
  const size_t N = hn::Lanes(d);
  for (int64_t kr = 0; kr < n; kr += kQkKeys) {
    const float* krows[kQkKeys];
    for (size_t x = 0; x < kQkKeys; ++x) krows[x] = kbase + std::min<int64_t>(a + kr + x, Tk - 1) * ks;
    float* s = st + kr * ldq;
    for (size_t rv = 0; rv < nvec; rv += kRowVecs) {
      switch (std::min(kRowVecs, nvec - rv)) {
        case 1: QkTile<kQkKeys, 1, kUnit>(d, qt + rv * N, ldq, krows, kd, depth, s + rv * N, ldq); break;
        case 2: QkTile<kQkKeys, 2, kUnit>(d, qt + rv * N, ldq, krows, kd, depth, s + rv * N, ldq); break;
        default: QkTile<kQkKeys, 3, kUnit>(d, qt + rv * N, ldq, krows, kd, depth, s + rv * N, ldq); break;
      }
    }
  }
}

// The rows of one task and what they may see. Per-row arrays are filled once per task so the
// block loop never divides.
struct TaskRows {
  int64_t b, hk, i0, nq;    // queries i0 .. i0 + nq of every head of the group
  int64_t rows;             // G · q_per_task (some invalid when nq < q_per_task)
  size_t mpad, nvec;        // rows padded to whole vectors
  uint8_t* valid;           // per padded row
  int64_t* head;            // query head of the row
  int64_t* query;           // query index of the row
  int64_t* lo;              // visible key range [lo, hi) from causal/window/lengths,
  int64_t* hi;
  int64_t* sink_hi;         // and [0, sink_hi) of sink tokens past a gap (KeyRange)
  int32_t* lo_rel;          // lo and hi relative to the block being masked (MaskBlock): int32
  int32_t* hi_rel;          // lanes compare them, and they fit whatever the key count
  int32_t* sink_rel;
  float* slope;             // ALiBi (if p.alibi): the row's slope (0 for invalid rows),
  int64_t* pos;             // its query position,
  float* pos_rel;           // and that position relative to the block being masked
  KeyRange keys;            // union over the task's rows
};

inline TaskRows MakeRows(const AttentionParams& p, const FlashPlan& plan, int64_t b, int64_t hk, int64_t qb, size_t N,
                         Workspace& ws) {
  TaskRows t;
  t.b = b;
  t.hk = hk;
  t.i0 = qb * plan.q_per_task;
  t.nq = std::min(plan.q_per_task, p.q_len - t.i0);
  t.rows = plan.rows;
  t.nvec = (static_cast<size_t>(t.rows) + N - 1) / N;
  t.mpad = t.nvec * N;
  t.lo = ws.get<int64_t>(Workspace::kTileLo, t.mpad);
  t.hi = ws.get<int64_t>(Workspace::kTileHi, t.mpad);
  t.lo_rel = ws.get<int32_t>(Workspace::kTileLoRel, t.mpad);
  t.hi_rel = ws.get<int32_t>(Workspace::kTileHiRel, t.mpad);
  t.sink_hi = ws.get<int64_t>(Workspace::kTileSinkHi, t.mpad);
  t.sink_rel = ws.get<int32_t>(Workspace::kTileSinkRel, t.mpad);
  t.head = ws.get<int64_t>(Workspace::kTileHead, t.mpad);
  t.query = ws.get<int64_t>(Workspace::kTileQuery, t.mpad);
  t.valid = ws.get<uint8_t>(Workspace::kTileValid, t.mpad);
  std::fill(t.valid, t.valid + t.mpad, 0);
  std::fill(t.lo, t.lo + t.mpad, 0);
  std::fill(t.hi, t.hi + t.mpad, 0);
  std::fill(t.sink_hi, t.sink_hi + t.mpad, 0);
  std::fill(t.head, t.head + t.mpad, 0);
  std::fill(t.query, t.query + t.mpad, 0);
  for (int64_t g = 0; g < p.group(); ++g) {
    for (int64_t x = 0; x < t.nq; ++x) {
      const int64_t r = g * plan.q_per_task + x, i = t.i0 + x;
      const KeyRange k = visible_keys(p, b, i);
      t.valid[r] = 1;
      t.head[r] = hk * p.group() + g;
      t.query[r] = i;
      t.lo[r] = k.lo;
      t.hi[r] = k.hi;
      t.sink_hi[r] = k.sink_hi;
    }
  }
  if (p.alibi) {
    t.slope = ws.get<float>(Workspace::kTileSlope, t.mpad);
    t.pos = ws.get<int64_t>(Workspace::kTilePos, t.mpad);
    t.pos_rel = ws.get<float>(Workspace::kTilePosRel, t.mpad);
    for (size_t r = 0; r < t.mpad; ++r) {
      t.slope[r] = t.valid[r] ? alibi_slope(p, b, t.head[r]) : 0.0f;
      t.pos[r] = t.valid[r] ? query_position(p, b, t.query[r]) : 0;
    }
  }
  t.keys = task_keys(p, b, t.i0, t.i0 + t.nq);
  return t;
}

// Folds each valid row's sink into its final (m, l): the sink is one more term exp(sink - m) of
// the denominator, added once at the end as the reference adds it (not carried through the
// online rescaling). Sets factor[r] so that out = Ot · factor / l and LSE = m + ln l; a row
// that saw no key (l = 0) gets factor 0, l = 1, m = sink: zeros, LSE = sink.
inline void FoldSinks(const AttentionParams& p, const TaskRows& t, float* m, float* l, float* factor) {
  for (size_t r = 0; r < t.mpad; ++r) {
    factor[r] = 1.0f;
    if (!t.valid[r]) continue;
    const float sink = sink_logit(p, t.head[r]);
    if (m[r] >= sink) {  // then m is finite: exp(sink - m) <= 1
      l[r] += std::exp(sink - m[r]);
    } else {  // sink > m (or m is NaN: NaN reaches l and the output)
      factor[r] = l[r] == 0.0f ? 0.0f : std::exp(m[r] - sink);
      l[r] = l[r] * factor[r] + 1.0f;
      m[r] = sink;
    }
  }
}

// dst[d][r] = src[row r][d] · scale for d < width (src: a (B, H, T, width) tensor of element
// type T with strides st, rows of the task); zero for invalid rows. N rows at a time through an
// in-register transpose when the last dim is contiguous. 16-bit rows are first widened into
// `stage` (mpad × width floats; unused for float).
template <typename T>
inline void PackTransposed(DF d, const TaskRows& t, const T* src, const Strides4& st, int64_t width, float scale,
                           float* dst, float* stage) {
  const size_t N = hn::Lanes(d), W = static_cast<size_t>(width);
  auto row = [&](size_t r) { return src + t.b * st[0] + t.head[r] * st[1] + t.query[r] * st[2]; };
  if constexpr (!std::is_same_v<T, float>) {
    for (size_t r = 0; r < t.mpad; ++r)
      if (t.valid[r]) RowToFloat(row(r), st[3], W, stage + r * W);
  } else if (st[3] != 1) {
    for (size_t r = 0; r < t.mpad; ++r)
      for (size_t dd = 0; dd < W; ++dd) dst[dd * t.mpad + r] = t.valid[r] ? row(r)[dd * st[3]] * scale : 0.0f;
    return;
  }
  auto float_row = [&](size_t r) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return row(r);
    } else {
      return stage + r * W;
    }
  };
  HWY_ALIGN static const float kZeros[hn::MaxLanes(DF())] = {};
  const float* rows[hn::MaxLanes(DF())];
  for (size_t r0 = 0; r0 < t.mpad; r0 += N) {
    for (size_t dd = 0; dd < W; dd += N) {
      for (size_t x = 0; x < N; ++x) rows[x] = t.valid[r0 + x] ? float_row(r0 + x) + dd : kZeros;
      Transpose(d, rows, std::min(N, W - dd), dst + dd * t.mpad + r0, t.mpad, scale);
    }
  }
}

// Qt[d][r] = q[row r][d] · scale. (log2 e is applied later, to s - m: folding it in here
// would add a rounding of every score that plain float32 does not have.)
template <typename T>
inline void PackQueries(DF d, const AttentionParams& p, const TaskRows& t, float* qt, Workspace& ws) {
  float* stage = std::is_same_v<T, float> ? nullptr
                                          : ws.get<float>(Workspace::kQueryStage, t.mpad * p.head_dim_qk);
  PackTransposed(d, t, static_cast<const T*>(p.q), p.q_stride, p.head_dim_qk, p.scale, qt, stage);
}

// Rows first .. first + n of a (Tk, width) matrix of 16-bit elements (row stride rs, element
// stride es), widened into dst (n × width, contiguous); rows past last repeat row last.
template <typename T>
inline void StageRows(const T* base, int64_t rs, int64_t es, int64_t first, int64_t n, int64_t last, int64_t width,
                      float* dst) {
  for (int64_t x = 0; x < n; ++x) {
    RowToFloat(base + std::min(first + x, last) * rs, es, static_cast<size_t>(width), dst + x * width);
  }
}

// Rows first .. first + n of a matrix of row stride rs (elements of T, width per row; rows past
// last repeat it) prefetched into the cache, line by line. For rows that are not adjacent —
// (B, T, H, D) tensors viewed as (B, H, T, D), the projections' layout — which the hardware
// prefetcher does not follow (it runs ahead within a 4 KiB page, and such rows sit H·D or more
// elements apart): each row was a demand miss, and a float32 forward over them ran ~1.7x slower
// than over contiguous heads.
template <typename T>
HWY_INLINE void PrefetchRows(const T* base, int64_t rs, int64_t first, int64_t n, int64_t last, int64_t width) {
  const size_t bytes = static_cast<size_t>(width) * sizeof(T);
  for (int64_t x = 0; x < n; ++x) {
    PrefetchLines<PrefetchTo::kL1>(base + std::min(first + x, last) * rs, bytes);
  }
}

enum class BlockKind { kSkip, kFull, kPartial };

// One key block of a task, trimmed to the keys some row of the task can see.
struct KeyBlock {
  int64_t a, n;        // St row x holds key a + x, for x < n (n a multiple of kQkKeys)
  int64_t nv;          // keys a .. a + nv may be visible (V rows read for them)
  BlockKind kind;      // skip: nothing visible; full: everything visible, no per-element masking
  bool keep_partial;   // keep_mask varies inside the block
};

// Whether keep-mask bytes m[j · s] for j in [a, b) include a kept (nonzero) one and whether all
// are kept, folded into some and all. Dense rows (s = 1) are searched with memchr, which reads
// them a vector at a time: a padding mask is mostly kept, and a byte-by-byte scan of every
// block's rows was ~20% of a masked forward at T = 512.
inline void ScanKeep(const uint8_t* m, int64_t s, int64_t a, int64_t b, bool& some, bool& all) {
  if (a >= b) return;
  if (s != 1) {
    for (int64_t j = a; j < b; ++j) {
      const bool kept = m[j * s] != 0;
      some |= kept;
      all &= kept;
    }
    return;
  }
  const void* zero = std::memchr(m + a, 0, static_cast<size_t>(b - a));
  if (zero == nullptr) {
    some = true;
    return;
  }
  all = false;
  for (int64_t j = a; j < b && !some; ++j) some = m[j] != 0;  // stops at the first kept key
}

inline KeyBlock MakeBlock(const AttentionParams& p, const TaskRows& t, int64_t jb) {
  KeyBlock k;
  const int64_t ua = std::max<int64_t>(jb, t.keys.lo), ub = std::min<int64_t>(jb + kKeyBlock, t.keys.hi);
  k.a = jb + (ua - jb) / static_cast<int64_t>(kQkKeys) * kQkKeys;
  k.n = (ub - k.a + kQkKeys - 1) / kQkKeys * kQkKeys;
  k.nv = ub - k.a;
  k.keep_partial = false;
  const int64_t j0 = k.a, j1 = k.a + k.n;
  bool any = false, all = true;
  for (int64_t r = 0; r < t.rows; ++r) {
    if (!t.valid[r]) continue;
    any |= (t.lo[r] < t.hi[r] && t.lo[r] < j1 && t.hi[r] > j0) || t.sink_hi[r] > j0;
    all &= (t.lo[r] <= j0 && t.hi[r] >= j1) || t.sink_hi[r] >= j1;
  }
  if (!any || ub <= ua) {
    k.kind = BlockKind::kSkip;
    return k;
  }
  if (p.keep) {
    bool some_kept = false, all_kept = true;
    const int64_t je = std::min(j1, p.kv_len);
    for (int64_t r = 0; r < t.rows && (all_kept || !some_kept); ++r) {
      if (!t.valid[r]) continue;
      const uint8_t* m = p.keep + t.b * p.keep_stride[0] + t.head[r] * p.keep_stride[1] + t.query[r] * p.keep_stride[2];
      // The row's visible keys: its range [lo, hi) and the sink tokens [0, sink_hi).
      ScanKeep(m, p.keep_stride[3], std::max(j0, t.lo[r]), std::min(je, t.hi[r]), some_kept, all_kept);
      ScanKeep(m, p.keep_stride[3], j0, std::min(je, t.sink_hi[r]), some_kept, all_kept);
    }
    if (!some_kept) {
      k.kind = BlockKind::kSkip;
      return k;
    }
    k.keep_partial = !all_kept;
  }
  k.kind = all && !k.keep_partial ? BlockKind::kFull : BlockKind::kPartial;
  return k;
}

// Softcapping of a block's scores (n keys × M rows): s = cap·tanh(s / cap). If grad is given,
// it receives d(capped)/d(s) = 1 - tanh² for the backward.
inline void SoftcapBlock(DF d, float cap, int64_t n, size_t M, float* st, float* grad) {
  const auto c = hn::Set(d, cap), inv = hn::Set(d, 1.0f / cap), one = hn::Set(d, 1.0f);
  const size_t N = hn::Lanes(d);
  for (size_t x = 0; x < static_cast<size_t>(n) * M; x += N) {
    const auto th = SoftcapTanh(d, hn::Mul(hn::Load(d, st + x), inv));
    hn::Store(hn::Mul(c, th), d, st + x);
    if (grad) hn::Store(hn::NegMulAdd(th, th, one), d, grad + x);
  }
}

// Whether a block's scores need MaskBlock: partial visibility, a bias, or ALiBi.
inline bool NeedsMask(const AttentionParams& p, const KeyBlock& k) {
  return k.kind == BlockKind::kPartial || p.attn_bias || p.alibi;
}

// Bias and ALiBi, then -inf outside each row's range and where keep_mask is 0.
inline void MaskBlock(DF d, const AttentionParams& p, const TaskRows& t, const KeyBlock& k, float* st) {
  const size_t N = hn::Lanes(d);
  const int64_t jn = std::min(k.n, p.kv_len - k.a);  // keys that exist
  if (p.alibi) {
    // s -= slope · |pos - j|, rows in the lanes; distances as float (exact below 2^24 keys).
    for (size_t r = 0; r < t.mpad; ++r) t.pos_rel[r] = static_cast<float>(t.pos[r] - k.a);
    for (int64_t j = 0; j < k.n; ++j) {
      const auto jj = hn::Set(d, static_cast<float>(j));
      for (size_t rv = 0; rv < t.nvec; ++rv) {
        float* s = st + j * t.mpad + rv * N;
        const auto dist = hn::Abs(hn::Sub(hn::Load(d, t.pos_rel + rv * N), jj));
        hn::Store(hn::NegMulAdd(hn::Load(d, t.slope + rv * N), dist, hn::Load(d, s)), d, s);
      }
    }
  }
  if (p.attn_bias && p.attn_bias_stride[3] == 1) {
    // Dense key rows: N rows' biases transposed into the lanes, N keys at a time (a scalar add
    // per score was ~25% of a forward with a float padding mask at T = 256). Rows past the
    // task's read zeros.
    static constexpr float kZeros[hn::MaxLanes(DF())] = {};
    const float* base[hn::MaxLanes(DF())];
    const float* rows[hn::MaxLanes(DF())];
    HWY_ALIGN float block[hn::MaxLanes(DF()) * hn::MaxLanes(DF())];
    for (size_t rv = 0; rv < t.nvec; ++rv) {
      for (size_t l = 0; l < N; ++l) {
        const size_t r = rv * N + l;
        base[l] = t.valid[r] ? p.attn_bias + t.b * p.attn_bias_stride[0] + t.head[r] * p.attn_bias_stride[1] +
                                   t.query[r] * p.attn_bias_stride[2] + k.a
                             : nullptr;
      }
      for (int64_t c0 = 0; c0 < jn; c0 += static_cast<int64_t>(N)) {
        const size_t nc = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(N), jn - c0));
        for (size_t l = 0; l < N; ++l) rows[l] = base[l] ? base[l] + c0 : kZeros;
        Transpose(d, rows, nc, block, N, 1.0f);
        for (size_t c = 0; c < nc; ++c) {
          float* s = st + (c0 + static_cast<int64_t>(c)) * t.mpad + rv * N;
          hn::Store(hn::Add(hn::Load(d, s), hn::Load(d, block + c * N)), d, s);
        }
      }
    }
  } else if (p.attn_bias) {  // keys spaced apart (or broadcast): one at a time
    for (size_t r = 0; r < t.mpad; ++r) {
      if (!t.valid[r]) continue;
      const float* bias = p.attn_bias + t.b * p.attn_bias_stride[0] + t.head[r] * p.attn_bias_stride[1] +
                          t.query[r] * p.attn_bias_stride[2] + k.a * p.attn_bias_stride[3];
      for (int64_t j = 0; j < jn; ++j) st[j * t.mpad + r] += bias[j * p.attn_bias_stride[3]];
    }
  }
  if (k.kind == BlockKind::kPartial) {
    // Each row's range relative to the block, clamped to [0, n]: int32 lanes, any key count.
    for (size_t r = 0; r < t.mpad; ++r) {
      t.lo_rel[r] = static_cast<int32_t>(std::clamp<int64_t>(t.lo[r] - k.a, 0, k.n));
      t.hi_rel[r] = static_cast<int32_t>(std::clamp<int64_t>(t.hi[r] - k.a, 0, k.n));
      t.sink_rel[r] = static_cast<int32_t>(std::clamp<int64_t>(t.sink_hi[r] - k.a, 0, k.n));
    }
    const hn::RebindToSigned<DF> di;
    for (int64_t j = 0; j < k.n; ++j) {
      const auto jj = hn::Set(di, static_cast<int32_t>(j));
      const auto jj1 = hn::Set(di, static_cast<int32_t>(j + 1));
      for (size_t rv = 0; rv < t.nvec; ++rv) {
        // lo <= j < hi, or j < sink_hi
        const auto vis =
            hn::Or(hn::And(hn::Lt(hn::Load(di, t.lo_rel + rv * N), jj1), hn::Lt(jj, hn::Load(di, t.hi_rel + rv * N))),
                   hn::Lt(jj, hn::Load(di, t.sink_rel + rv * N)));
        float* s = st + j * t.mpad + rv * N;
        hn::Store(hn::IfThenElse(hn::RebindMask(d, vis), hn::Load(d, s), hn::Set(d, kNegInf)), d, s);
      }
    }
  }
  if (k.keep_partial) {
    for (size_t r = 0; r < t.mpad; ++r) {
      if (!t.valid[r]) continue;
      const uint8_t* m = p.keep + t.b * p.keep_stride[0] + t.head[r] * p.keep_stride[1] +
                         t.query[r] * p.keep_stride[2] + k.a * p.keep_stride[3];
      if (p.keep_stride[3] == 1 && std::memchr(m, 0, static_cast<size_t>(std::max<int64_t>(jn, 0))) == nullptr) {
        continue;  // every key of the row kept
      }
      for (int64_t j = 0; j < jn; ++j)
        if (m[j * p.keep_stride[3]] == 0) st[j * t.mpad + r] = kNegInf;
    }
  }
}

#if HWY_TARGET != HWY_SCALAR
// hi:lo = a · m, 32 x 32 -> 64 bits per lane (even lanes, then odd ones moved down and back).
template <class DU>
HWY_INLINE void MulHiLo32(DU du, hn::Vec<DU> a, uint32_t m, hn::Vec<DU>& hi, hn::Vec<DU>& lo) {
  const hn::RepartitionToWide<DU> dw;
  const auto mv = hn::Set(du, m);
  const auto even = hn::BitCast(du, hn::MulEven(a, mv));  // (lo, hi) of lanes 0, 2, ...
  const auto odd = hn::BitCast(du, hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(dw, a))), mv));
  lo = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(hn::BitCast(dw, odd))), even);
  hi = hn::OddEven(odd, hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(dw, even))));
}

// Random123's Philox4x32-10 on a vector of counters (c0, c1, c2, c3) at once, in place: lane l
// ends with the bits Dropout::bits4 gives for lane l's counter.
template <class DU>
HWY_INLINE void Philox4x32(DU du, hn::Vec<DU>& c0, hn::Vec<DU>& c1, hn::Vec<DU>& c2, hn::Vec<DU>& c3, uint32_t k0,
                           uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;  // PHILOX_W32_0, _1
    hn::Vec<DU> hi0, lo0, hi1, lo1;
    MulHiLo32(du, c0, 0xD2511F53u, hi0, lo0);  // PHILOX_M4x32_0
    MulHiLo32(du, c2, 0xCD9E8D57u, hi1, lo1);  // PHILOX_M4x32_1
    c0 = hn::Xor(hn::Xor(hi1, c1), hn::Set(du, k0));
    c2 = hn::Xor(hn::Xor(hi0, c3), hn::Set(du, k1));
    c1 = lo1;
    c3 = lo0;
  }
}
#endif

// Dropout on the probabilities of a block: kept ones scaled by 1/(1-p), others zeroed; the same
// decisions on a second tile st2 if given (the backward's P and dP). Rows are in the lanes, so
// Philox runs on a vector of rows' counters (j / 4, i, h, b) and one result covers four keys of
// each; invalid rows get counters of 0 and are dropped or scaled like the rest (never read).
inline void DropBlock(const AttentionParams& p, const Dropout& drop, const TaskRows& t, const KeyBlock& k, float* st,
                      float* st2 = nullptr) {
  const int64_t jn = std::min(k.n, p.kv_len - k.a);
  if (jn <= 0) return;
#if HWY_TARGET == HWY_SCALAR
  for (size_t r = 0; r < t.mpad; ++r) {
    if (!t.valid[r]) continue;
    for (int64_t j = 0; j < jn; ++j) {
      const bool kept = drop.keep(t.b, t.head[r], t.query[r], k.a + j);
      for (float* tile : {st, st2}) {
        if (tile) tile[j * t.mpad + r] = kept ? tile[j * t.mpad + r] * drop.scale() : 0.0f;
      }
    }
  }
#else
  const DF d;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const size_t N = hn::Lanes(d);
  HWY_ALIGN uint32_t heads[hn::MaxLanes(du)], queries[hn::MaxLanes(du)];
  const auto flip = hn::Set(du, 0x80000000u);  // unsigned >= as a signed compare
  const auto threshold = hn::BitCast(di, hn::Xor(hn::Set(du, drop.threshold()), flip));
  const auto scale = hn::Set(d, drop.scale());
  const int64_t first = k.a >> 2, last = (k.a + jn - 1) >> 2;
  for (size_t rv = 0; rv < t.nvec; ++rv) {
    for (size_t l = 0; l < N; ++l) {
      const size_t r = rv * N + l;
      heads[l] = t.valid[r] ? static_cast<uint32_t>(t.head[r]) : 0;
      queries[l] = t.valid[r] ? static_cast<uint32_t>(t.query[r]) : 0;
    }
    const auto h = hn::Load(du, heads), i = hn::Load(du, queries), b = hn::Set(du, static_cast<uint32_t>(t.b));
    for (int64_t j4 = first; j4 <= last; ++j4) {
      hn::Vec<decltype(du)> w[4] = {hn::Set(du, static_cast<uint32_t>(j4)), i, h, b};
      Philox4x32(du, w[0], w[1], w[2], w[3], drop.key(0), drop.key(1));
      for (int64_t x = 0; x < 4; ++x) {
        const int64_t j = 4 * j4 + x - k.a;
        if (j < 0 || j >= jn) continue;
        const auto dropped = hn::Lt(hn::BitCast(di, hn::Xor(w[x], flip)), threshold);
        const auto keep = hn::RebindMask(d, hn::Not(dropped));
        for (float* tile : {st, st2}) {
          if (!tile) continue;
          float* s = tile + j * t.mpad + rv * N;
          hn::Store(drop.drop_all() ? hn::Zero(d) : hn::IfThenElseZero(keep, hn::Mul(hn::Load(d, s), scale)), d, s);
        }
      }
    }
  }
#endif
}

}  // namespace flash
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_FLASH_BLOCKS_INL_H_
