// varlen_attention(): checks the packed layout, then runs attention() / attention_backward() on
// each sequence — no padding. Keys and values are read from head-major scratch: read in place
// through (1, H, n, D) views, rows of one head lie H·D elements apart (4 KiB for H·D = 1024, so
// they collide in the caches' sets), which cost the kernels 1.5× in time (`mha bench --varlen`);
// the copies are O(n·H·D) against the O(n²·H·D) of attention.
//  - The forward of sequences of many queries: one task per (sequence, kv head) on one thread,
//    costliest first; a task copies its head's keys and values (they then stay in its core's
//    L2), reads its query heads and writes their output in place.
//  - The rest (the backward, decode-like sequences, dropout, too few tasks for the threads): one
//    call per sequence on every thread, its rows copied into (1, H, n, D) scratch row by row.
// The scratch is the running thread's Workspace, kept across calls up to Workspace::kKeepBytes
// (fresh pages cost ~3 µs each here: the first touch of 32 MiB would be ~25 ms).
#include "mha/varlen.h"

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/cpu/flash.h"
#include "kernels/workspace.h"
#include "ops/rows.h"
#include "util/check.h"
#include "util/parallel.h"

namespace mha {
namespace {

using kernels::Workspace;

// Head-major (1, H, n, D) scratch of T in a Workspace slot; released when the call ends if the
// thread's varlen scratch then exceeds Workspace::kKeepBytes.
template <typename T>
View<T> scratch(Workspace::Slot slot, int64_t H, int64_t n, int64_t D) {
  T* p = Workspace::local().get<T>(slot, static_cast<size_t>(H * n * D));
  return View<T>(p, {1, H, n, D});
}

constexpr int64_t kRowBlock = 64;  // rows per task of a gather or scatter

struct ScratchRelease {
  ~ScratchRelease() { Workspace::local().trim(Workspace::kVarlenQuery, Workspace::kVarlenGradValue); }
};

// Rows [start, start + n) of x (total, H, D) into H head-major planes at dst (plane h at
// dst + h·n·D), on the caller's threads. Row by row: a row holds every head and is read in
// memory order (head by head, rows H·D elements apart, each row is a page of its own: 1.8×
// slower, measured at H·D = 1024).
template <typename T>
void gather_heads(const View<const T>& x, int64_t start, int64_t n, T* dst, int num_threads) {
  const int64_t H = x.shape[1], D = x.shape[2];
  parallel_for((n + kRowBlock - 1) / kRowBlock, num_threads, [&](int64_t blk) {
    for (int64_t i = blk * kRowBlock; i < std::min(n, (blk + 1) * kRowBlock); ++i)
      for (int64_t h = 0; h < H; ++h)
        ops::gather_rows(x.data + (start + i) * x.stride[0] + h * x.stride[1], 0, x.stride[2], 1, D,
                         dst + (h * n + i) * D);
  });
}
template <typename T>
View<T> gather_heads(const View<const T>& x, int64_t start, const View<T>& t, int num_threads) {
  gather_heads(x, start, t.shape[2], t.data, num_threads);
  return t;
}

// The head-major t (1, H, n, D) back into rows [start, start + n) of x (total, H, D), row by row.
template <typename T>
void scatter_heads(const View<T>& t, const View<T>& x, int64_t start, int num_threads) {
  const int64_t H = x.shape[1], n = t.shape[2], D = x.shape[2];
  parallel_for((n + kRowBlock - 1) / kRowBlock, num_threads, [&](int64_t blk) {
    for (int64_t i = blk * kRowBlock; i < std::min(n, (blk + 1) * kRowBlock); ++i)
      for (int64_t h = 0; h < H; ++h)
        ops::scatter_rows(t.data + (h * n + i) * D, 1, D, x.data + (start + i) * x.stride[0] + h * x.stride[1], 0,
                          x.stride[2]);
  });
}

// Sequence s's rows q[q0, q0 + nq), k and v [k0, k0 + nk) as head-major scratch inputs, with
// its ALiBi slopes.
template <typename T>
BasicAttentionInputs<T> gathered_inputs(const BasicVarlenInputs<T>& in, int64_t s, int64_t q0, int64_t nq, int64_t k0,
                                        int64_t nk, int threads) {
  const int64_t Hq = in.query.shape[1], Hkv = in.key.shape[1], D = in.query.shape[2], Dv = in.value.shape[2];
  BasicAttentionInputs<T> a;
  a.query = gather_heads(in.query, q0, scratch<T>(Workspace::kVarlenQuery, Hq, nq, D), threads);
  a.key = gather_heads(in.key, k0, scratch<T>(Workspace::kVarlenKey, Hkv, nk, D), threads);
  a.value = gather_heads(in.value, k0, scratch<T>(Workspace::kVarlenValue, Hkv, nk, Dv), threads);
  const auto& al = in.alibi_slopes;
  if (al.given()) {
    a.alibi_slopes = al.rank == 1 ? al : View<const float>(al.data + s * al.stride[0], {Hq}, {al.stride[1]});
  }
  return a;
}

// Columns [start, start + n) of lse (H, total) as a (1, H, n) view.
template <typename T>
View<T> sequence_lse(const View<T>& lse, int64_t start, int64_t n) {
  if (lse.data == nullptr) return {};
  return View<T>(lse.data + start * lse.stride[1], {1, lse.shape[0], n}, {lse.shape[0] * lse.stride[0], lse.stride[0],
                                                                        lse.stride[1]});
}

// Checks cu_seqlens (S + 1,): starts at 0, never decreases, ends at total.
void check_offsets(const View<const int64_t>& cu, const char* name, const char* rows, int64_t total,
                   int64_t sequences) {
  MHA_CHECK(cu.rank == 1 && cu.shape[0] >= 1 && cu.data != nullptr,
            "varlen_attention: {} must be (S + 1,) offsets; got {}", name, shape_string(cu));
  MHA_CHECK(cu.shape[0] == sequences + 1,
            "varlen_attention: cu_seqlens_q ({} values) and cu_seqlens_k ({}) must have the same length",
            sequences + 1, cu.shape[0]);
  MHA_CHECK(cu.data[0] == 0, "varlen_attention: {}[0] must be 0; got {}", name, cu.data[0]);
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t a = cu.data[s * cu.stride[0]], b = cu.data[(s + 1) * cu.stride[0]];
    MHA_CHECK(b >= a, "varlen_attention: {} must not decrease; {}[{}] = {} > {}[{}] = {}", name, name, s, a, name,
              s + 1, b);
  }
  const int64_t last = cu.data[sequences * cu.stride[0]];
  MHA_CHECK(last == total, "varlen_attention: {}[S] = {} must equal the {} rows ({})", name, last, rows, total);
}

template <typename T>
void check_inputs(const BasicVarlenInputs<T>& in) {
  const auto& q = in.query;
  const auto& k = in.key;
  const auto& v = in.value;
  MHA_CHECK(q.rank == 3 && k.rank == 3 && v.rank == 3,
            "varlen_attention: query {}, key {} and value {} must be (total, heads, head_dim)", shape_string(q),
            shape_string(k), shape_string(v));
  MHA_CHECK(k.shape[1] > 0 && q.shape[1] % k.shape[1] == 0 && k.shape[2] == q.shape[2] && v.shape[0] == k.shape[0] &&
                v.shape[1] == k.shape[1],
            "varlen_attention: query {} (total_q, Hq, D), key {} (total_k, Hkv, D) and value {} (total_k, Hkv, Dv) do "
            "not fit: Hq must be a multiple of Hkv",
            shape_string(q), shape_string(k), shape_string(v));
  const int64_t S = in.cu_seqlens_q.rank == 1 ? in.cu_seqlens_q.shape[0] - 1 : -1;
  check_offsets(in.cu_seqlens_q, "cu_seqlens_q", "query", q.shape[0], S);
  check_offsets(in.cu_seqlens_k, "cu_seqlens_k", "key", k.shape[0], S);
  const auto& al = in.alibi_slopes;
  MHA_CHECK(!al.given() || (al.rank == 1 && al.shape[0] == q.shape[1]) ||
                (al.rank == 2 && al.shape[0] == S && al.shape[1] == q.shape[1]),
            "varlen_attention: alibi_slopes must be (Hq,) = ({},) or (S, Hq) = ({}, {}); got {}", q.shape[1], S,
            q.shape[1], shape_string(al));
}

template <typename T>
void check_rows(const View<T>& x, const char* name, int64_t total, int64_t heads, int64_t dim) {
  MHA_CHECK(x.rank == 3 && x.shape[0] == total && x.shape[1] == heads && x.shape[2] == dim,
            "varlen_attention: {} must be ({}, {}, {}); got {}", name, total, heads, dim, shape_string(x));
}

template <typename T>
void check_lse(const View<T>& lse, int64_t heads, int64_t total) {
  MHA_CHECK(lse.rank == 2 && lse.shape[0] == heads && lse.shape[1] == total,
            "varlen_attention: lse must be (Hq, total_q) = ({}, {}); got {}", heads, total, shape_string(lse));
}

// Sequence s's rows in a packed tensor: [start, start + count), read from its offsets cu.
struct Rows {
  int64_t start, count;
};
inline Rows sequence_rows(const View<const int64_t>& cu, int64_t s) {
  const int64_t start = cu.data[s * cu.stride[0]];
  return {start, cu.data[(s + 1) * cu.stride[0]] - start};
}

// Calls f(s, q0, nq, k0, nk, options of s) for every sequence with queries.
template <class F>
void for_each_sequence(const View<const int64_t>& cq, const View<const int64_t>& ck, const AttentionOptions& options,
                       const F& f) {
  const int64_t S = cq.shape[0] - 1;
  for (int64_t s = 0; s < S; ++s) {
    const auto [q0, nq] = sequence_rows(cq, s);
    const auto [k0, nk] = sequence_rows(ck, s);
    if (nq == 0) continue;
    AttentionOptions o = options;
    o.dropout_seed = varlen_dropout_seed(options.dropout_seed, s);
    try {
      f(s, q0, nq, k0, nk, o);
    } catch (const std::bad_alloc&) {
      throw Error(fmt::format("varlen_attention: out of memory for the scratch of sequence {} ({} queries, {} keys)", s,
                              nq, nk));
    }
  }
}

// Whether a sequence of nq queries runs as per-head tasks (forward_head): the flash kernel cuts a call into
// (batch, kv head, query block) tasks whatever the head count, so one kv head's call gives that
// head's bits of the whole sequence's call. Not where the decode kernel would run (nq·G <=
// kMaxDecodeRows: its key split depends on the head count), nor with dropout (its draws depend on
// the head's index in the call), nor for elements not adjacent in a row.
template <typename T>
bool runs_by_head(const BasicVarlenInputs<T>& in, const View<T>& out, const AttentionOptions& options, int64_t nq) {
  const int64_t G = in.query.shape[1] / in.key.shape[1];
  return options.dropout_p == 0.0f && nq * G > kernels::kMaxDecodeRows && in.query.stride[2] == 1 &&
         in.key.stride[2] == 1 && in.value.stride[2] == 1 && out.stride[2] == 1;
}

// Kv head hk of sequence s on this thread: its keys and values gathered into this thread's
// Workspace (nk·(D + Dv) elements, which stay in this core's L2 while the kernel reads them
// again for every query tile), its G query heads read and their output written in place.
// (Gathering a wave of sequences' keys row by row on every thread first, then their tasks, was
// slower: 8% over one by one against this one's 1%, best of eight alternations.)
template <typename T>
void forward_head(const BasicVarlenInputs<T>& in, const View<T>& out, const View<float>& lse,
                  const AttentionOptions& options, int64_t s, int64_t hk) {
  const auto& q = in.query;
  const auto& k = in.key;
  const auto& v = in.value;
  const auto [q0, nq] = sequence_rows(in.cu_seqlens_q, s);
  const auto [k0, nk] = sequence_rows(in.cu_seqlens_k, s);
  const int64_t G = q.shape[1] / k.shape[1], D = q.shape[2], Dv = v.shape[2];
  Workspace& ws = Workspace::local();
  T* kd = ws.get<T>(Workspace::kVarlenKey, static_cast<size_t>(nk * D));
  T* vd = ws.get<T>(Workspace::kVarlenValue, static_cast<size_t>(nk * Dv));
  ops::gather_rows(k.data + k0 * k.stride[0] + hk * k.stride[1], k.stride[0], 1, nk, D, kd);
  ops::gather_rows(v.data + k0 * v.stride[0] + hk * v.stride[1], v.stride[0], 1, nk, Dv, vd);
  BasicAttentionInputs<T> a;
  a.query = View<const T>(q.data + q0 * q.stride[0] + hk * G * q.stride[1], {1, G, nq, D},
                          {G * q.stride[1], q.stride[1], q.stride[0], 1});
  a.key = View<const T>(kd, {1, 1, nk, D});
  a.value = View<const T>(vd, {1, 1, nk, Dv});
  const auto& al = in.alibi_slopes;
  if (al.given()) {
    const int64_t hs = al.stride[al.rank - 1];
    a.alibi_slopes = View<const float>(al.data + (al.rank == 2 ? s * al.stride[0] : 0) + hk * G * hs, {G}, {hs});
  }
  BasicAttentionOutputs<T> r;
  r.out = View<T>(out.data + q0 * out.stride[0] + hk * G * out.stride[1], {1, G, nq, Dv},
                  {G * out.stride[1], out.stride[1], out.stride[0], 1});
  if (lse.data) {
    r.lse = View<float>(lse.data + hk * G * lse.stride[0] + q0 * lse.stride[1], {1, G, nq},
                        {G * lse.stride[0], lse.stride[0], lse.stride[1]});
  }
  AttentionOptions o = options;
  o.num_threads = 1;
  attention(a, r, o);
  ws.trim(Workspace::kVarlenKey, Workspace::kVarlenValue);
}

template <typename T>
void forward(const BasicVarlenInputs<T>& in, const View<T>& out, const View<float>& lse,
             const AttentionOptions& options) {
  check_inputs(in);
  const int64_t Hq = in.query.shape[1], Hkv = in.key.shape[1], Dv = in.value.shape[2], total_q = in.query.shape[0];
  check_rows(out, "out", total_q, Hq, Dv);
  if (lse.data || lse.rank) check_lse(lse, Hq, total_q);
  const ScratchRelease release;
  // Sequences of many queries run as (sequence, kv head) tasks on one thread each, costliest
  // first, when they can keep the threads busy (no task over 1/(2·threads) of their work):
  // against a call per sequence on every thread this drops the copies of whole sequences (q, k,
  // v and out through memory: 8% of `mha bench --varlen`'s time) and a core's keys stay in its
  // L2. The rest (decode-like sequences, dropout, a few heads) run one call per sequence.
  const auto& cq = in.cu_seqlens_q;
  const auto& ck = in.cu_seqlens_k;
  const int64_t S = cq.shape[0] - 1;
  std::vector<int64_t> by_head;
  std::vector<double> cost(static_cast<size_t>(S), 0.0);
  double total = 0, largest = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nq = sequence_rows(cq, s).count, nk = sequence_rows(ck, s).count;
    if (nq == 0 || !runs_by_head(in, out, options, nq)) continue;
    cost[s] = static_cast<double>(nq) * static_cast<double>(std::max<int64_t>(nk, 1));
    by_head.push_back(s);
    total += cost[s] * static_cast<double>(Hkv);
    largest = std::max(largest, cost[s]);
  }
  const int threads = resolve_threads(options.num_threads);
  if (by_head.empty() || largest * 2 * threads > total) by_head.clear();
  std::stable_sort(by_head.begin(), by_head.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  parallel_for(static_cast<int64_t>(by_head.size()) * Hkv, threads, [&](int64_t t) {
    const int64_t s = by_head[t / Hkv];
    try {
      forward_head(in, out, lse, options, s, t % Hkv);
    } catch (const std::bad_alloc&) {
      throw Error(fmt::format("varlen_attention: out of memory for the scratch of sequence {} (kv head {})", s,
                              t % Hkv));
    }
  });
  std::vector<char> done(static_cast<size_t>(S), 0);
  for (int64_t s : by_head) done[s] = 1;
  for_each_sequence(cq, ck, options, [&](int64_t s, int64_t q0, int64_t nq, int64_t k0, int64_t nk,
                                         const AttentionOptions& o) {
    if (done[s]) return;
    const BasicAttentionInputs<T> a = gathered_inputs(in, s, q0, nq, k0, nk, o.num_threads);
    BasicAttentionOutputs<T> r;
    r.out = scratch<T>(Workspace::kVarlenOut, Hq, nq, Dv);
    r.lse = sequence_lse(lse, q0, nq);
    attention(a, r, o);
    scatter_heads(r.out, out, q0, o.num_threads);
  });
}

template <typename T>
void backward(const BasicVarlenInputs<T>& in, const View<const T>& out, const View<const float>& lse,
              const View<const T>& grad_out, const BasicVarlenGrads<T>& grads, const AttentionOptions& options) {
  check_inputs(in);
  const int64_t Hq = in.query.shape[1], Hkv = in.key.shape[1], D = in.query.shape[2], Dv = in.value.shape[2];
  const int64_t total_q = in.query.shape[0], total_k = in.key.shape[0];
  check_rows(out, "out", total_q, Hq, Dv);
  check_rows(grad_out, "grad_out", total_q, Hq, Dv);
  check_lse(lse, Hq, total_q);
  check_rows(grads.grad_query, "grad_query", total_q, Hq, D);
  check_rows(grads.grad_key, "grad_key", total_k, Hkv, D);
  check_rows(grads.grad_value, "grad_value", total_k, Hkv, Dv);
  const ScratchRelease release;
  // Keys of sequences without queries get zero gradient (no call covers them).
  const int64_t S = in.cu_seqlens_q.shape[0] - 1;
  for (int64_t s = 0; s < S; ++s) {
    if (sequence_rows(in.cu_seqlens_q, s).count != 0) continue;
    const auto [k0, nk] = sequence_rows(in.cu_seqlens_k, s);
    for (const View<T>& g : {grads.grad_key, grads.grad_value})
      for (int64_t t = k0; t < k0 + nk; ++t)
        for (int64_t h = 0; h < g.shape[1]; ++h)
          for (int64_t e = 0; e < g.shape[2]; ++e) g.data[t * g.stride[0] + h * g.stride[1] + e * g.stride[2]] = T{};
  }
  for_each_sequence(in.cu_seqlens_q, in.cu_seqlens_k, options,
                    [&](int64_t s, int64_t q0, int64_t nq, int64_t k0, int64_t nk, const AttentionOptions& o) {
                      const int threads = o.num_threads;
                      const BasicAttentionInputs<T> a = gathered_inputs(in, s, q0, nq, k0, nk, threads);
                      const View<T> ot = gather_heads(out, q0, scratch<T>(Workspace::kVarlenOut, Hq, nq, Dv), threads);
                      const View<T> go =
                          gather_heads(grad_out, q0, scratch<T>(Workspace::kVarlenGradOut, Hq, nq, Dv), threads);
                      const BasicAttentionInputGrads<T> g{scratch<T>(Workspace::kVarlenGradQuery, Hq, nq, D),
                                                          scratch<T>(Workspace::kVarlenGradKey, Hkv, nk, D),
                                                          scratch<T>(Workspace::kVarlenGradValue, Hkv, nk, Dv),
                                                          View<float>(), View<float>()};  // no sinks, no bias
                      attention_backward(a, ot, sequence_lse(lse, q0, nq), go, g, o);
                      scatter_heads(g.grad_query, grads.grad_query, q0, threads);
                      scatter_heads(g.grad_key, grads.grad_key, k0, threads);
                      scatter_heads(g.grad_value, grads.grad_value, k0, threads);
                    });
}

}  // namespace

void varlen_attention(const BasicVarlenInputs<float>& in, const View<float>& out, const View<float>& lse,
                      const AttentionOptions& options) {
  forward(in, out, lse, options);
}
void varlen_attention(const BasicVarlenInputs<bfloat16>& in, const View<bfloat16>& out, const View<float>& lse,
                      const AttentionOptions& options) {
  forward(in, out, lse, options);
}
void varlen_attention(const BasicVarlenInputs<float16>& in, const View<float16>& out, const View<float>& lse,
                      const AttentionOptions& options) {
  forward(in, out, lse, options);
}

void varlen_attention_backward(const BasicVarlenInputs<float>& in, const View<const float>& out,
                               const View<const float>& lse, const View<const float>& grad_out,
                               const BasicVarlenGrads<float>& grads, const AttentionOptions& options) {
  backward(in, out, lse, grad_out, grads, options);
}
void varlen_attention_backward(const BasicVarlenInputs<bfloat16>& in, const View<const bfloat16>& out,
                               const View<const float>& lse, const View<const bfloat16>& grad_out,
                               const BasicVarlenGrads<bfloat16>& grads, const AttentionOptions& options) {
  backward(in, out, lse, grad_out, grads, options);
}
void varlen_attention_backward(const BasicVarlenInputs<float16>& in, const View<const float16>& out,
                               const View<const float>& lse, const View<const float16>& grad_out,
                               const BasicVarlenGrads<float16>& grads, const AttentionOptions& options) {
  backward(in, out, lse, grad_out, grads, options);
}

}  // namespace mha
