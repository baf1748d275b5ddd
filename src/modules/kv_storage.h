// Row formats of KV cache storage, shared by KvCache and PagedKvCache (not public API). A row is
// one position of one kv head: `width` values stored as the cache type's elements, or for
// int8/int4 as codes plus a scale and minimum per group (kv_cache.h has the format).
#ifndef MHA_MODULES_KV_STORAGE_H_
#define MHA_MODULES_KV_STORAGE_H_

#include <cstdint>

#include "mha/kv_cache.h"

namespace mha::kv_storage {

int quant_bits(CacheType t);        // 8, 4, or 0 for the float types
// The scale words of int8/int4 storage live in tensors of this type (any 32-bit type would do;
// DType has no unsigned one), read and written through scale_words().
constexpr DType kScaleWordType = DType::kI32;
inline uint32_t* scale_words(Tensor& t) { return reinterpret_cast<uint32_t*>(t.data<int32_t>()); }
inline const uint32_t* scale_words(const Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data<int32_t>()); }
DType element_type(CacheType t);    // of the stored elements (kU8 for codes)
// The most values a row may hold. Every size derived from a width (elements, bytes, groups,
// scales) then stays far below 2^63, so those are computed without overflow checks; the caches'
// constructors check their head dims with check_row_width.
constexpr int64_t kMaxRowWidth = int64_t{1} << 40;
// Throws mha::Error naming `what` and the width unless 0 < width <= kMaxRowWidth.
void check_row_width(int64_t width, const char* what);
int64_t quant_groups(int64_t width);
int64_t row_elements(CacheType t, int64_t width);  // stored elements (bytes for codes) per row
// 32-bit words per row of an int8/int4 cache's scales: a group's scale and minimum
// (cache_group_words(bits) words), then for keys the kCacheKeyOutliers outlier channel values,
// from outlier_offset(width, bits) on.
int64_t scale_elements(int64_t width, bool keys, CacheType type);
int64_t outlier_offset(int64_t width, int bits);

// Stores a row of a float32/bfloat16/float16 cache: row[0 .. width) (column stride cs) at data
// (row_elements of the type). int8/int4 rows: write_key_row, write_value_row (an mha::Error here).
void write_row(const float* row, int64_t cs, int64_t width, CacheType type, void* data);
// The stored row (as write_row's) as float32 into dst.
void read_row(const void* data, int64_t width, CacheType type, float* dst);
// Key rows of int8/int4 caches are stored in tiles of kCacheKeyTile rows (kv_cache.h): row r of
// the pools codes (row_elements bytes per row) and scales (scale_elements(width, true, type) words per
// row), whose (sequence, kv head) planes start at multiples of kCacheKeyTile rows. inv_channel
// (or nullptr) multiplies the row first and channel (or nullptr) the row read back; outliers: the
// kCacheKeyOutliers channels kept exactly (-1: unused).
void write_key_row(const float* row, int64_t cs, int64_t width, CacheType type, const float* inv_channel,
                   const int64_t* outliers, uint8_t* codes, uint32_t* scales, int64_t r);
void read_key_row(const uint8_t* codes, const uint32_t* scales, int64_t r, const float* channel,
                  const int64_t* outliers, int64_t width, CacheType type, float* dst);
// Value rows of int8/int4 caches: codes a row each (row r at r · row_elements), scales by tiles
// of kCacheKeyTile rows as the keys' (scale_elements(width, false, type) words per row; kv_cache.h).
void write_value_row(const float* row, int64_t cs, int64_t width, CacheType type, uint8_t* codes, uint32_t* scales,
                     int64_t r);
void read_value_row(const uint8_t* codes, const uint32_t* scales, int64_t r, int64_t width, CacheType type, float* dst);
// A sequence's key channels from its first n rows (row stride row_stride, column stride cs):
// outliers[0 .. kCacheKeyOutliers), the channels of rms above 4× the median (the largest
// first, at most kCacheKeyOutliers, in channel order, -1 after them), and the channel scales
// s[0 .. D): 1 for an outlier, else the power of two nearest max(rms_c, mean rms of the
// others). See kv_cache.h.
void key_channels(const float* rows, int64_t row_stride, int64_t cs, int64_t n, int64_t D, float* s,
                  int64_t* outliers);

}  // namespace mha::kv_storage

#endif  // MHA_MODULES_KV_STORAGE_H_
