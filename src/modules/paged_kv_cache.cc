// PagedKvCache: a pool of pages with reference counts, block tables per sequence, copy on write
// of shared partial pages, window release; attend() over it.
#include "mha/paged_kv_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "modules/kv_storage.h"
#include "ops/attention_internal.h"
#include "util/check.h"

namespace mha {
using namespace kv_storage;

PagedKvCache::PagedKvCache(const PagedKvCacheConfig& config) : config_(config) {
  const auto& c = config_;
  MHA_CHECK(c.kv_heads > 0 && c.head_dim_qk > 0 && c.head_dim_v > 0 && c.pages > 0 && c.max_pages >= 0 &&
                c.window >= 0,
            "PagedKvCache: kv_heads {}, head dims ({}, {}), pages {}: must be positive; max_pages {} and window {} "
            "must not be negative",
            c.kv_heads, c.head_dim_qk, c.head_dim_v, c.pages, c.max_pages, c.window);
  static_assert(kCacheKeyTile == 16, "pages (powers of two, >= 16 slots) are whole key tiles of int8/int4 keys");
  MHA_CHECK(c.page_size >= 16 && c.page_size <= 256 && (c.page_size & (c.page_size - 1)) == 0,
            "PagedKvCache: page_size must be a power of two in [16, 256]; got {}", c.page_size);
  MHA_CHECK(c.max_pages == 0 || c.pages <= c.max_pages, "PagedKvCache: pages {} exceed max_pages {}", c.pages,
            c.max_pages);
  MHA_CHECK(c.dtype == CacheType::kF32 || c.dtype == CacheType::kBF16 || c.dtype == CacheType::kF16 ||
                c.dtype == CacheType::kInt8 || c.dtype == CacheType::kInt4,
            "PagedKvCache: dtype must be float32, bfloat16, float16, int8 or int4; got value {}",
            static_cast<int>(c.dtype));
  check_row_width(c.head_dim_qk, "PagedKvCache: head_dim_qk");
  check_row_width(c.head_dim_v, "PagedKvCache: head_dim_v");
  const int64_t row = checked_add(row_elements(c.dtype, c.head_dim_qk), row_elements(c.dtype, c.head_dim_v),
                                  "PagedKvCache: row elements");
  checked_mul(checked_mul(c.kv_heads, c.page_size, "PagedKvCache: rows per page"), row, "PagedKvCache: page size");
  grow(c.pages);
}

void PagedKvCache::grow(int64_t pages) {
  const auto& c = config_;
  const DType et = element_type(c.dtype);
  // Head-major planes (Hkv, pages, page_size, width): pages keep their numbers, each head's
  // pages move to the front of its bigger plane. Every new plane is made before any replaces its
  // old one: a pool that cannot grow (an mha::Error) stays as it was.
  auto bigger = [&](const Tensor& t, DType type, int64_t width) {
    Tensor n(type, {c.kv_heads, pages, c.page_size, width});
    if (pages_ > 0) {
      const size_t head = t.nbytes() / static_cast<size_t>(c.kv_heads);
      for (int64_t h = 0; h < c.kv_heads; ++h)
        std::memcpy(static_cast<std::byte*>(n.raw()) + h * (n.nbytes() / static_cast<size_t>(c.kv_heads)),
                    static_cast<const std::byte*>(t.raw()) + h * head, head);
    }
    return n;
  };
  const bool quantized = quant_bits(c.dtype) != 0;
  Tensor k = bigger(k_, et, row_elements(c.dtype, c.head_dim_qk));
  Tensor v = bigger(v_, et, row_elements(c.dtype, c.head_dim_v));
  Tensor k_scales, v_scales;
  if (quantized) {
    k_scales = bigger(k_scales_, kScaleWordType, scale_elements(c.head_dim_qk, true, c.dtype));
    v_scales = bigger(v_scales_, kScaleWordType, scale_elements(c.head_dim_v, false, c.dtype));
  }
  refs_.reserve(static_cast<size_t>(pages));
  free_.reserve(free_.size() + static_cast<size_t>(pages - pages_));
  k_ = std::move(k), v_ = std::move(v), k_scales_ = std::move(k_scales), v_scales_ = std::move(v_scales);
  refs_.resize(static_cast<size_t>(pages), 0);
  for (int64_t p = pages - 1; p >= pages_; --p) free_.push_back(p);  // lowest page taken first
  pages_ = pages;
}

void PagedKvCache::reserve_pages(int64_t n) {
  const int64_t short_by = n - free_pages();
  if (short_by <= 0) return;
  const int64_t limit = config_.max_pages > 0 ? config_.max_pages : std::numeric_limits<int64_t>::max();
  MHA_CHECK(short_by <= limit - pages_,
            "PagedKvCache: the pool is full ({} pages of {} positions, max_pages {}; {} more pages needed, {} free)",
            pages_, config_.page_size, config_.max_pages, n, free_pages());
  int64_t want = pages_;  // doubled until the pages fit
  while (want - pages_ < short_by) want = want <= limit / 2 ? 2 * want : limit;
  grow(want);
}

int64_t PagedKvCache::take_page() {
  const int64_t p = free_.back();
  free_.pop_back();
  refs_[p] = 1;
  return p;
}

void PagedKvCache::release_page(int64_t page) {
  if (--refs_[page] == 0) free_.push_back(page);
}

void PagedKvCache::copy_page(int64_t from, int64_t to) {
  const int64_t H = config_.kv_heads;
  for (Tensor* t : {&k_, &v_, &k_scales_, &v_scales_}) {
    if (!t->defined()) continue;
    const size_t bytes = t->nbytes() / static_cast<size_t>(pages_ * H);  // one head's page
    auto* base = static_cast<std::byte*>(t->raw());
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(base + (h * pages_ + to) * bytes, base + (h * pages_ + from) * bytes, bytes);
  }
}

int64_t PagedKvCache::pool_row(const Sequence& s, int64_t h, int64_t pos) const {
  const int64_t P = config_.page_size;
  return (h * pages_ + s.table[pos / P - s.first_page]) * P + pos % P;
}

const PagedKvCache::Sequence& PagedKvCache::sequence(int64_t id, const char* accessor) const {
  MHA_CHECK(id >= 0 && id < static_cast<int64_t>(seqs_.size()) && seqs_[id].live,
            "PagedKvCache::{}: sequence {} is not live ({} added so far, as ids from 0; freed ones are gone)", accessor,
            id, seqs_.size());
  return seqs_[id];
}
PagedKvCache::Sequence& PagedKvCache::sequence(int64_t id, const char* accessor) {
  return const_cast<Sequence&>(static_cast<const PagedKvCache*>(this)->sequence(id, accessor));
}

int64_t PagedKvCache::add_sequence() {
  Sequence s;
  s.live = true;
  if (quant_bits(config_.dtype)) {
    s.channels.assign(static_cast<size_t>(config_.kv_heads * config_.head_dim_qk), 1.0f);
    s.outliers.assign(static_cast<size_t>(config_.kv_heads * kCacheKeyOutliers), -1);
  }
  seqs_.push_back(std::move(s));
  return static_cast<int64_t>(seqs_.size()) - 1;
}

int64_t PagedKvCache::fork(int64_t id) {
  Sequence copy = sequence(id, "fork");
  seqs_.push_back(std::move(copy));  // first: it may throw (memory)
  for (int64_t p : seqs_.back().table) ++refs_[p];
  return static_cast<int64_t>(seqs_.size()) - 1;
}

void PagedKvCache::free_sequence(int64_t id) {
  Sequence& s = sequence(id, "free_sequence");
  for (int64_t p : s.table) release_page(p);
  s = Sequence();  // not live
}

int64_t PagedKvCache::length(int64_t id) const { return sequence(id, "length").length; }
const std::vector<int64_t>& PagedKvCache::block_table(int64_t id) const { return sequence(id, "block_table").table; }
int64_t PagedKvCache::first_position(int64_t id) const {
  return sequence(id, "first_position").first_page * config_.page_size;
}
const std::vector<float>& PagedKvCache::key_channel_scales(int64_t id) const {
  return sequence(id, "key_channel_scales").channels;
}
const std::vector<int64_t>& PagedKvCache::key_outlier_channels(int64_t id) const {
  return sequence(id, "key_outlier_channels").outliers;
}

std::vector<int64_t> PagedKvCache::sequences() const {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < seqs_.size(); ++i)
    if (seqs_[i].live) ids.push_back(static_cast<int64_t>(i));
  return ids;
}

int64_t PagedKvCache::references(int64_t page) const {
  MHA_CHECK(page >= 0 && page < pages_, "PagedKvCache::references: page {} outside [0, {})", page, pages_);
  return refs_[page];
}

int64_t PagedKvCache::nbytes() const {
  size_t n = k_.nbytes() + v_.nbytes();
  if (k_scales_.defined()) n += k_scales_.nbytes() + v_scales_.nbytes();
  return static_cast<int64_t>(n);
}

void PagedKvCache::append(int64_t id, const View<const float>& k, const View<const float>& v) {
  const auto& c = config_;
  sequence(id, "append");  // checks id first
  MHA_CHECK(k.rank == 3 && k.shape[0] == c.kv_heads && k.shape[2] == c.head_dim_qk,
            "PagedKvCache::append: keys must be (Hkv, n, Dk) = ({}, n, {}); got {}", c.kv_heads, c.head_dim_qk,
            shape_string(k));
  MHA_CHECK(v.rank == 3 && v.shape[0] == c.kv_heads && v.shape[1] == k.shape[1] && v.shape[2] == c.head_dim_v,
            "PagedKvCache::append: values must be (Hkv, n, Dv) = ({}, {}, {}); got {}", c.kv_heads, k.shape[1],
            c.head_dim_v, shape_string(v));
  MHA_CHECK((k.numel() == 0 || k.data) && (v.numel() == 0 || v.data),
            "PagedKvCache::append: keys {} or values {} have a null data pointer", shape_string(k), shape_string(v));
  const int64_t n = k.shape[1], P = c.page_size;
  if (n == 0) return;
  // Take every page needed before writing anything: a full pool leaves everything unchanged.
  Sequence& s = seqs_[id];
  const int64_t end = checked_add(s.length, n, "PagedKvCache::append: length");
  const int64_t have = (s.first_page + static_cast<int64_t>(s.table.size())) * P;
  const int64_t partial = s.length % P != 0 ? s.table.back() : -1;
  const bool copy_last = partial >= 0 && refs_[partial] > 1;  // shared with a fork: copy on write
  const int64_t new_pages = (std::max<int64_t>(end - have, 0) + P - 1) / P + (copy_last ? 1 : 0);
  // Every allocation first, then the pool's growth: after that nothing can fail. int8/int4: the
  // first append fixes the sequence's key channel scales.
  const int bits = quant_bits(c.dtype);
  const bool fix_channels = bits && !s.channels_fixed;
  std::vector<float> channels(fix_channels ? s.channels.size() : 0), inv(bits ? static_cast<size_t>(c.head_dim_qk) : 0);
  std::vector<int64_t> outliers(fix_channels ? s.outliers.size() : 0);
  for (int64_t h = 0; fix_channels && h < c.kv_heads; ++h)
    key_channels(k.data + h * k.stride[0], k.stride[1], k.stride[2], n, c.head_dim_qk,
                 channels.data() + h * c.head_dim_qk, outliers.data() + h * kCacheKeyOutliers);
  std::vector<int64_t> taken;
  taken.reserve(static_cast<size_t>(new_pages));
  // Doubling, as insert would: reserving the exact size made every new page copy the table.
  const size_t table = s.table.size() + static_cast<size_t>(new_pages);
  if (table > s.table.capacity()) s.table.reserve(std::max(table, 2 * s.table.capacity()));
  reserve_pages(new_pages);
  for (int64_t i = 0; i < new_pages; ++i) taken.push_back(take_page());
  if (copy_last) {
    const int64_t fresh = taken.back();
    taken.pop_back();
    copy_page(partial, fresh);
    release_page(partial);
    s.table.back() = fresh;
  }
  s.table.insert(s.table.end(), taken.begin(), taken.end());

  if (fix_channels) {
    s.channels.swap(channels);
    s.outliers.swap(outliers);
    s.channels_fixed = true;
  }
  const int64_t kw = k_.shape()[3], vw = v_.shape()[3], es = static_cast<int64_t>(dtype_size(k_.dtype()));
  for (int64_t h = 0; h < c.kv_heads; ++h) {
    for (size_t e = 0; e < inv.size(); ++e) inv[e] = 1.0f / s.channels[h * c.head_dim_qk + static_cast<int64_t>(e)];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = pool_row(s, h, s.length + t);
      const float* key = k.data + h * k.stride[0] + t * k.stride[1];
      if (bits)  // pages are whole key tiles (page_size a multiple of kCacheKeyTile)
        write_key_row(key, k.stride[2], c.head_dim_qk, c.dtype, inv.data(), s.outliers.data() + h * kCacheKeyOutliers,
                      k_.data<uint8_t>(), scale_words(k_scales_), row);
      else
        write_row(key, k.stride[2], c.head_dim_qk, c.dtype, static_cast<std::byte*>(k_.raw()) + row * kw * es);
      const float* value = v.data + h * v.stride[0] + t * v.stride[1];
      if (bits)  // and their value scales whole tiles
        write_value_row(value, v.stride[2], c.head_dim_v, c.dtype, v_.data<uint8_t>(), scale_words(v_scales_), row);
      else
        write_row(value, v.stride[2], c.head_dim_v, c.dtype, static_cast<std::byte*>(v_.raw()) + row * vw * es);
    }
  }
  s.length = end;
  if (c.window > 0) {  // release the pages wholly before the last `window` positions
    while (!s.table.empty() && (s.first_page + 1) * P <= s.length - c.window) {
      release_page(s.table.front());
      s.table.erase(s.table.begin());
      ++s.first_page;
    }
  }
}

Tensor PagedKvCache::as_float(int64_t id, bool keys) const {
  const Sequence& s = sequence(id, keys ? "keys_as_float" : "values_as_float");
  const auto& c = config_;
  const int64_t P = c.page_size, first = s.first_page * P, D = keys ? c.head_dim_qk : c.head_dim_v;
  const Tensor& data = keys ? k_ : v_;
  const Tensor& scales = keys ? k_scales_ : v_scales_;
  const int64_t es = static_cast<int64_t>(dtype_size(data.dtype())), width = data.shape()[3];
  Tensor out(DType::kF32, {c.kv_heads, s.length - first, D});
  for (int64_t h = 0; h < c.kv_heads; ++h)
    for (int64_t pos = first; pos < s.length; ++pos) {
      const int64_t row = pool_row(s, h, pos);
      float* dst = out.data<float>() + (h * (s.length - first) + pos - first) * D;
      if (scales.defined() && keys)
        read_key_row(data.data<uint8_t>(), scale_words(scales), row, s.channels.data() + h * D,
                     s.outliers.data() + h * kCacheKeyOutliers, D, c.dtype, dst);
      else if (scales.defined())
        read_value_row(data.data<uint8_t>(), scale_words(scales), row, D, c.dtype, dst);
      else
        read_row(static_cast<const std::byte*>(data.raw()) + row * width * es, D, c.dtype, dst);
    }
  return out;
}

Tensor PagedKvCache::keys_as_float(int64_t id) const { return as_float(id, true); }
Tensor PagedKvCache::values_as_float(int64_t id) const { return as_float(id, false); }

void attend(const View<const float>& q, const PagedKvCache& cache, const std::vector<int64_t>& ids,
            const View<float>& out, const AttentionOptions& options) {
  const PagedKvCacheConfig& c = cache.config();
  const int64_t S = static_cast<int64_t>(ids.size());
  MHA_CHECK(q.rank == 4 && q.shape[0] == S && q.shape[1] > 0 && q.shape[1] % c.kv_heads == 0 &&
                q.shape[3] == c.head_dim_qk,
            "attend: query must be (S, Hq, n, Dk) with S = {} sequences, Hq a multiple of kv_heads = {}, Dk = {}; "
            "got {}",
            S, c.kv_heads, c.head_dim_qk, shape_string(q));
  MHA_CHECK(out.rank == 4 && out.shape[0] == S && out.shape[1] == q.shape[1] && out.shape[2] == q.shape[2] &&
                out.shape[3] == c.head_dim_v,
            "attend: out must be (S, Hq, n, Dv) = ({}, {}, {}, {}); got {}", S, q.shape[1], q.shape[2], c.head_dim_v,
            shape_string(out));
  MHA_CHECK((q.numel() == 0 || q.data) && (out.numel() == 0 || out.data),
            "attend: query {} or out {} has a null data pointer", shape_string(q), shape_string(out));
  MHA_CHECK(options.causal == Causal::kNone && options.window == 0 && options.dropout_p == 0.0f,
            "attend: causal masking and the window come from the cache; options.causal, window and dropout_p must "
            "be unset");
  for (int64_t s = 0; s < S; ++s)
    MHA_CHECK(cache.length(ids[s]) >= q.shape[2], "attend: sequence {} holds {} positions, fewer than the {} queries",
              ids[s], cache.length(ids[s]), q.shape[2]);
  ops::attention_over_paged_cache(q, cache, ids, out, options);
}

}  // namespace mha
