// PagedKvCache: the keys and values of many sequences in one pool of fixed-size pages, for
// serving (vLLM's PagedAttention layout). Each sequence owns a block table: the pool pages that
// hold its positions, page_size positions each, in order. Sequences come and go without
// copying or fragmenting memory:
//   add_sequence()   a new, empty sequence; returns its id
//   append(id, k, v) its next positions (allocating pages from the pool as needed)
//   fork(id)         a new sequence sharing id's positions (parallel sampling, beam search):
//                    full pages are shared (reference counted), and a shared partial last page
//                    is copied when either sequence next appends to it (copy on write)
//   free_sequence(id) returns its pages to the pool (shared pages when their last user goes)
// attend(q, cache, ids, out) is one batched decoding call over sequences of different lengths.
//
// Every CacheType works (kv_cache.h describes the int8/int4 format; each sequence has its own
// key channel scales, inherited by forks). With window = W > 0 a sequence's pages that lie wholly
// before its last W positions go back to the pool. The pool grows by doubling when it runs out,
// up to max_pages (0: no limit); an append that needs more is an mha::Error and nothing changes
// (the pool does not grow either).
// Any bad id (never added, or freed) is an mha::Error and leaves the pool as it was. A NaN or
// infinity among a sequence's keys or values makes the outputs of its rows that attend to it
// non-finite (possibly NaN where attention() would give ±inf); other rows and sequences are
// unaffected.
#ifndef MHA_PAGED_KV_CACHE_H_
#define MHA_PAGED_KV_CACHE_H_

#include <cstdint>
#include <vector>

#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/tensor.h"

namespace mha {

struct PagedKvCacheConfig {
  int64_t kv_heads = 1;
  int64_t head_dim_qk = 0;  // head dims: 1 .. 2^40
  int64_t head_dim_v = 0;
  int64_t page_size = 64;  // positions per page: a power of two in [16, 256]
  int64_t pages = 16;      // initial pool size (grown by doubling)
  int64_t max_pages = 0;   // 0: no limit
  int64_t window = 0;      // 0: keep every position; else only the last `window` are attended to
  CacheType dtype = CacheType::kF32;
};

class PagedKvCache {
 public:
  explicit PagedKvCache(const PagedKvCacheConfig& config);

  const PagedKvCacheConfig& config() const { return config_; }

  int64_t add_sequence();
  int64_t fork(int64_t id);
  void free_sequence(int64_t id);
  // Appends k (Hkv, n, Dk) and v (Hkv, n, Dv), any strides, as the next n positions of id.
  void append(int64_t id, const View<const float>& k, const View<const float>& v);

  int64_t length(int64_t id) const;  // positions appended so far
  // The pool pages holding id's positions first_position(id) .. length(id), in order.
  const std::vector<int64_t>& block_table(int64_t id) const;
  int64_t first_position(int64_t id) const;  // 0 unless a window released leading pages
  std::vector<int64_t> sequences() const;     // live ids, ascending
  int64_t pages() const { return pages_; }    // pool size
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t references(int64_t page) const;     // sequences using a pool page (0: free)
  // The positions of id as float32 (Hkv, length − first_position, D) copies (dequantized).
  Tensor keys_as_float(int64_t id) const;
  Tensor values_as_float(int64_t id) const;
  // Bytes of the pool (all pages, with the group scales).
  int64_t nbytes() const;

  // For attend(): the pool's planes, head-major: (Hkv, pages, page_size, row elements) and, for
  // int8/int4, (Hkv, pages, page_size, w · groups (+ kCacheKeyOutliers for keys)) scale words (a
  // sequence's pages taken in a row are then one run of memory per head, which the decode reads
  // faster than runs of one page; keys and value scales by tiles of 16 slots, as KvCache's); key
  // channel scales of id (Hkv, Dk) and its outlier key channels (Hkv, kCacheKeyOutliers), as
  // KvCache's.
  const Tensor& key_pool() const { return k_; }
  const Tensor& value_pool() const { return v_; }
  const Tensor& key_scale_pool() const { return k_scales_; }
  const Tensor& value_scale_pool() const { return v_scales_; }
  const std::vector<float>& key_channel_scales(int64_t id) const;
  const std::vector<int64_t>& key_outlier_channels(int64_t id) const;

 private:
  struct Sequence {
    bool live = false;
    int64_t length = 0;
    int64_t first_page = 0;          // pages released by the window before table[0]
    std::vector<int64_t> table;
    std::vector<float> channels;     // int8/int4: (Hkv, Dk) key channel scales
    std::vector<int64_t> outliers;   // int8/int4: (Hkv, kCacheKeyOutliers) outlier key channels
    bool channels_fixed = false;
  };
  const Sequence& sequence(int64_t id, const char* accessor) const;
  Sequence& sequence(int64_t id, const char* accessor);
  // Grows the pool (doubling, up to max_pages) so that n pages are free, or throws mha::Error
  // and leaves it as it was.
  void reserve_pages(int64_t n);
  int64_t take_page();  // a free page (reserve_pages first), its references set to 1
  void release_page(int64_t page);
  void grow(int64_t pages);
  void copy_page(int64_t from, int64_t to);
  // The pools are head-major, (kv head, page, slot of the page): the row of kv head h's plane
  // holding position pos of s (cache_attention.cc gives the kernel the same layout as strides).
  int64_t pool_row(const Sequence& s, int64_t h, int64_t pos) const;
  Tensor as_float(int64_t id, bool keys) const;

  PagedKvCacheConfig config_;
  int64_t pages_ = 0;
  Tensor k_, v_, k_scales_, v_scales_;
  std::vector<int64_t> refs_;   // per page
  std::vector<int64_t> free_;   // free pages, taken from the back
  std::vector<Sequence> seqs_;  // by id (ids are never reused)
};

// One decoding step over sequences ids[s] of a paged cache: q (S, Hq, n, Dk), Hq a multiple of
// the kv heads, into out (S, Hq, n, Dv), as attend() over a KvCache: query i of sequence s is
// position length − n + i and sees the positions up to itself (within the window). Every
// sequence needs length ≥ n. 16-bit pools round the queries to their type; up to 16 query rows
// per kv head read the pool in place (one call for all sequences, split over threads), more
// gather the sequences into a float32 copy first. options: scale, num_threads and backend.
void attend(const View<const float>& q, const PagedKvCache& cache, const std::vector<int64_t>& ids,
            const View<float>& out, const AttentionOptions& options = {});

}  // namespace mha

#endif  // MHA_PAGED_KV_CACHE_H_
