// Row formats of KV cache storage, shared by KvCache and PagedKvCache (not public API). A row is
// one position of one kv head: `width` values stored as the cache type's elements, or for
// int8/int4 as codes plus (scale, minimum) pairs per group (kv_cache.h has the format).
#ifndef MHA_MODULES_KV_STORAGE_H_
#define MHA_MODULES_KV_STORAGE_H_

#include <cstdint>

#include "mha/kv_cache.h"

namespace mha::kv_storage {

int quant_bits(CacheType t);        // 8, 4, or 0 for the float types
DType element_type(CacheType t);    // of the stored elements (kU8 for codes)
int64_t quant_groups(int64_t width);
int64_t row_elements(CacheType t, int64_t width);  // stored elements (bytes for codes) per row

// Stores row[0 .. width) (column stride cs) at data (row_elements of the type) and, for int8/int4,
// its group scales at scales (2 · quant_groups); inv_channel (or nullptr) multiplies it first.
void write_row(const float* row, int64_t cs, int64_t width, CacheType type, const float* inv_channel, void* data,
               float* scales);
// The stored row as float32 into dst (times channel, if not nullptr).
void read_row(const void* data, const float* scales, const float* channel, int64_t width, CacheType type, float* dst);
// The key channel scales s[0 .. D) from rows n rows (row stride row_stride, column stride cs):
// powers of two of max(rms_c, mean rms), see kv_cache.h.
void channel_scales(const float* rows, int64_t row_stride, int64_t cs, int64_t n, int64_t D, float* s);

}  // namespace mha::kv_storage

#endif  // MHA_MODULES_KV_STORAGE_H_
