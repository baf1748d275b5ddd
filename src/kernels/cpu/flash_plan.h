// How the fast attention kernels cut a problem into tasks, and which key blocks of a task can
// be skipped, shared by the forward, the weights pass and the backward. Independent of the ISA.
//
// A task is (batch b, key/value head hk, query block qb). Its rows are the G = Hq/Hkv query
// heads of the group times q_per_task queries (pack-GQA: each K/V block is read once for the
// whole group): row r is head hk·G + r / q_per_task, query qb·q_per_task + r % q_per_task.
#ifndef MHA_KERNELS_CPU_FLASH_PLAN_H_
#define MHA_KERNELS_CPU_FLASH_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/attention_params.h"

namespace mha::kernels {

struct FlashPlan {
  int64_t q_per_task = 0;  // queries per task
  int64_t rows = 0;        // G · q_per_task
  int64_t key_block = 0;   // keys per block
  int64_t q_blocks = 0;    // tasks per (b, hk)
  std::vector<int64_t> order;  // task indices in the order they are handed out

  int64_t tasks() const { return static_cast<int64_t>(order.size()); }
};

struct TaskCoords {
  int64_t b, hk, qb;
};

inline TaskCoords task_coords(const AttentionParams& p, const FlashPlan& plan, int64_t t) {
  const int64_t qb = t % plan.q_blocks;
  const int64_t bh = t / plan.q_blocks;
  return {bh / p.kv_heads, bh % p.kv_heads, qb};
}

// The smallest key range holding every key that some query of [i0, i1) can see (sink tokens
// included).
inline KeyRange task_keys(const AttentionParams& p, int64_t b, int64_t i0, int64_t i1) {
  KeyRange u{0, 0};
  for (int64_t i = i0; i < i1; ++i) {
    const KeyRange k = visible_keys(p, b, i);
    if (k.hi <= k.lo) continue;
    u = u.hi > u.lo ? KeyRange{std::min(u.lo, k.first()), std::max(u.hi, k.hi)} : KeyRange{k.first(), k.hi};
  }
  return u;
}

// `target_rows`: rows per task the micro-kernels like; `key_block`: keys per block.
inline FlashPlan make_flash_plan(const AttentionParams& p, int64_t target_rows, int64_t key_block) {
  FlashPlan plan;
  const int64_t G = p.group();
  plan.q_per_task = std::max<int64_t>(1, std::min<int64_t>(p.q_len, target_rows / G));
  plan.rows = G * plan.q_per_task;
  plan.key_block = key_block;
  plan.q_blocks = p.q_len == 0 ? 0 : (p.q_len + plan.q_per_task - 1) / plan.q_per_task;
  const int64_t n = p.batch * p.kv_heads * plan.q_blocks;
  std::vector<int64_t> cost(n);
  for (int64_t t = 0; t < n; ++t) {
    const TaskCoords c = task_coords(p, plan, t);
    const int64_t i0 = c.qb * plan.q_per_task;
    const KeyRange k = task_keys(p, c.b, i0, std::min(p.q_len, i0 + plan.q_per_task));
    cost[t] = k.hi > k.lo ? (k.hi + key_block - 1) / key_block - k.lo / key_block : 0;
  }
  // Head by head (its K/V stay in cache while both threads work on it), and within a head the
  // costliest query blocks first (causal blocks differ in cost), so the cheap ones balance the end.
  plan.order.resize(n);
  std::iota(plan.order.begin(), plan.order.end(), 0);
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) {
    const int64_t ha = a / plan.q_blocks, hb = b / plan.q_blocks;
    return ha != hb ? ha < hb : cost[a] > cost[b];
  });
  return plan;
}

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_FLASH_PLAN_H_
