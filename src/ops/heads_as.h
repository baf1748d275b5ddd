// Float32 query/output heads seen as another element type T: what attention over a KV cache of
// T runs on (KvCache::step/attend, PagedKvCache::attend). Not public API.
#ifndef MHA_OPS_HEADS_AS_H_
#define MHA_OPS_HEADS_AS_H_

#include <cstdint>
#include <type_traits>
#include <vector>

#include "mha/tensor.h"
#include "util/convert.h"

namespace mha::ops {

// x (B, H, n, D), any strides, rounded to T (round to nearest even) as a contiguous copy.
template <typename T>
Tensor rounded_heads(const View<const float>& x) {
  Tensor t(DTypeOf<T>::value, {x.shape[0], x.shape[1], x.shape[2], x.shape[3]});
  T* dst = t.data<T>();
  std::vector<float> row(x.stride[3] == 1 ? 0 : static_cast<size_t>(x.shape[3]));
  for (int64_t b = 0; b < x.shape[0]; ++b)
    for (int64_t h = 0; h < x.shape[1]; ++h)
      for (int64_t i = 0; i < x.shape[2]; ++i) {
        const float* src = x.data + b * x.stride[0] + h * x.stride[1] + i * x.stride[2];
        if (x.stride[3] != 1) {
          for (int64_t e = 0; e < x.shape[3]; ++e) row[static_cast<size_t>(e)] = src[e * x.stride[3]];
          src = row.data();
        }
        narrow_from_f32(src, DTypeOf<T>::value, dst, x.shape[3]);
        dst += x.shape[3];
      }
  return t;
}

// Float32 query heads and output heads as T: for a 16-bit T the queries rounded to it (as ggml
// does for its f16 caches) and an output of T that finish() widens into the float32 output; for
// float the views themselves.
template <typename T>
struct HeadsAs {
  HeadsAs(const View<const float>& qf, const View<float>& of) : out(of) {
    if constexpr (std::is_same_v<T, float>) {
      q = qf;
      o = of;
    } else {
      q16 = rounded_heads<T>(qf);
      q = q16.view<T>();
      out16 = Tensor(DTypeOf<T>::value, {of.shape[0], of.shape[1], of.shape[2], of.shape[3]});
      o = out16.view<T>();
    }
  }
  // Widens the T output into the float32 output view (any strides); nothing for float.
  void finish() const {
    if constexpr (!std::is_same_v<T, float>) {
      const T* src = out16.data<T>();
      for (int64_t b = 0; b < out.shape[0]; ++b)
        for (int64_t h = 0; h < out.shape[1]; ++h)
          for (int64_t i = 0; i < out.shape[2]; ++i) {
            float* dst = out.data + b * out.stride[0] + h * out.stride[1] + i * out.stride[2];
            if (out.stride[3] == 1) {
              widen_to_f32(src, DTypeOf<T>::value, dst, out.shape[3]);
            } else {
              for (int64_t e = 0; e < out.shape[3]; ++e) dst[e * out.stride[3]] = to_float(src[e]);
            }
            src += out.shape[3];
          }
    }
  }
  Tensor q16, out16;
  View<const T> q;
  View<T> o;
  View<float> out;
};

}  // namespace mha::ops

#endif  // MHA_OPS_HEADS_AS_H_
