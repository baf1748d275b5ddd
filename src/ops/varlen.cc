// varlen_attention(): checks the packed layout, then runs attention() / attention_backward() on
// each sequence — no padding. Sequences run one after another, each with every thread. A
// sequence's rows are copied into head-major (1, H, n, D) scratch first: read in place through
// (1, H, n, D) views, rows of one head lie H·D elements apart (4 KiB for H·D = 1024, so they
// collide in the caches' sets), which cost the kernels 1.5× in time (`mha bench --varlen`); the
// copies are O(n·H·D) against the O(n²·H·D) of attention. The scratch is this thread's
// Workspace, kept across calls up to Workspace::kKeepBytes (fresh pages cost ~3 µs each here: the
// first touch of 32 MiB would be ~25 ms).
#include "mha/varlen.h"

#include <algorithm>
#include <new>
#include <string>

#include <fmt/format.h>

#include "kernels/workspace.h"
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

struct ScratchRelease {
  ~ScratchRelease() { Workspace::local().trim(Workspace::kVarlenQuery, Workspace::kVarlenGradValue); }
};

// Rows [start, start + t.shape[2]) of x (total, H, D) into the head-major t (1, H, n, D), on
// the caller's threads (row by row; a row is contiguous in the usual layouts).
template <typename T>
View<T> gather_heads(const View<const T>& x, int64_t start, const View<T>& t, int num_threads) {
  const int64_t H = x.shape[1], n = t.shape[2], D = x.shape[2];
  parallel_for(H, num_threads, [&](int64_t h) {
    for (int64_t i = 0; i < n; ++i) {
      const T* src = x.data + (start + i) * x.stride[0] + h * x.stride[1];
      T* dst = t.data + (h * n + i) * D;
      if (x.stride[2] == 1) {
        std::copy(src, src + D, dst);
      } else {
        for (int64_t e = 0; e < D; ++e) dst[e] = src[e * x.stride[2]];
      }
    }
  });
  return t;
}

// The head-major t (1, H, n, D) back into rows [start, start + n) of x (total, H, D).
template <typename T>
void scatter_heads(const View<T>& t, const View<T>& x, int64_t start, int num_threads) {
  const int64_t H = x.shape[1], n = t.shape[2], D = x.shape[2];
  parallel_for(H, num_threads, [&](int64_t h) {
    for (int64_t i = 0; i < n; ++i) {
      const T* src = t.data + (h * n + i) * D;
      T* dst = x.data + (start + i) * x.stride[0] + h * x.stride[1];
      if (x.stride[2] == 1) {
        std::copy(src, src + D, dst);
      } else {
        for (int64_t e = 0; e < D; ++e) dst[e * x.stride[2]] = src[e];
      }
    }
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

// Calls f(s, q0, nq, k0, nk, options of s) for every sequence with queries.
template <class F>
void for_each_sequence(const View<const int64_t>& cq, const View<const int64_t>& ck, const AttentionOptions& options,
                       const F& f) {
  const int64_t S = cq.shape[0] - 1;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q0 = cq.data[s * cq.stride[0]], nq = cq.data[(s + 1) * cq.stride[0]] - q0;
    const int64_t k0 = ck.data[s * ck.stride[0]], nk = ck.data[(s + 1) * ck.stride[0]] - k0;
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

template <typename T>
void forward(const BasicVarlenInputs<T>& in, const View<T>& out, const View<float>& lse,
             const AttentionOptions& options) {
  check_inputs(in);
  const int64_t Hq = in.query.shape[1], Dv = in.value.shape[2], total_q = in.query.shape[0];
  check_rows(out, "out", total_q, Hq, Dv);
  if (lse.data || lse.rank) check_lse(lse, Hq, total_q);
  const ScratchRelease release;
  for_each_sequence(in.cu_seqlens_q, in.cu_seqlens_k, options,
                    [&](int64_t s, int64_t q0, int64_t nq, int64_t k0, int64_t nk, const AttentionOptions& o) {
                      const int threads = o.num_threads;
                      const BasicAttentionInputs<T> a = gathered_inputs(in, s, q0, nq, k0, nk, threads);
                      BasicAttentionOutputs<T> r;
                      r.out = scratch<T>(Workspace::kVarlenOut, Hq, nq, Dv);
                      r.lse = sequence_lse(lse, q0, nq);
                      attention(a, r, o);
                      scatter_heads(r.out, out, q0, threads);
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
    const auto& cq = in.cu_seqlens_q;
    const auto& ck = in.cu_seqlens_k;
    if (cq.data[(s + 1) * cq.stride[0]] != cq.data[s * cq.stride[0]]) continue;
    const int64_t k0 = ck.data[s * ck.stride[0]], nk = ck.data[(s + 1) * ck.stride[0]] - k0;
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
                                                          View<float>()};  // varlen takes no sinks
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
