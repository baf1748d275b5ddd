// Counter-based dropout decisions: Philox4x32-10 (Random123), keyed by the seed and indexed by
// the element's coordinates alone, so every kernel, thread split and the backward pass draw
// the same bits for the same element.
//
//   counter = (j / 4, i, h, b), key = (seed low 32 bits, seed high 32 bits)
//   bits(b, h, i, j) = philox(counter, key)[j % 4]
//   keep  <=>  bits >= threshold,  threshold = round(p * 2^32)
//
// so an element is dropped with probability threshold / 2^32 (p to within 2^-33).
#ifndef MHA_KERNELS_DROPOUT_H_
#define MHA_KERNELS_DROPOUT_H_

#include <Random123/philox.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace mha::kernels {

class Dropout {
 public:
  Dropout(float p, uint64_t seed) : p_(p) {
    key_ = {{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
    if (p >= 1.0f) {
      drop_all_ = true;
    } else if (p > 0.0f) {
      const double t = std::nearbyint(static_cast<double>(p) * 4294967296.0);
      threshold_ = static_cast<uint32_t>(std::min(t, 4294967295.0));
      scale_ = 1.0f / (1.0f - p);
    }
  }

  bool active() const { return p_ > 0.0f; }
  bool drop_all() const { return drop_all_; }
  uint32_t threshold() const { return threshold_; }
  float scale() const { return scale_; }  // 1/(1-p), applied to kept elements

  // Four consecutive keys' bits: keys 4*j4 .. 4*j4+3 of row (b, h, i).
  r123::Philox4x32::ctr_type bits4(int64_t b, int64_t h, int64_t i, int64_t j4) const {
    r123::Philox4x32::ctr_type c = {{static_cast<uint32_t>(j4), static_cast<uint32_t>(i),
                                     static_cast<uint32_t>(h), static_cast<uint32_t>(b)}};
    return r123::Philox4x32()(c, key_);
  }
  bool keep(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (drop_all_) return false;
    return bits4(b, h, i, j >> 2)[j & 3] >= threshold_;
  }
  // The key's two words, for kernels that run Philox on vectors of counters (the same bits).
  uint32_t key(int word) const { return key_[word]; }

 private:
  float p_;
  bool drop_all_ = false;
  uint32_t threshold_ = 0;
  float scale_ = 1.0f;
  r123::Philox4x32::key_type key_{};
};

}  // namespace mha::kernels

#endif  // MHA_KERNELS_DROPOUT_H_
