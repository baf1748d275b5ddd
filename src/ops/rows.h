// Copies between rows that lie apart in memory — one head of a (total, H, D) or (B, T, H, D)
// layout, rows H·D elements apart — and a contiguous head-major plane: what varlen_attention()
// and attention()'s key/value gather run on. Not public API.
#ifndef MHA_OPS_ROWS_H_
#define MHA_OPS_ROWS_H_

#include <algorithm>
#include <cstdint>

namespace mha::ops {

// n rows of W elements, row i at src + i·row_stride with its elements elem_stride apart, into
// dst with row i at dst + i·W.
template <typename T>
void gather_rows(const T* src, int64_t row_stride, int64_t elem_stride, int64_t n, int64_t W, T* dst) {
  for (int64_t i = 0; i < n; ++i, dst += W) {
    const T* row = src + i * row_stride;
    if (elem_stride == 1) {
      std::copy(row, row + W, dst);
    } else {
      for (int64_t e = 0; e < W; ++e) dst[e] = row[e * elem_stride];
    }
  }
}

// The other way: row i of src (at src + i·W) to dst + i·row_stride, elements elem_stride apart.
template <typename T>
void scatter_rows(const T* src, int64_t n, int64_t W, T* dst, int64_t row_stride, int64_t elem_stride) {
  for (int64_t i = 0; i < n; ++i, src += W) {
    T* row = dst + i * row_stride;
    if (elem_stride == 1) {
      std::copy(src, src + W, row);
    } else {
      for (int64_t e = 0; e < W; ++e) row[e * elem_stride] = src[e];
    }
  }
}

}  // namespace mha::ops

#endif  // MHA_OPS_ROWS_H_
