// The attention weights of the fast path, written in a second pass once the forward has the
// final log-sum-exp of every row: P = 2^((St - lse)·log2 e) block by block (the QKᵀ product again),
// masked and dropped exactly as in the forward. It costs one more QKᵀ and the weights' own
// memory, nothing O(T²) besides. Weights are float32 here for every input type. Averaged weights sum the heads in index order in one task,
// so they have the same bits for any thread count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/flash_weights.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cmath>
#include <limits>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/exp2-inl.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/flash_blocks-inl.h"
#include "kernels/cpu/flash_plan.h"
#include "util/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

using namespace flash;  // NOLINT(build/namespaces): the shared block helpers

float* WeightsRow(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  return p.weights + b * p.weights_stride[0] + h * p.weights_stride[1] + i * p.weights_stride[2];
}

// Probabilities of the rows of (b, hk, qb) for every key; `emit(row, j0, jn, st)` consumes a block.
template <typename T, class Emit>
void ProbabilityBlocks(const AttentionParams& p, const FlashPlan& plan, int64_t b, int64_t hk, int64_t qb,
                       const float* row_lse, const Emit& emit) {
  const DF d;
  const size_t N = hn::Lanes(d);
  Workspace& ws = Workspace::local();
  const TaskRows t = MakeRows(p, plan, b, hk, qb, N, ws);
  const size_t M = t.mpad, D = static_cast<size_t>(p.head_dim_qk);
  float* qt = ws.get<float>(Workspace::kQueryT, D * M);
  float* st = ws.get<float>(Workspace::kScores, kKeyBlock * M);
  float* shift = ws.get<float>(Workspace::kRowMax, M);
  PackQueries<T>(d, p, t, qt, ws);
  float* kstage = std::is_same_v<T, float> ? nullptr : ws.get<float>(Workspace::kKeyStage, kKeyBlock * D);
  for (size_t r = 0; r < M; ++r) {
    const float lse = t.valid[r] ? row_lse[(b * p.q_heads + t.head[r]) * p.q_len + t.query[r]] : kNegInf;
    shift[r] = lse == kNegInf ? std::numeric_limits<float>::infinity() : lse;  // fully masked: P = 0
  }
  const T* kbase = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const Dropout drop(p.dropout_p, p.dropout_seed);
  for (int64_t jb = t.keys.lo / kKeyBlock * kKeyBlock; jb < t.keys.hi; jb += kKeyBlock) {
    const KeyBlock k = MakeBlock(p, t, jb);
    if (k.kind == BlockKind::kSkip) continue;
    if constexpr (!std::is_same_v<T, float>) {
      StageRows(kbase, p.k_stride[2], p.k_stride[3], k.a, k.n, p.kv_len - 1, p.head_dim_qk, kstage);
      ScoresBlock<true>(d, qt, M, t.nvec, kstage, p.head_dim_qk, 1, 0, k.n, k.n, D, st);
    } else if (p.k_stride[3] == 1) {
      ScoresBlock<true>(d, qt, M, t.nvec, kbase, p.k_stride[2], 1, k.a, k.n, p.kv_len, D, st);
    } else {
      ScoresBlock<false>(d, qt, M, t.nvec, kbase, p.k_stride[2], p.k_stride[3], k.a, k.n, p.kv_len, D, st);
    }
    if (p.softcap > 0) SoftcapBlock(d, p.softcap, k.n, M, st, nullptr);
    if (NeedsMask(p, k)) MaskBlock(d, p, t, k, st);
    for (int64_t j = 0; j < k.n; ++j)
      for (size_t rv = 0; rv < t.nvec; ++rv) {
        float* s = st + j * M + rv * N;
        // Masked keys (-inf) are 0 even in a NaN row, where -inf - NaN would give NaN.
        const auto x = hn::Load(d, s);
        const auto e = Exp2(d, hn::Mul(hn::Sub(x, hn::Load(d, shift + rv * N)), hn::Set(d, kLog2e)));
        hn::Store(hn::IfThenZeroElse(hn::Eq(x, hn::Set(d, kNegInf)), e), d, s);
      }
    if (drop.active()) DropBlock(p, drop, t, k, st);
    for (int64_t r = 0; r < t.rows; ++r)
      if (t.valid[r]) emit(t, r, k.a, k.nv, st, M);
  }
}

template <typename T>
void PerHeadTask(const AttentionParams& p, const FlashPlan& plan, int64_t task, const float* row_lse) {
  const TaskCoords c = task_coords(p, plan, task);
  // Zero the task's rows first: skipped blocks and masked keys stay 0.
  const int64_t i0 = c.qb * plan.q_per_task, i1 = std::min(p.q_len, i0 + plan.q_per_task);
  for (int64_t g = 0; g < p.group(); ++g)
    for (int64_t i = i0; i < i1; ++i) {
      float* w = WeightsRow(p, c.b, c.hk * p.group() + g, i);
      for (int64_t j = 0; j < p.kv_len; ++j) w[j * p.weights_stride[3]] = 0.0f;
    }
  ProbabilityBlocks<T>(p, plan, c.b, c.hk, c.qb, row_lse,
                    [&](const TaskRows& t, int64_t r, int64_t j0, int64_t jn, const float* st, size_t M) {
                      float* w = WeightsRow(p, t.b, t.head[r], t.query[r]) + j0 * p.weights_stride[3];
                      for (int64_t j = 0; j < jn; ++j) w[j * p.weights_stride[3]] = st[j * M + r];
                    });
}

// Averaged weights: task (b, qb) visits every kv head in order and adds P / Hq.
template <typename T>
void AveragedTask(const AttentionParams& p, const FlashPlan& plan, int64_t b, int64_t qb, const float* row_lse) {
  const int64_t i0 = qb * plan.q_per_task, i1 = std::min(p.q_len, i0 + plan.q_per_task);
  for (int64_t i = i0; i < i1; ++i) {
    float* w = WeightsRow(p, b, 0, i);
    for (int64_t j = 0; j < p.kv_len; ++j) w[j * p.weights_stride[3]] = 0.0f;
  }
  const float inv_heads = 1.0f / static_cast<float>(p.q_heads);
  for (int64_t hk = 0; hk < p.kv_heads; ++hk) {
    ProbabilityBlocks<T>(p, plan, b, hk, qb, row_lse,
                      [&](const TaskRows& t, int64_t r, int64_t j0, int64_t jn, const float* st, size_t M) {
                        float* w = WeightsRow(p, t.b, 0, t.query[r]) + j0 * p.weights_stride[3];
                        for (int64_t j = 0; j < jn; ++j) w[j * p.weights_stride[3]] += st[j * M + r] * inv_heads;
                      });
  }
}

template <typename T>
void WeightsOf(const AttentionParams& p, const float* row_lse, int num_threads) {
  const FlashPlan plan = make_flash_plan(p, kTargetRows, kKeyBlock);
  if (p.weights_averaged) {
    parallel_for(p.batch * plan.q_blocks, num_threads,
                 [&](int64_t t) { AveragedTask<T>(p, plan, t / plan.q_blocks, t % plan.q_blocks, row_lse); });
  } else {
    parallel_for(plan.tasks(), num_threads, [&](int64_t t) { PerHeadTask<T>(p, plan, plan.order[t], row_lse); });
  }
}

}  // namespace

void FlashWeights(const AttentionParams& p, const float* row_lse, int num_threads) {
  switch (p.dtype) {
    case DType::kBF16: WeightsOf<bfloat16>(p, row_lse, num_threads); break;
    case DType::kF16: WeightsOf<float16>(p, row_lse, num_threads); break;
    default: WeightsOf<float>(p, row_lse, num_threads); break;
  }
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {

HWY_EXPORT(FlashWeights);

void flash_weights(const AttentionParams& p, const float* row_lse, int num_threads) {
  HWY_DYNAMIC_DISPATCH(FlashWeights)(p, row_lse, num_threads);
}

}  // namespace mha::kernels
#endif  // HWY_ONCE
