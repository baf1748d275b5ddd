// libFuzzer target: the serving API under fuzzed calls, many of them hostile (ids never added or
// already freed, pages past the pool, counts past a batch's rows, shapes and configs that do not
// fit, cu_seqlens that are not offsets, values that are not finite): a PagedKvCache's add, fork,
// free, append, accessors and batched attend; a KvCache's appends with per-sequence counts,
// slots and attend; varlen_attention and its backward.
// Invariants: no crash or UB (ASan, UBSan); a call returns or throws mha::Error, and a cache call
// that throws leaves the cache as it was; a pool stays consistent (a page's references are the
// block tables holding it, the free pages those with none, a window releases exactly the pages
// wholly before a sequence's last `window` positions); a KvCache stores what its ring keeps;
// outputs are finite where every input they read is, and a packed sequence with no keys gives
// zeros and an LSE of −inf.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "mha/error.h"
#include "mha/kv_cache.h"
#include "mha/paged_kv_cache.h"
#include "mha/varlen.h"

namespace {

using mha::Error;
using mha::Tensor;
using mha::View;
using mha::fuzz::Input;
using mha::fuzz::Rng;

constexpr int64_t kHuge = int64_t{1} << 62;  // any size product with it overflows int64

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "invariant broken: %s\n", what);
    __builtin_trap();
  }
}

// A config's size: mostly in [lo, hi], now and then one no call may accept (0, −1, kHuge).
int64_t size_in(Input& in, int64_t lo, int64_t hi) {
  switch (in.range(0, 15)) {
    case 0: return 0;
    case 1: return -1;
    case 2: return kHuge;
    default: return in.range(lo, hi);
  }
}

// The size a call wants or, now and then, one off or 0: a wrong shape that is cheap to allocate.
int64_t near(Input& in, int64_t want) {
  switch (in.range(0, 11)) {
    case 0: return want + 1;
    case 1: return std::max<int64_t>(want - 1, 0);
    case 2: return 0;
    default: return want;
  }
}

mha::CacheType any_type(Input& in) { return static_cast<mha::CacheType>(in.range(0, 5)); }  // 5: none

// A float32 tensor of values in [-8, 8); now and then one that is not finite or is huge (then
// *finite = false).
Tensor filled(std::vector<int64_t> shape, Rng& rng, Input& in, bool* finite) {
  Tensor t(mha::DType::kF32, std::move(shape));
  float* x = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = rng.next();
  if (t.numel() > 0 && in.range(0, 7) == 0) {
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), 3e38f};
    x[in.u64() % static_cast<uint64_t>(t.numel())] = specials[in.range(0, 3)];
    *finite = false;
  }
  return t;
}

bool all_finite(const Tensor& t) {
  const float* x = t.data<float>();
  return std::all_of(x, x + t.numel(), [](float v) { return std::isfinite(v); });
}

std::string bytes_of(const Tensor& t) { return std::string(static_cast<const char*>(t.raw()), t.nbytes()); }

// Options a cache's attend accepts, and now and then ones it must refuse.
mha::AttentionOptions cache_options(Input& in, Rng& rng) {
  mha::AttentionOptions opt;
  opt.num_threads = static_cast<int>(in.range(1, 2));
  if (in.range(0, 3) == 0) opt.scale = rng.next();
  if (in.range(0, 15) == 0) opt.causal = mha::Causal::kBottomRight;
  if (in.range(0, 15) == 0) opt.window = 4;
  return opt;
}

// ---------------------------------------------------------------------------------------------
// PagedKvCache

// Everything a failed call must leave as it was: the pool's bookkeeping and every live
// sequence's positions.
std::string pool_snapshot(const mha::PagedKvCache& cache) {
  std::vector<int64_t> state = {cache.pages(), cache.free_pages()};
  std::string rows;
  for (int64_t id : cache.sequences()) {
    state.insert(state.end(), {-1, id, cache.length(id), cache.first_position(id)});
    state.insert(state.end(), cache.block_table(id).begin(), cache.block_table(id).end());
    rows += bytes_of(cache.keys_as_float(id)) + bytes_of(cache.values_as_float(id));
  }
  for (int64_t page = 0; page < cache.pages(); ++page) state.push_back(cache.references(page));
  return std::string(reinterpret_cast<const char*>(state.data()), state.size() * sizeof(int64_t)) + rows;
}

void check_pool(const mha::PagedKvCache& cache) {
  const mha::PagedKvCacheConfig& pc = cache.config();
  std::vector<int64_t> refs(static_cast<size_t>(cache.pages()), 0);
  for (int64_t id : cache.sequences()) {
    const int64_t length = cache.length(id), first = cache.first_position(id);
    const int64_t released = pc.window > 0 ? std::max<int64_t>(length - pc.window, 0) / pc.page_size : 0;
    require(first == released * pc.page_size, "a window releases exactly the pages wholly before its positions");
    const std::vector<int64_t>& table = cache.block_table(id);
    require(static_cast<int64_t>(table.size()) == (length - first + pc.page_size - 1) / pc.page_size,
            "a block table holds the pages of first_position .. length");
    for (int64_t page : table) {
      require(page >= 0 && page < cache.pages(), "block tables hold pool pages");
      ++refs[static_cast<size_t>(page)];
    }
  }
  int64_t free_pages = 0;
  for (int64_t page = 0; page < cache.pages(); ++page) {
    require(cache.references(page) == refs[static_cast<size_t>(page)], "references count the block tables");
    free_pages += refs[static_cast<size_t>(page)] == 0;
  }
  require(cache.free_pages() == free_pages, "the free pages are those no block table holds");
}

void fuzz_paged(Input& in, Rng& rng) {
  mha::PagedKvCacheConfig pc;
  pc.kv_heads = size_in(in, 1, 3);
  pc.head_dim_qk = size_in(in, 1, 40);
  pc.head_dim_v = size_in(in, 1, 40);
  pc.page_size = in.flag() ? int64_t{16} << in.range(0, 4) : size_in(in, 1, 300);
  pc.pages = size_in(in, 0, 8);
  pc.max_pages = in.flag() ? 0 : size_in(in, 1, 12);
  pc.window = in.flag() ? 0 : size_in(in, 1, 100);
  pc.dtype = any_type(in);
  std::optional<mha::PagedKvCache> made;
  try {
    made.emplace(pc);
  } catch (const Error&) {
    return;
  }
  mha::PagedKvCache& cache = *made;
  std::map<int64_t, bool> finite;  // by id: every value it holds (or held) is finite
  int64_t next_id = 0;             // ids are handed out in order and never reused
  auto pick = [&]() -> int64_t {
    const std::vector<int64_t> live = cache.sequences();
    switch (in.range(0, 7)) {
      case 0: return -1;
      case 1: return kHuge;
      case 2: return next_id;
      case 3: return in.range(0, std::max<int64_t>(next_id - 1, 0));  // maybe freed
      default: return live.empty() ? in.range(-1, 1) : live[in.byte() % live.size()];
    }
  };
  for (int step = 0; step < 48 && !in.done(); ++step) {
    const int op = static_cast<int>(in.range(0, 5));
    if (op == 4) {  // accessors, any arguments
      const int64_t id = pick();
      try {
        switch (in.range(0, 5)) {
          case 0: (void)cache.length(id); break;
          case 1: (void)cache.block_table(id); break;
          case 2: (void)cache.first_position(id); break;
          case 3: (void)cache.references(in.flag() ? kHuge : in.range(-2, cache.pages() + 1)); break;
          case 4: (void)cache.key_channel_scales(id), (void)cache.key_outlier_channels(id); break;
          default: {
            const Tensor k = cache.keys_as_float(id), v = cache.values_as_float(id);
            const int64_t kept = cache.length(id) - cache.first_position(id);
            require(k.shape()[1] == kept && v.shape()[1] == kept, "keys_as_float holds the kept positions");
            if (finite.at(id)) require(all_finite(k) && all_finite(v), "finite positions stay finite");
          }
        }
      } catch (const Error&) {
      }
      continue;
    }
    if (op == 5) {  // one batched decoding step
      const int64_t S = in.range(0, 3), n = in.range(0, 3), Hq = pc.kv_heads * in.range(1, 3);
      std::vector<int64_t> ids;
      for (int64_t s = 0; s < S; ++s) ids.push_back(pick());
      bool inputs_finite = true;
      const Tensor q = filled({near(in, S), near(in, Hq), near(in, n), near(in, pc.head_dim_qk)}, rng, in,
                              &inputs_finite);
      Tensor out(mha::DType::kF32, {near(in, S), near(in, Hq), near(in, n), near(in, pc.head_dim_v)});
      const mha::AttentionOptions opt = cache_options(in, rng);
      try {
        mha::attend(q.view<float>(), cache, ids, out.view<float>(), opt);
      } catch (const Error&) {
        continue;
      }
      require(opt.causal == mha::Causal::kNone && opt.window == 0, "attend refuses causal and window options");
      for (int64_t id : ids) inputs_finite &= finite.at(id);
      if (inputs_finite) require(all_finite(out), "finite inputs give finite outputs");
      continue;
    }
    const std::string before = pool_snapshot(cache);
    try {
      switch (op) {
        case 0: {
          const int64_t id = cache.add_sequence();
          require(id == next_id++, "ids are handed out in order");
          finite[id] = true;
          break;
        }
        case 1: {
          const int64_t from = pick();
          const int64_t id = cache.fork(from);
          require(id == next_id++, "ids are handed out in order");
          finite[id] = finite.at(from);
          break;
        }
        case 2: cache.free_sequence(pick()); break;
        default: {
          const int64_t id = pick(), n = in.range(0, 40);
          const bool position_major = in.flag();
          bool values_finite = true;
          auto rows = [&](Tensor& t, int64_t D) {  // (H, n, D), stored head- or position-major
            const int64_t H = near(in, pc.kv_heads), m = near(in, n), d = near(in, D);
            t = filled(position_major ? std::vector<int64_t>{m, H, d} : std::vector<int64_t>{H, m, d}, rng, in,
                       &values_finite);
            if (!position_major) return View<const float>(t.data<float>(), {H, m, d});
            return View<const float>(t.data<float>(), {H, m, d}, {d, H * d, 1});
          };
          Tensor k, v;
          const View<const float> kv = rows(k, pc.head_dim_qk), vv = rows(v, pc.head_dim_v);
          cache.append(id, kv, vv);
          finite.at(id) = finite.at(id) && values_finite;
        }
      }
    } catch (const Error&) {
      require(pool_snapshot(cache) == before, "a call that throws changes nothing");
    }
    check_pool(cache);
  }
}

// ---------------------------------------------------------------------------------------------
// KvCache

std::string cache_snapshot(const mha::KvCache& cache) {
  std::vector<int64_t> state = {cache.capacity()};
  for (int64_t b = 0; b < cache.config().batch; ++b) state.insert(state.end(), {cache.length(b), cache.stored(b)});
  return std::string(reinterpret_cast<const char*>(state.data()), state.size() * sizeof(int64_t)) +
         bytes_of(cache.keys_as_float()) + bytes_of(cache.values_as_float());
}

void fuzz_contiguous(Input& in, Rng& rng) {
  mha::KvCacheConfig c;
  c.batch = size_in(in, 1, 3);
  c.kv_heads = size_in(in, 1, 3);
  c.head_dim_qk = size_in(in, 1, 40);
  c.head_dim_v = size_in(in, 1, 40);
  c.capacity = size_in(in, 0, 40);
  c.window = in.flag() ? 0 : size_in(in, 1, 50);
  c.sink_tokens = in.flag() ? 0 : size_in(in, 0, 8);
  c.dtype = any_type(in);
  std::optional<mha::KvCache> made;
  try {
    made.emplace(c);
  } catch (const Error&) {
    return;
  }
  mha::KvCache& cache = *made;
  std::vector<char> finite(static_cast<size_t>(c.batch), 1);  // per sequence, as in fuzz_paged
  for (int step = 0; step < 32 && !in.done(); ++step) {
    const int op = static_cast<int>(in.range(0, 3));
    if (op == 0) {  // append, counts per sequence or all n
      const int64_t n = in.range(0, 40);
      bool values_finite = true;
      const Tensor k = filled({near(in, c.batch), near(in, c.kv_heads), near(in, n), near(in, c.head_dim_qk)}, rng,
                              in, &values_finite);
      const Tensor v = filled({near(in, c.batch), near(in, c.kv_heads), near(in, n), near(in, c.head_dim_v)}, rng,
                              in, &values_finite);
      std::vector<int64_t> counts;
      if (in.flag()) {
        for (int64_t b = near(in, c.batch); b > 0; --b) counts.push_back(in.range(0, 7) == 0 ? in.range(-1, n + 1) : n);
      }
      const std::string before = cache_snapshot(cache);
      try {
        cache.append(k.view<float>(), v.view<float>(), counts);
        for (int64_t b = 0; b < c.batch; ++b) {  // k's rows: n or, from near(), one off
          const bool appended = counts.empty() ? k.shape()[2] > 0 : counts[static_cast<size_t>(b)] > 0;
          if (appended && !values_finite) finite[static_cast<size_t>(b)] = 0;
        }
      } catch (const Error&) {
        require(cache_snapshot(cache) == before, "an append that throws changes nothing");
      }
    } else if (op == 1) {
      cache.reset();
      std::fill(finite.begin(), finite.end(), 1);
    } else if (op == 2) {  // accessors, any arguments
      try {
        const int64_t p = in.flag() ? kHuge : in.range(-2, 100);
        const int64_t s = cache.slot(p);
        const bool ring = c.window > 0 && p >= c.sink_tokens;
        require(s == (ring ? c.sink_tokens + (p - c.sink_tokens) % c.window : p), "slot() is as documented");
      } catch (const Error&) {
      }
      try {
        (void)cache.length(in.range(-1, c.batch));
      } catch (const Error&) {
      }
    } else {  // one decoding step
      const int64_t n = in.range(0, 3), Hq = c.kv_heads * in.range(1, 3);
      bool inputs_finite = true;
      const Tensor q = filled({near(in, c.batch), near(in, Hq), near(in, n), near(in, c.head_dim_qk)}, rng, in,
                              &inputs_finite);
      Tensor out(mha::DType::kF32, {near(in, c.batch), near(in, Hq), near(in, n), near(in, c.head_dim_v)});
      const mha::AttentionOptions opt = cache_options(in, rng);
      try {
        mha::attend(q.view<float>(), cache, out.view<float>(), opt);
      } catch (const Error&) {
        continue;
      }
      require(opt.causal == mha::Causal::kNone && opt.window == 0, "attend refuses causal and window options");
      if (inputs_finite && std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; }))
        require(all_finite(out), "finite inputs give finite outputs");
    }
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t kept = c.window > 0 ? std::min(cache.length(b), c.sink_tokens + c.window) : cache.length(b);
      require(cache.stored(b) == kept, "stored() is what the ring keeps");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// varlen_attention

void fuzz_varlen(Input& in, Rng& rng) {
  const int64_t S = in.range(0, 4), Hkv = in.range(1, 2), Hq = Hkv * in.range(1, 3);
  const int64_t D = in.range(1, 24), Dv = in.range(1, 24);
  std::vector<int64_t> cu_q(static_cast<size_t>(S) + 1, 0), cu_k(static_cast<size_t>(S) + 1, 0);
  for (size_t s = 0; s < static_cast<size_t>(S); ++s) {
    cu_q[s + 1] = cu_q[s] + in.range(0, 12);
    cu_k[s + 1] = cu_k[s] + in.range(0, 12);
  }
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  if (in.range(0, 3) == 0) {  // offsets that are not: out of order, not from 0, past the tokens
    std::vector<int64_t>& cu = in.flag() ? cu_q : cu_k;
    cu[in.byte() % cu.size()] = in.flag() ? kHuge : in.range(-3, 30);
  }
  if (in.range(0, 7) == 0) (in.flag() ? cu_q : cu_k).push_back(total_k);  // S + 2 offsets
  bool inputs_finite = true;
  const Tensor q = filled({near(in, total_q), near(in, Hq), near(in, D)}, rng, in, &inputs_finite);
  const Tensor k = filled({near(in, total_k), near(in, Hkv), near(in, D)}, rng, in, &inputs_finite);
  const Tensor v = filled({near(in, total_k), near(in, Hkv), near(in, Dv)}, rng, in, &inputs_finite);
  Tensor out(mha::DType::kF32, {near(in, total_q), near(in, Hq), near(in, Dv)});
  Tensor lse(mha::DType::kF32, {near(in, Hq), near(in, total_q)});
  mha::AttentionOptions opt;
  opt.num_threads = static_cast<int>(in.range(1, 2));
  opt.causal = static_cast<mha::Causal>(in.range(0, 2));
  if (in.flag()) opt.window = in.range(0, 8);
  if (in.flag()) opt.softcap = 0.5f + std::fabs(rng.next());
  if (in.range(0, 3) == 0) opt.dropout_p = 0.25f, opt.dropout_seed = in.u64();
  mha::BasicVarlenInputs<float> vin;
  vin.query = q.view<float>();
  vin.key = k.view<float>();
  vin.value = v.view<float>();
  vin.cu_seqlens_q = View<const int64_t>(cu_q.data(), {static_cast<int64_t>(cu_q.size())});
  vin.cu_seqlens_k = View<const int64_t>(cu_k.data(), {static_cast<int64_t>(cu_k.size())});
  try {
    mha::varlen_attention(vin, out.view<float>(), lse.view<float>(), opt);
  } catch (const Error&) {
    return;
  }
  // Accepted: the offsets were offsets, and the shapes agree (near() and a changed offset may
  // have changed a size in agreeing tensors).
  const int64_t tq = q.shape()[0], tk = k.shape()[0], hq = q.shape()[1], hkv = k.shape()[1];
  const int64_t d = q.shape()[2], dv = v.shape()[2];
  if (inputs_finite) require(all_finite(out), "finite inputs give finite outputs");
  for (size_t s = 0; s < static_cast<size_t>(S); ++s) {
    if (cu_k[s + 1] != cu_k[s]) continue;
    for (int64_t i = cu_q[s] * hq * dv; i < cu_q[s + 1] * hq * dv; ++i)
      require(out.data<float>()[i] == 0.0f, "a sequence with no keys gives zeros");
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = cu_q[s]; i < cu_q[s + 1]; ++i)
        require(lse.data<float>()[h * tq + i] == -std::numeric_limits<float>::infinity(),
                "a sequence with no keys has an LSE of -inf");
  }
  bool grad_finite = true;
  const Tensor grad_out = filled({tq, hq, dv}, rng, in, &grad_finite);
  Tensor grad_q(mha::DType::kF32, {near(in, tq), hq, d}), grad_k(mha::DType::kF32, {tk, hkv, d});
  Tensor grad_v(mha::DType::kF32, {tk, near(in, hkv), dv});
  try {
    mha::varlen_attention_backward(vin, out.view<float>(), lse.view<float>(), grad_out.view<float>(),
                                   {grad_q.view<float>(), grad_k.view<float>(), grad_v.view<float>()}, opt);
  } catch (const Error&) {
    return;
  }
  if (inputs_finite && grad_finite)
    require(all_finite(grad_q) && all_finite(grad_k) && all_finite(grad_v), "finite inputs give finite gradients");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  Rng rng{in.u64()};
  switch (in.range(0, 2)) {
    case 0: fuzz_paged(in, rng); break;
    case 1: fuzz_contiguous(in, rng); break;
    default: fuzz_varlen(in, rng);
  }
  return 0;
}
