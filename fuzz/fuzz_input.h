// Reads fuzzer bytes as a stream of small integers (zeros once exhausted); Rng fills tensors from
// a seed read there.
#ifndef MHA_FUZZ_FUZZ_INPUT_H_
#define MHA_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>

namespace mha::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  // In [lo, hi].
  int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(byte()) % (hi - lo + 1); }
  bool flag() { return byte() & 1; }
  bool done() const { return pos_ >= size_; }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | byte();
    return v;
  }

 private:
  const uint8_t* data_;
  size_t size_, pos_ = 0;
};

struct Rng {  // splitmix64
  uint64_t s;
  float next() {  // in [-8, 8)
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return static_cast<float>((z ^ (z >> 31)) >> 40) / 16777216.0f * 16.0f - 8.0f;
  }
};

}  // namespace mha::fuzz

#endif  // MHA_FUZZ_FUZZ_INPUT_H_
