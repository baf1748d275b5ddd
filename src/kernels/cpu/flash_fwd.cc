// The fast attention forward (FlashAttention-2 style) for float32, bfloat16 and float16 inputs
// (computing in float32), compiled for each SIMD target Highway knows (AVX-512, AVX2, portable)
// and chosen once per call.
//
// For each task (b, kv head, query block; see flash_plan.h) and each key block j0..j0+Bk:
//   St = K_blk · Qtᵀ-tile              scores (Q pre-scaled by scale)
//   St += bias; masked → -inf          only for blocks that need it (see MakeBlock)
//   m' = max(m, max_j St);  α = 2^((m - m')·log2 e);  P = 2^((St - m')·log2 e);  l = α·l + Σ_j P
//   P ·= dropout keep / (1 - p)        (l stays undropped)
//   Ot = α·Ot + Vᵀ_blk · P
// and at the end out = Ot / l, lse = m + ln l (Dao et al., FlashAttention-2, 2023,
// Algorithm 1; the layout with query rows in the SIMD lanes follows gemma.cpp). A row that saw
// no key has l = 0: its output is 0 and its LSE -inf. Memory: O((D + Dv + Bk) · rows) per thread.
// For bfloat16 where the CPU has AMX, the two block products are tile products (flash_amx-inl.h),
// and a thread keeps a kv head's values packed for them, up to forward_value_keep_limit().
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_fwd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/exp2-inl.h"
#include "kernels/cpu/flash_amx-inl.h"
#include "kernels/cpu/flash_blocks-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/flash_plan.h"
#include "kernels/cpu/tiles-inl.h"
#include "kernels/dropout.h"
#include "kernels/ref/attention_ref.h"
#include "kernels/workspace.h"
#include "util/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

using namespace flash;  // NOLINT(build/namespaces): the shared block helpers

template <size_t CR, bool kUnit>
void PvColumns(DF d, const float* st, size_t ldq, size_t nvec, const float* v, int64_t vs, int64_t vd, size_t jn,
               const float* alpha, float* ot) {
  const size_t N = hn::Lanes(d);
  for (size_t rv = 0; rv < nvec; rv += kRowVecs) {
    switch (std::min(kRowVecs, nvec - rv)) {
      case 1: PvTile<CR, 1, kUnit>(d, st + rv * N, ldq, v, vs, vd, jn, alpha + rv * N, ot + rv * N, ldq); break;
      case 2: PvTile<CR, 2, kUnit>(d, st + rv * N, ldq, v, vs, vd, jn, alpha + rv * N, ot + rv * N, ldq); break;
      default: PvTile<CR, 3, kUnit>(d, st + rv * N, ldq, v, vs, vd, jn, alpha + rv * N, ot + rv * N, ldq); break;
    }
  }
}

// Ot = α·Ot + Vᵀ_blk · P for all Dv columns, kPvCols at a time.
template <bool kUnit>
void OutputBlock(DF d, const float* st, size_t ldq, size_t nvec, const float* v, int64_t vs, int64_t vd,
                 size_t jn, size_t dv, const float* alpha, float* ot) {
  for (size_t c = 0; c < dv; c += kPvCols) {
    const float* vc = v + static_cast<int64_t>(c) * vd;
    float* oc = ot + c * ldq;
    switch (std::min(kPvCols, dv - c)) {
      case 1: PvColumns<1, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
      case 2: PvColumns<2, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
      case 3: PvColumns<3, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
#if HWY_TARGET <= HWY_AVX3
      case 4: PvColumns<4, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
      case 5: PvColumns<5, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
      case 6: PvColumns<6, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
      case 7: PvColumns<7, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
#endif
      default: PvColumns<kPvCols, kUnit>(d, st, ldq, nvec, vc, vs, vd, jn, alpha, oc); break;
    }
  }
}

// out[row r][c] = Ot[c][r] · inv[r] for the valid rows, N×N blocks through a transpose, rounded
// to T. Sets nonfinite[r] for rows with a NaN or infinity in their (float32) output.
template <typename T>
void WriteRows(DF d, const AttentionParams& p, const TaskRows& t, const float* ot, const float* inv,
               uint8_t* nonfinite) {
  const size_t N = hn::Lanes(d), M = t.mpad, Dv = static_cast<size_t>(p.head_dim_v);
  auto out_row = [&](size_t r) {
    return static_cast<T*>(p.out) + t.b * p.out_stride[0] + t.head[r] * p.out_stride[1] + t.query[r] * p.out_stride[2];
  };
  std::fill(nonfinite, nonfinite + M, 0);
  if (p.out_stride[3] != 1) {
    for (size_t r = 0; r < M; ++r) {
      if (!t.valid[r]) continue;
      for (size_t cc = 0; cc < Dv; ++cc) {
        const float x = ot[cc * M + r] * inv[r];
        store_element(out_row(r), static_cast<int64_t>(cc) * p.out_stride[3], x, p.dtype);
        nonfinite[r] |= !std::isfinite(x);
      }
    }
    return;
  }
  HWY_ALIGN static const float kZeros[hn::MaxLanes(DF())] = {};
  HWY_ALIGN float tmp[hn::MaxLanes(DF()) * hn::MaxLanes(DF())];
  const float* cols[hn::MaxLanes(DF())];
  for (size_t r0 = 0; r0 < M; r0 += N) {
    for (size_t c0 = 0; c0 < Dv; c0 += N) {
      const size_t nc = std::min(N, Dv - c0);
      for (size_t x = 0; x < N; ++x) cols[x] = x < nc ? ot + (c0 + x) * M + r0 : kZeros;
      Transpose(d, cols, N, tmp, N, 1.0f);  // tmp[r·N + x] = Ot[c0 + x][r0 + r]
      for (size_t x = 0; x < N; ++x) {
        const size_t r = r0 + x;
        if (!t.valid[r]) continue;
        const auto v = hn::Mul(hn::Load(d, tmp + x * N), hn::Set(d, inv[r]));
        nonfinite[r] |= !hn::AllTrue(d, hn::IsFinite(v));
        StoreFromFloat(d, v, nc, out_row(r) + c0);
      }
    }
  }
}

// T: the element type of q, k, v and out. 16-bit keys and values are widened block by block
// into float32 scratch (kKeyStage, kValueStage: 64 rows each) and the float32 tiles run on it,
// or for bfloat16 with `tiles` (AmxBlocks::Applies), the block products are tile products; `call`
// numbers the forward call for the value blocks a thread keeps (ThreadValues).
template <typename T>
void ForwardTask(const AttentionParams& p, const FlashPlan& plan, int64_t task, float* row_lse,
                 bool tiles, uint64_t call) {
  constexpr bool kWide = std::is_same_v<T, float>;
  const DF d;
  const size_t N = hn::Lanes(d);
  const TaskCoords c = task_coords(p, plan, task);
  Workspace& ws = Workspace::local();
  const TaskRows t = MakeRows(p, plan, c.b, c.hk, c.qb, N, ws);
  const size_t M = t.mpad, D = static_cast<size_t>(p.head_dim_qk), Dv = static_cast<size_t>(p.head_dim_v);
  float* st = ws.get<float>(Workspace::kScores, kKeyBlock * M);
  float* ot = ws.get<float>(Workspace::kOutT, std::max<size_t>(Dv, 1) * M);
  float* m = ws.get<float>(Workspace::kRowMax, M);
  float* l = ws.get<float>(Workspace::kRowSum, M);
  float* alpha = ws.get<float>(Workspace::kRescale, M);
  std::optional<AmxBlocks> amx;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (tiles) amx.emplace(p, t, ws);
  }
  std::optional<ThreadValues> values;
  if (tiles) values.emplace(p, call, c.b * p.kv_heads + c.hk, ws);
  float* qt = amx ? nullptr : ws.get<float>(Workspace::kQueryT, D * M);  // the tiles pack their own
  if (!amx) PackQueries<T>(d, p, t, qt, ws);
  float* kstage = kWide || amx ? nullptr : ws.get<float>(Workspace::kKeyStage, kKeyBlock * D);
  float* vstage = kWide || amx ? nullptr : ws.get<float>(Workspace::kValueStage, kKeyBlock * std::max<size_t>(Dv, 1));
  std::fill(ot, ot + Dv * M, 0.0f);
  std::fill(m, m + M, kNegInf);
  std::fill(l, l + M, 0.0f);

  const T* kbase = static_cast<const T*>(p.k) + c.b * p.k_stride[0] + c.hk * p.k_stride[1];
  const T* vbase = static_cast<const T*>(p.v) + c.b * p.v_stride[0] + c.hk * p.v_stride[1];
  const bool k_unit = p.k_stride[3] == 1, v_unit = p.v_stride[3] == 1;
  const Dropout drop(p.dropout_p, p.dropout_seed);

  // Long rows: Ot and l are float running sums, and a float sum of 2^24 terms of 1.0 stops
  // growing. Every kSpillBlocks key blocks they are folded into a second level (rescaled to the
  // current max) and restarted, so no float sum takes more than kSpillBlocks·kKeyBlock terms.
  // Rows of fewer keys never spill: their bits are those of the one-level loop.
  float *ot_spill = nullptr, *l_spill = nullptr, *m_spill = nullptr;
  int64_t blocks_since_spill = 0;
  auto spill = [&] {
    if (!ot_spill) {
      ot_spill = ws.get<float>(Workspace::kOutSpill, std::max<size_t>(Dv, 1) * M);
      l_spill = ws.get<float>(Workspace::kRowSumSpill, M);
      m_spill = ws.get<float>(Workspace::kRowMaxSpill, M);
      std::fill(ot_spill, ot_spill + Dv * M, 0.0f);
      std::fill(l_spill, l_spill + M, 0.0f);
      std::fill(m_spill, m_spill + M, kNegInf);
    }
    for (size_t r = 0; r < M; ++r) {
      if (m[r] == kNegInf) continue;  // nothing visible so far: both levels are zero
      const float f = m_spill[r] == kNegInf ? 0.0f : std::exp2((m_spill[r] - m[r]) * kLog2e);
      for (size_t c = 0; c < Dv; ++c) {
        ot_spill[c * M + r] = ot_spill[c * M + r] * f + ot[c * M + r];
        ot[c * M + r] = 0.0f;
      }
      l_spill[r] = l_spill[r] * f + l[r];
      l[r] = 0.0f;
      m_spill[r] = m[r];
    }
    blocks_since_spill = 0;
  };

  // Rows of K and V that are not adjacent in memory are prefetched: this block's V (read after
  // the softmax) and the next block's K.
  const bool prefetch_k = k_unit && p.k_stride[2] != p.head_dim_qk, prefetch_v = v_unit && p.v_stride[2] != p.head_dim_v;
  if (prefetch_k && t.keys.lo < t.keys.hi) {
    const int64_t j0 = t.keys.lo / kKeyBlock * kKeyBlock;
    PrefetchRows(kbase, p.k_stride[2], j0, std::min(kKeyBlock, t.keys.hi - j0), p.kv_len - 1, p.head_dim_qk);
  }
  for (int64_t jb = t.keys.lo / kKeyBlock * kKeyBlock; jb < t.keys.hi; jb += kKeyBlock) {
    const KeyBlock k = MakeBlock(p, t, jb);
    if (k.kind == BlockKind::kSkip) continue;
    if (prefetch_v) PrefetchRows(vbase, p.v_stride[2], k.a, k.nv, p.kv_len - 1, p.head_dim_v);
    if (prefetch_k && jb + kKeyBlock < t.keys.hi) {
      PrefetchRows(kbase, p.k_stride[2], jb + kKeyBlock, std::min(kKeyBlock, t.keys.hi - jb - kKeyBlock),
                   p.kv_len - 1, p.head_dim_qk);
    }
    if (amx) {
      if constexpr (std::is_same_v<T, bfloat16>) amx->Scores(kbase, p.k_stride[2], k.a, k.n, p.kv_len - 1, p.scale, st);
    } else if constexpr (!kWide) {
      StageRows(kbase, p.k_stride[2], p.k_stride[3], k.a, k.n, p.kv_len - 1, p.head_dim_qk, kstage);
      ScoresBlock<true>(d, qt, M, t.nvec, kstage, p.head_dim_qk, 1, 0, k.n, k.n, D, st);
    } else if (k_unit) {
      ScoresBlock<true>(d, qt, M, t.nvec, kbase, p.k_stride[2], 1, k.a, k.n, p.kv_len, D, st);
    } else {
      ScoresBlock<false>(d, qt, M, t.nvec, kbase, p.k_stride[2], p.k_stride[3], k.a, k.n, p.kv_len, D, st);
    }
    if (p.softcap > 0) SoftcapBlock(d, p.softcap, k.n, M, st, nullptr);
    if (NeedsMask(p, k)) MaskBlock(d, p, t, k, st);

    // Online softmax, one vector of rows at a time; four partial maxima and sums per vector
    // keep the dependency chains short (k.n is a multiple of 4).
    for (size_t rv = 0; rv < t.nvec; ++rv) {
      const auto m_old = hn::Load(d, m + rv * N);
      auto mx0 = m_old, mx1 = m_old, mx2 = m_old, mx3 = m_old;
      for (int64_t j = 0; j < k.n; j += 4) {
        const float* s = st + j * M + rv * N;
        mx0 = hn::Max(mx0, hn::Load(d, s));
        mx1 = hn::Max(mx1, hn::Load(d, s + M));
        mx2 = hn::Max(mx2, hn::Load(d, s + 2 * M));
        mx3 = hn::Max(mx3, hn::Load(d, s + 3 * M));
      }
      const auto mx = hn::Max(hn::Max(mx0, mx1), hn::Max(mx2, mx3));
      const auto none = hn::Eq(mx, hn::Set(d, kNegInf));  // nothing visible yet: keep O, P = 0
      const auto m_safe = hn::IfThenElse(none, hn::Zero(d), mx);
      const auto log2e = hn::Set(d, kLog2e);
      const auto a = hn::IfThenElse(none, hn::Set(d, 1.0f), Exp2(d, hn::Mul(hn::Sub(m_old, mx), log2e)));
      auto sum0 = hn::Zero(d), sum1 = hn::Zero(d), sum2 = hn::Zero(d), sum3 = hn::Zero(d);
      for (int64_t j = 0; j < k.n; j += 4) {
        float* s = st + j * M + rv * N;
        const auto e0 = Exp2(d, hn::Mul(hn::Sub(hn::Load(d, s), m_safe), log2e));
        const auto e1 = Exp2(d, hn::Mul(hn::Sub(hn::Load(d, s + M), m_safe), log2e));
        const auto e2 = Exp2(d, hn::Mul(hn::Sub(hn::Load(d, s + 2 * M), m_safe), log2e));
        const auto e3 = Exp2(d, hn::Mul(hn::Sub(hn::Load(d, s + 3 * M), m_safe), log2e));
        hn::Store(e0, d, s);
        hn::Store(e1, d, s + M);
        hn::Store(e2, d, s + 2 * M);
        hn::Store(e3, d, s + 3 * M);
        sum0 = hn::Add(sum0, e0);
        sum1 = hn::Add(sum1, e1);
        sum2 = hn::Add(sum2, e2);
        sum3 = hn::Add(sum3, e3);
      }
      const auto sum = hn::Add(hn::Add(sum0, sum1), hn::Add(sum2, sum3));
      hn::Store(hn::MulAdd(hn::Load(d, l + rv * N), a, sum), d, l + rv * N);
      hn::Store(mx, d, m + rv * N);
      hn::Store(a, d, alpha + rv * N);
    }
    if (drop.active()) DropBlock(p, drop, t, k, st);

    const size_t jn = static_cast<size_t>(k.nv);
    const T* vblk = vbase + k.a * p.v_stride[2];
    if (amx) {
      if constexpr (std::is_same_v<T, bfloat16>) {
        // A block the task sees whole is packed once per thread for all its tasks of the head.
        const uint16_t* vt = nullptr;
        if (k.a == jb && k.nv == std::min(kKeyBlock, p.kv_len - jb)) {
          auto pack = [&](uint16_t* words) { amx->PackValues(vblk, p.v_stride[2], k.nv, words); };
          vt = values->Block(jb / kKeyBlock, pack);
        }
        amx->Output(vblk, p.v_stride[2], k.nv, vt, st, alpha, ot);
      }
    } else if constexpr (!kWide) {
      StageRows(vblk, p.v_stride[2], p.v_stride[3], 0, k.nv, k.nv - 1, p.head_dim_v, vstage);
      OutputBlock<true>(d, st, M, t.nvec, vstage, p.head_dim_v, 1, jn, Dv, alpha, ot);
    } else if (v_unit) {
      OutputBlock<true>(d, st, M, t.nvec, vblk, p.v_stride[2], 1, jn, Dv, alpha, ot);
    } else {
      OutputBlock<false>(d, st, M, t.nvec, vblk, p.v_stride[2], p.v_stride[3], jn, Dv, alpha, ot);
    }
    if (++blocks_since_spill == kSpillBlocks) spill();
  }
  if (ot_spill) {  // fold the last partial run in, then read the second level
    spill();
    ot = ot_spill;
    l = l_spill;
  }

  // out = Ot / l; fully masked rows (l = 0) give zeros and LSE = -inf (with sinks: LSE = sink).
  float* inv = alpha;  // alpha is free now
  if (p.sinks) {
    FoldSinks(p, t, m, l, inv);
    for (size_t r = 0; r < M; ++r) inv[r] = l[r] == 0.0f ? 0.0f : inv[r] / l[r];
  } else {
    for (size_t r = 0; r < M; ++r) inv[r] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
  }
  uint8_t* nonfinite = ws.get<uint8_t>(Workspace::kNonfinite, M);
  WriteRows<T>(d, p, t, ot, inv, nonfinite);
  // A NaN or infinity in a value row is multiplied by P = 0 for the rows of the block that do
  // not see that key; recompute such rows so that it reaches exactly the rows attending to it.
  for (size_t r = 0; r < M; ++r)
    if (t.valid[r] && nonfinite[r]) attention_ref_output_row(p, c.b, t.head[r], t.query[r]);
  for (size_t r = 0; r < M; ++r) {
    if (!t.valid[r]) continue;
    const int64_t h = t.head[r], i = t.query[r];
    const float lse = l[r] == 0.0f ? kNegInf : m[r] + std::log(l[r]);
    if (p.lse) p.lse[c.b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = lse;
    if (row_lse) row_lse[(c.b * p.q_heads + h) * p.q_len + i] = lse;
  }
}

}  // namespace

void FlashForward(const AttentionParams& p, float* row_lse, int num_threads) {
  // Decided once per call: every task takes the same path, whatever the threads.
  const bool tiles = AmxBlocks::Applies(p);
  const FlashPlan plan = make_flash_plan(p, tiles ? kAmxRows : kTargetRows, kKeyBlock);
  const uint64_t call = tiles ? ThreadValues::NextCall() : 0;
  auto run = [&](auto task) {
    parallel_for(plan.tasks(), num_threads, [&](int64_t i) { task(p, plan, plan.order[i], row_lse, tiles, call); });
  };
  switch (p.dtype) {
    case DType::kBF16: run(ForwardTask<bfloat16>); break;
    case DType::kF16: run(ForwardTask<float16>); break;
    default: run(ForwardTask<float>); break;
  }
}

std::string FlashForwardName() {
  return std::string("flash_fwd_f32_") + hwy::TargetName(HWY_TARGET) + "_r" + std::to_string(kTargetRows) + "_k" +
         std::to_string(kKeyBlock);
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {

HWY_EXPORT(FlashForward);
HWY_EXPORT(FlashForwardName);

void flash_forward(const AttentionParams& p, float* row_lse, int num_threads) {
  HWY_DYNAMIC_DISPATCH(FlashForward)(p, row_lse, num_threads);
}

std::string flash_forward_name() { return HWY_DYNAMIC_DISPATCH(FlashForwardName)(); }

}  // namespace mha::kernels
#endif  // HWY_ONCE
