// The fast attention backward (FlashAttention-2, Algorithm 2, adapted to the CPU), float32 (and
// bfloat16/float16 arguments widened as they are read), compiled per SIMD target like the forward;
// for bfloat16 where the CPU has AMX, the five block products below are tile products
// (flash_bwd_amx-inl.h) in the same block layout, with P_d and dS rounded to bfloat16.
//
// A task is one (batch, kv head): all its key blocks (outer loop) against all query blocks of
// its G query heads (inner loop). Per pair of blocks, with query rows in the lanes as in the
// forward (tiles stored keys × rows):
//   St   = K_blk · Qtᵀ                  (Q pre-scaled)          recomputed, masked as the forward
//   P    = 2^((St - lse)·log2 e)                                from the forward's LSE
//   dPt  = V_blk · dOtᵀ,  dP = dP_d ⊙ Z/(1-p)                   (Z: regenerated dropout keeps)
//   dSt  = P ⊙ (dP - D_row),   D_row = rowsum(dO ⊙ O)           (computed once per task)
//          (also the bias's gradient, if asked for: written out before the softcap's factor)
//   dV_blk += P_dᵀ · dO,  dK_blk += dSᵀ · Q,  dQ_task += dS · K_blk
// and dK = scale·dK_blk, dQ = scale·dQ_task at the end. dK and dV of a kv head sum over its G
// query heads inside one task and dQ belongs to the task, so there are no atomics and the
// result has the same bits for any thread count. Memory per thread: O((Bk + M)·D) for the
// tiles plus O(G·Tq·D) for dQ, and for the packed query blocks up to backward_pack_limit().
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_bwd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/exp2-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/flash_blocks-inl.h"
#include "kernels/cpu/flash_bwd_amx-inl.h"
#include "kernels/cpu/flash_plan.h"
#include "util/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

using namespace flash;  // NOLINT(build/namespaces): the shared block helpers

#if HWY_TARGET <= HWY_AVX3
constexpr size_t kOuterRows = 6, kOuterVecs = 4;  // 24 accumulators
#else
constexpr size_t kOuterRows = 3, kOuterVecs = 4;  // 12 accumulators
#endif

// C[a][c] += Σ_{x < nx} A(x, a) · B[x][c] for RA values of a and CV vectors of c, with
// A(x, a) = A[x·sx + a·sa] (scalar broadcasts) and B rows of stride sb (vector loads).
template <size_t RA, size_t CV>
HWY_INLINE void OuterTile(DF d, const float* HWY_RESTRICT A, int64_t sx, int64_t sa, const float* HWY_RESTRICT B,
                          size_t sb, size_t nx, float* HWY_RESTRICT C, size_t ldc) {
  using V = hn::Vec<DF>;
  const size_t N = hn::Lanes(d);
  V acc[RA][CV];
  for (size_t a = 0; a < RA; ++a)
    for (size_t c = 0; c < CV; ++c) acc[a][c] = hn::Load(d, C + a * ldc + c * N);
  for (size_t x = 0; x < nx; ++x) {
    V b[CV];
    for (size_t c = 0; c < CV; ++c) b[c] = hn::Load(d, B + x * sb + c * N);
    const float* ax = A + static_cast<int64_t>(x) * sx;
    for (size_t a = 0; a < RA; ++a) {
      const V av = hn::Set(d, ax[static_cast<int64_t>(a) * sa]);
      for (size_t c = 0; c < CV; ++c) acc[a][c] = hn::MulAdd(av, b[c], acc[a][c]);
    }
  }
  for (size_t a = 0; a < RA; ++a)
    for (size_t c = 0; c < CV; ++c) hn::Store(acc[a][c], d, C + a * ldc + c * N);
}

// C (na × cols, cols a multiple of N, row stride ldc) += Σ_x A(x, a) · B[x][·].
void Outer(DF d, const float* A, int64_t sx, int64_t sa, const float* B, size_t sb, size_t nx, size_t na, size_t cols,
           float* C, size_t ldc) {
  const size_t N = hn::Lanes(d);
  for (size_t c0 = 0; c0 < cols; c0 += kOuterVecs * N) {
    const size_t cv = std::min(kOuterVecs, (cols - c0) / N);
    for (size_t a0 = 0; a0 < na; a0 += kOuterRows) {
      const size_t ra = std::min(kOuterRows, na - a0);
      const float* Aa = A + static_cast<int64_t>(a0) * sa;
      float* Cc = C + a0 * ldc + c0;
      const float* Bc = B + c0;
#define MHA_OUTER(RA)                                                             \
  switch (cv) {                                                                  \
    case 1: OuterTile<RA, 1>(d, Aa, sx, sa, Bc, sb, nx, Cc, ldc); break;         \
    case 2: OuterTile<RA, 2>(d, Aa, sx, sa, Bc, sb, nx, Cc, ldc); break;         \
    case 3: OuterTile<RA, 3>(d, Aa, sx, sa, Bc, sb, nx, Cc, ldc); break;         \
    default: OuterTile<RA, kOuterVecs>(d, Aa, sx, sa, Bc, sb, nx, Cc, ldc); break; \
  }
      switch (ra) {
        case 1: MHA_OUTER(1); break;
        case 2: MHA_OUTER(2); break;
#if HWY_TARGET <= HWY_AVX3
        case 3: MHA_OUTER(3); break;
        case 4: MHA_OUTER(4); break;
        case 5: MHA_OUTER(5); break;
#endif
        default: MHA_OUTER(kOuterRows); break;
      }
#undef MHA_OUTER
    }
  }
}

// Rows of the task as a row-major (mpad × ld) float32 tile, zero past `width` and for invalid
// rows (src of element type T, widened).
template <typename T>
void PackRows(const TaskRows& t, const T* src, const Strides4& st, int64_t width, size_t ld, float* dst) {
  for (size_t r = 0; r < t.mpad; ++r) {
    float* out = dst + r * ld;
    std::fill(out, out + ld, 0.0f);
    if (!t.valid[r]) continue;
    RowToFloat(src + t.b * st[0] + t.head[r] * st[1] + t.query[r] * st[2], st[3], static_cast<size_t>(width), out);
  }
}

size_t RoundUp(size_t x, size_t n) { return (x + n - 1) / n * n; }

// Σ a[c]·b[c] in double: each product is exact, the sum in vector lanes (a serial sum of one
// add per element was ~8% of a bfloat16 backward at T = 256).
double DotDouble(const float* a, const float* b, size_t n) {
#if HWY_HAVE_FLOAT64
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const size_t N = hn::Lanes(dd);
  auto acc = hn::Zero(dd);
  size_t c = 0;
  for (; c + N <= n; c += N) {
    acc = hn::MulAdd(hn::PromoteTo(dd, hn::LoadU(df, a + c)), hn::PromoteTo(dd, hn::LoadU(df, b + c)), acc);
  }
  double sum = hn::GetLane(hn::SumOfLanes(dd, acc));
#else
  double sum = 0;
  size_t c = 0;
#endif
  for (; c < n; ++c) sum += static_cast<double>(a[c]) * b[c];
  return sum;
}

// Key 0 of task row r's row in g.grad_scores (B, Hq, Tq, Tk).
float* ScoreGradRow(const AttentionGradParams& g, const TaskRows& t, size_t r) {
  const Strides4& s = g.grad_scores_stride;
  return g.grad_scores + t.b * s[0] + t.head[r] * s[1] + t.query[r] * s[2];
}

// A block's bias gradient sg (keys × rows, rows in the lanes) into the (B, Hq, Tq, Tk) rows of
// g.grad_scores: N keys × N rows transposed at a time when its keys are dense, else one by one.
// Each (row, key) belongs to one task and one block, so each is written once.
void WriteScoreGrads(DF d, const AttentionParams& p, const AttentionGradParams& g, const TaskRows& t,
                     const KeyBlock& k, const float* sg) {
  const size_t N = hn::Lanes(d), M = t.mpad;
  const int64_t jn = std::min(k.n, p.kv_len - k.a);
  const Strides4& s = g.grad_scores_stride;
  if (s[3] != 1) {
    for (size_t r = 0; r < M; ++r) {
      if (!t.valid[r]) continue;
      float* dst = ScoreGradRow(g, t, r) + k.a * s[3];
      for (int64_t j = 0; j < jn; ++j) dst[j * s[3]] = sg[j * M + r];
    }
    return;
  }
  static constexpr float kZeros[hn::MaxLanes(DF())] = {};
  const float* keys[hn::MaxLanes(DF())];
  HWY_ALIGN float block[hn::MaxLanes(DF()) * hn::MaxLanes(DF())];
  for (size_t rv = 0; rv < t.nvec; ++rv) {
    for (int64_t c0 = 0; c0 < jn; c0 += static_cast<int64_t>(N)) {
      const size_t nk = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(N), jn - c0));
      for (size_t x = 0; x < N; ++x) keys[x] = x < nk ? sg + (c0 + static_cast<int64_t>(x)) * M + rv * N : kZeros;
      Transpose(d, keys, N, block, N, 1.0f);  // block[c · N + x]: key c0 + x of row rv · N + c
      for (size_t c = 0; c < N; ++c) {
        const size_t r = rv * N + c;
        if (!t.valid[r]) continue;
        float* dst = ScoreGradRow(g, t, r) + k.a + c0;
        std::copy(block + c * N, block + c * N + nk, dst);
      }
    }
  }
}

// Zeros into g.grad_scores for keys [a, a + n) of the task's rows: the (row, key) pairs that no
// block computes (skipped blocks, keys of a block outside its rows' ranges). With these and
// WriteScoreGrads every element is written once, and the caller zeroes nothing beforehand.
void ZeroScoreGrads(const AttentionGradParams& g, const TaskRows& t, int64_t a, int64_t n) {
  const Strides4& s = g.grad_scores_stride;
  for (size_t r = 0; r < t.mpad && n > 0; ++r) {
    if (!t.valid[r]) continue;
    float* dst = ScoreGradRow(g, t, r) + a * s[3];
    for (int64_t j = 0; j < n; ++j) dst[j * s[3]] = 0.0f;
  }
}

// T: the element type of q, k, v, out, dO and the gradients. 16-bit ones are widened as they are
// read (K and V a block at a time, into float32 scratch) and the gradients rounded once; or, for
// bfloat16 with `tiles`, the five block products are tile products.
template <typename T>
void BackwardTask(const AttentionParams& p, const AttentionGradParams& g, const FlashPlan& plan, int64_t b,
                  int64_t hk, bool tiles) {
  constexpr bool kWide = std::is_same_v<T, float>;
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t G = p.group(), Tq = p.q_len;
  const size_t D = static_cast<size_t>(p.head_dim_qk), Dv = static_cast<size_t>(p.head_dim_v);
  const size_t Dp = RoundUp(D, N), Dvp = RoundUp(Dv, N);
  Workspace& ws = Workspace::local();
  const size_t mmax = RoundUp(static_cast<size_t>(plan.rows), N);
  std::optional<AmxGrads> amx;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (tiles) amx.emplace(p, g, mmax, ws);
  }
  float* st = ws.get<float>(Workspace::kScores, kKeyBlock * mmax);  // scores, then P, then dS
  float* dpt = ws.get<float>(Workspace::kBwdGradP, kKeyBlock * mmax);  // dP
  float* pdt = ws.get<float>(Workspace::kBwdDroppedP, kKeyBlock * mmax);  // P with dropout (for dV)
  float* kblk = amx ? nullptr : ws.get<float>(Workspace::kBwdKeyBlock, kKeyBlock * Dp);
  float* dk = ws.get<float>(Workspace::kBwdDkBlock, kKeyBlock * Dp);
  float* dv = ws.get<float>(Workspace::kBwdDvBlock, kKeyBlock * Dvp);
  const size_t q_blocks = static_cast<size_t>(plan.q_blocks);
  // dQ of the task's rows, or with the tiles, of each query block transposed (D × mmax).
  const size_t dq_floats = amx ? q_blocks * D * mmax : static_cast<size_t>(G * Tq) * Dp;
  float* dq = ws.get<float>(amx ? Workspace::kAmxBwdDqT : Workspace::kBwdDqGroup, dq_floats);
  float* lse = ws.get<float>(Workspace::kBwdLse, static_cast<size_t>(G * Tq));
  float* drow = ws.get<float>(Workspace::kBwdRowDot, static_cast<size_t>(G * Tq));
  float* rowvec = ws.get<float>(Workspace::kBwdRowStats, 2 * mmax);  // per q block: lse and D of its rows
  // K and V blocks are read once per query block: from a float32 copy (kblk, vstage) when they
  // are 16-bit or their rows are not adjacent ((B, T, H, D) layouts: every row on its own page, a
  // TLB miss per row and query block; ~10% of the backward's time at T = 2048).
  const bool stage_k = !amx && (!kWide || p.k_stride[3] != 1 || p.k_stride[2] != p.head_dim_qk);
  const bool stage_v = !amx && (!kWide || p.v_stride[3] != 1 || p.v_stride[2] != p.head_dim_v);
  float* vstage = stage_v ? ws.get<float>(Workspace::kValueStage, kKeyBlock * std::max<size_t>(Dv, 1)) : nullptr;
  float* qstage = kWide || amx ? nullptr : ws.get<float>(Workspace::kQueryStage, mmax * D);
  float* capgrad = p.softcap > 0 ? ws.get<float>(Workspace::kBwdSoftcapGrad, kKeyBlock * mmax) : nullptr;
  // The bias's gradient: dS before the softcap's factor (st itself when there is none).
  float* score_grad = g.grad_scores && capgrad ? ws.get<float>(Workspace::kBwdScoreGrad, kKeyBlock * mmax) : st;
  float* dostage =
      kWide || amx ? nullptr : ws.get<float>(Workspace::kBwdGradOutStage, mmax * std::max<size_t>(Dv, 1));
  std::fill(dq, dq + dq_floats, 0.0f);
  // Each query block's Q and dO in both layouts: Q transposed and scaled (qt), dO transposed
  // (dot), Q and dO as padded rows (qrows, dorows). Packed on the block's first key block and
  // kept for the others where all blocks fit backward_pack_limit(); else one block's room,
  // packed again for every key block (they were ~11% of a training step at T = 256 so). The
  // tiles pack their own operands (AmxGrads::Pack), in as many 4-byte words.
  const size_t packed_floats =
      amx ? AmxGrads::PackedWords(p, mmax) : (std::max<size_t>(D, 1) + std::max<size_t>(Dv, 1) + Dp + Dvp) * mmax;
  const bool keep_packed = q_blocks <= backward_pack_limit() / sizeof(float) / packed_floats;  // no product to wrap
  float* packed = ws.get<float>(Workspace::kBwdPacked, (keep_packed ? q_blocks : 1) * packed_floats);
  uint8_t* is_packed = ws.get<uint8_t>(Workspace::kBwdPackedBlocks, q_blocks);
  std::fill(is_packed, is_packed + q_blocks, 0);

  // Per row of the task: the forward's LSE and D = rowsum(dO ⊙ O), summed in double (DotDouble).
  float* rows = ws.get<float>(Workspace::kBwdRowScratch, 2 * std::max(Dv, D));  // a row or two as float32
  for (int64_t gg = 0; gg < G; ++gg) {
    const int64_t h = hk * G + gg;
    for (int64_t i = 0; i < Tq; ++i) {
      const T* o = static_cast<const T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
      const T* go = static_cast<const T*>(g.grad_out) + b * g.grad_out_stride[0] + h * g.grad_out_stride[1] +
                    i * g.grad_out_stride[2];
      RowToFloat(o, p.out_stride[3], Dv, rows);
      RowToFloat(go, g.grad_out_stride[3], Dv, rows + Dv);
      drow[gg * Tq + i] = static_cast<float>(DotDouble(rows, rows + Dv, Dv));
      const float l = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
      lse[gg * Tq + i] = l == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : l;
    }
  }

  const T* kbase = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* vbase = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  // K and V rows as the tiles take them (bfloat16 only; they run for no other T).
  auto tile_rows = [](const T* x) -> const bfloat16* {
    if constexpr (std::is_same_v<T, bfloat16>) return x;
    return nullptr;
  };
  const T* qsrc = static_cast<const T*>(p.q);
  const T* dosrc = static_cast<const T*>(g.grad_out);
  const Dropout drop(p.dropout_p, p.dropout_seed);
  const auto log2e = hn::Set(d, kLog2e);

  for (int64_t jb = 0; jb < p.kv_len; jb += kKeyBlock) {
    const size_t nk = static_cast<size_t>(std::min(kKeyBlock, p.kv_len - jb));
    std::fill(dk, dk + kKeyBlock * Dp, 0.0f);
    std::fill(dv, dv + kKeyBlock * Dvp, 0.0f);
    if (amx) amx->PackKeys(tile_rows(kbase + jb * p.k_stride[2]), p.k_stride[2], nk);  // for the dQ product
    for (size_t j = 0; j < nk && !amx; ++j) {  // K rows of the block, padded: the dQ product loads them
      float* kr = kblk + j * Dp;
      RowToFloat(kbase + (jb + static_cast<int64_t>(j)) * p.k_stride[2], p.k_stride[3], D, kr);
      std::fill(kr + D, kr + Dp, 0.0f);
    }
    if (stage_v) {  // V rows of the block as float32 rows of Dv (K's are in kblk)
      StageRows(vbase + jb * p.v_stride[2], p.v_stride[2], p.v_stride[3], 0, static_cast<int64_t>(nk),
                static_cast<int64_t>(nk) - 1, p.head_dim_v, vstage);
    }
    bool touched = false;
    for (int64_t qb = 0; qb < plan.q_blocks; ++qb) {
      const TaskRows t = MakeRows(p, plan, b, hk, qb, N, ws);
      const int64_t block_end = jb + static_cast<int64_t>(nk);
      if (t.keys.hi <= jb || t.keys.lo >= jb + kKeyBlock || t.keys.hi <= t.keys.lo) {
        if (g.grad_scores) ZeroScoreGrads(g, t, jb, block_end - jb);
        continue;
      }
      const KeyBlock k = MakeBlock(p, t, jb);
      if (k.kind == BlockKind::kSkip) {
        if (g.grad_scores) ZeroScoreGrads(g, t, jb, block_end - jb);
        continue;
      }
      if (g.grad_scores) {  // the keys before and after those WriteScoreGrads writes
        const int64_t written_end = k.a + std::min(k.n, p.kv_len - k.a);
        ZeroScoreGrads(g, t, jb, k.a - jb);
        ZeroScoreGrads(g, t, written_end, block_end - written_end);
      }
      touched = true;
      const size_t M = t.mpad;
      float* qt = packed + (keep_packed ? static_cast<size_t>(qb) : 0) * packed_floats;
      float* dot = qt + std::max<size_t>(D, 1) * mmax;
      float* qrows = dot + std::max<size_t>(Dv, 1) * mmax;
      float* dorows = qrows + Dp * mmax;
      uint32_t* words = reinterpret_cast<uint32_t*>(qt);  // the tiles' packing
      if (!is_packed[qb] && amx) {
        amx->Pack(t, words);
        is_packed[qb] = keep_packed;
      } else if (!is_packed[qb]) {
        PackTransposed(d, t, qsrc, p.q_stride, p.head_dim_qk, p.scale, qt, qstage);
        PackTransposed(d, t, dosrc, g.grad_out_stride, p.head_dim_v, 1.0f, dot, dostage);
        PackRows(t, qsrc, p.q_stride, p.head_dim_qk, Dp, qrows);
        PackRows(t, dosrc, g.grad_out_stride, p.head_dim_v, Dvp, dorows);
        is_packed[qb] = keep_packed;
      }
      float* lse_r = rowvec;
      float* d_r = rowvec + M;
      for (size_t r = 0; r < M; ++r) {
        const int64_t idx = t.valid[r] ? (t.head[r] - hk * G) * Tq + t.query[r] : 0;
        lse_r[r] = t.valid[r] ? lse[idx] : std::numeric_limits<float>::infinity();
        d_r[r] = t.valid[r] ? drow[idx] : 0.0f;
      }

      // S and P, exactly as the forward's weights pass.
      const int64_t kb = k.a - jb;  // the block's first key in kblk / vstage
      if (amx) {
        amx->Scores(t, words, tile_rows(kbase), p.k_stride[2], k.a, k.n, p.kv_len - 1, st);
      } else if (stage_k) {
        ScoresBlock<true>(d, qt, M, t.nvec, kblk, static_cast<int64_t>(Dp), 1, kb, k.n, static_cast<int64_t>(nk), D, st);
      } else if constexpr (kWide) {  // contiguous float32 rows, read in place
        ScoresBlock<true>(d, qt, M, t.nvec, kbase, p.k_stride[2], 1, k.a, k.n, p.kv_len, D, st);
      }
      if (p.softcap > 0) SoftcapBlock(d, p.softcap, k.n, M, st, capgrad);
      if (NeedsMask(p, k)) MaskBlock(d, p, t, k, st);
      // dP = V · dOᵀ for the same keys (rows of V past Tk read the last row; their P is 0).
      if (amx) {
        amx->GradP(t, words, tile_rows(vbase), p.v_stride[2], k.a, k.n, p.kv_len - 1, dpt);
      } else if (stage_v) {
        ScoresBlock<true>(d, dot, M, t.nvec, vstage, p.head_dim_v, 1, kb, k.n, static_cast<int64_t>(nk), Dv, dpt);
      } else if constexpr (kWide) {
        ScoresBlock<true>(d, dot, M, t.nvec, vbase, p.v_stride[2], 1, k.a, k.n, p.kv_len, Dv, dpt);
      }
      for (int64_t j = 0; j < k.n; ++j)
        for (size_t rv = 0; rv < t.nvec; ++rv) {
          float* s = st + j * M + rv * N;
          const auto x = hn::Load(d, s);
          const auto pr = hn::IfThenZeroElse(hn::Eq(x, hn::Set(d, kNegInf)),
                                             Exp2(d, hn::Mul(hn::Sub(x, hn::Load(d, lse_r + rv * N)), log2e)));
          hn::Store(pr, d, s);
        }
      // Dropout: P_d = P ⊙ Z/(1-p) for dV, dP = dP_d ⊙ Z/(1-p).
      std::copy(st, st + k.n * M, pdt);
      if (drop.active()) {
        DropBlock(p, drop, t, k, pdt, dpt);
      }
      // dS = P ⊙ (dP - D), zero where P is 0 (masked keys never touch K or V).
      for (int64_t j = 0; j < k.n; ++j)
        for (size_t rv = 0; rv < t.nvec; ++rv) {
          float* s = st + j * M + rv * N;
          const auto pr = hn::Load(d, s);
          const auto unused = hn::Eq(pr, hn::Zero(d));
          auto ds = hn::Mul(pr, hn::Sub(hn::Load(d, dpt + j * M + rv * N), hn::Load(d, d_r + rv * N)));
          if (capgrad) {
            if (g.grad_scores) hn::Store(hn::IfThenZeroElse(unused, ds), d, score_grad + j * M + rv * N);
            ds = hn::Mul(ds, hn::Load(d, capgrad + j * M + rv * N));
          }
          hn::Store(hn::IfThenZeroElse(unused, ds), d, s);
        }
      if (g.grad_scores) WriteScoreGrads(d, p, g, t, k, score_grad);
      const size_t nv = static_cast<size_t>(k.nv), koff = static_cast<size_t>(k.a - jb);
      if (amx) {
        amx->Products(t, words, pdt, st, koff, nv, dv, dk, dq + static_cast<size_t>(qb) * D * mmax);
        continue;
      }
      // dV[j] += Σ_r P_d[j][r] · dO[r];  dK[j] += Σ_r dS[j][r] · Q[r]   (x = r, a = j)
      Outer(d, pdt, 1, static_cast<int64_t>(M), dorows, Dvp, M, nv, Dvp, dv + koff * Dvp, Dvp);
      Outer(d, st, 1, static_cast<int64_t>(M), qrows, Dp, M, nv, Dp, dk + koff * Dp, Dp);
      // dQ[r] += Σ_j dS[j][r] · K[j]   (x = j, a = r), into the task's dQ rows.
      float* dq_blk = ws.get<float>(Workspace::kBwdDq, M * Dp);
      std::fill(dq_blk, dq_blk + M * Dp, 0.0f);
      Outer(d, st, static_cast<int64_t>(M), 1, kblk + koff * Dp, Dp, nv, M, Dp, dq_blk, Dp);
      for (size_t r = 0; r < M; ++r) {
        if (!t.valid[r]) continue;
        float* dst = dq + static_cast<size_t>((t.head[r] - hk * G) * Tq + t.query[r]) * Dp;
        for (size_t c = 0; c < D; ++c) dst[c] += dq_blk[r * Dp + c];
      }
    }
    // dK = scale · dSᵀQ, dV: every key of the block is written (zeros if no row saw it: dk and dv
    // as filled, with a factor 1 so that a negative scale gives no -0).
    for (size_t j = 0; j < nk; ++j) {
      const int64_t key = jb + static_cast<int64_t>(j);
      T* gk = static_cast<T*>(g.grad_k) + b * g.grad_k_stride[0] + hk * g.grad_k_stride[1] + key * g.grad_k_stride[2];
      T* gv = static_cast<T*>(g.grad_v) + b * g.grad_v_stride[0] + hk * g.grad_v_stride[1] + key * g.grad_v_stride[2];
      RowFromFloat(dk + j * Dp, touched ? p.scale : 1.0f, D, gk, g.grad_k_stride[3]);
      RowFromFloat(dv + j * Dvp, 1.0f, Dv, gv, g.grad_v_stride[3]);
    }
  }
  for (int64_t qb = 0; qb < plan.q_blocks && amx; ++qb) {  // dQ from the tiles' dQᵀ of each query block
    const TaskRows t = MakeRows(p, plan, b, hk, qb, N, ws);
    const float* src = dq + static_cast<size_t>(qb) * D * mmax;
    for (size_t r = 0; r < t.mpad; ++r) {
      if (!t.valid[r]) continue;
      T* gq = static_cast<T*>(g.grad_q) + b * g.grad_q_stride[0] + t.head[r] * g.grad_q_stride[1] +
              t.query[r] * g.grad_q_stride[2];
      for (size_t c = 0; c < D; ++c) rows[c] = src[c * t.mpad + r];
      RowFromFloat(rows, p.scale, D, gq, g.grad_q_stride[3]);
    }
  }
  for (int64_t gg = 0; gg < G && !amx; ++gg) {
    const int64_t h = hk * G + gg;
    for (int64_t i = 0; i < Tq; ++i) {
      T* gq = static_cast<T*>(g.grad_q) + b * g.grad_q_stride[0] + h * g.grad_q_stride[1] + i * g.grad_q_stride[2];
      RowFromFloat(dq + static_cast<size_t>(gg * Tq + i) * Dp, p.scale, D, gq, g.grad_q_stride[3]);
    }
  }
}

}  // namespace

void FlashBackward(const AttentionParams& p, const AttentionGradParams& g, int num_threads) {
  // The tiles where they apply and every argument is finite (AmxGrads::Finite; a pass over Q, K,
  // V and dO, a few percent of the backward's time), so that a call gives the float32 tiles' bits
  // or the tiles' whatever its thread count.
  bool tiles = AmxGrads::Applies(p);
  if (tiles) {
    std::atomic<bool> finite{true};
    parallel_for(p.batch * p.kv_heads, num_threads, [&](int64_t t) {
      if (finite.load(std::memory_order_relaxed) && !AmxGrads::Finite(p, g, t / p.kv_heads, t % p.kv_heads)) {
        finite.store(false, std::memory_order_relaxed);
      }
    });
    tiles = finite.load();
  }
  const FlashPlan plan = make_flash_plan(p, tiles ? kAmxRows : kTargetRows, kKeyBlock);
  auto run = [&](auto task) {
    parallel_for(p.batch * p.kv_heads, num_threads,
                 [&](int64_t t) { task(p, g, plan, t / p.kv_heads, t % p.kv_heads, tiles); });
  };
  switch (p.dtype) {
    case DType::kBF16: run(BackwardTask<bfloat16>); break;
    case DType::kF16: run(BackwardTask<float16>); break;
    default: run(BackwardTask<float>); break;
  }
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {

HWY_EXPORT(FlashBackward);

void flash_backward(const AttentionParams& p, const AttentionGradParams& g, int num_threads) {
  HWY_DYNAMIC_DISPATCH(FlashBackward)(p, g, num_threads);
}

}  // namespace mha::kernels
#endif  // HWY_ONCE
