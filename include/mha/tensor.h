// Tensors: a non-owning strided View<T> and an owning, dtype-tagged Tensor.
//
// View<T> is what every kernel and op takes: a pointer, a rank (at most 4), a shape and
// strides counted in elements (not bytes). Strides may be 0 (broadcast) or any other value,
// so a (B, T, H, D) buffer is seen as (B, H, T, D) without a copy. A default-constructed
// View (rank 0) means "not given" for optional arguments.
//
// Tensor owns 64-byte-aligned storage (2 MiB-aligned, on transparent huge pages where the
// system allows, from 2 MiB on). It is move-only: copies are explicit (clone()).
#ifndef MHA_TENSOR_H_
#define MHA_TENSOR_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/error.h"
#include "mha/half.h"

namespace mha {

inline constexpr int kMaxRank = 4;

template <typename T>
struct View {
  T* data = nullptr;
  int rank = 0;  // 0: not given
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> stride{};

  View() = default;
  // A view with explicit strides (elements).
  View(T* ptr, std::initializer_list<int64_t> dims, std::initializer_list<int64_t> strides)
      : data(ptr), rank(static_cast<int>(dims.size())) {
    CheckRank(dims.size());
    CheckRank(strides.size() == dims.size() ? strides.size() : kMaxRank + 1);
    std::copy(dims.begin(), dims.end(), shape.begin());
    std::copy(strides.begin(), strides.end(), stride.begin());
  }
  // A row-major contiguous view.
  View(T* ptr, std::initializer_list<int64_t> dims) : View(ptr, std::vector<int64_t>(dims)) {}
  View(T* ptr, const std::vector<int64_t>& dims) : data(ptr), rank(static_cast<int>(dims.size())) {
    CheckRank(dims.size());
    int64_t s = 1;
    for (int i = rank - 1; i >= 0; --i) {
      shape[i] = dims[i];
      stride[i] = s;
      // Wraps instead of overflowing (undefined behaviour): a shape too large for int64 is an
      // mha::Error where the view is used (numel(), every op's checks), not here.
      s = static_cast<int64_t>(static_cast<uint64_t>(s) * static_cast<uint64_t>(dims[i]));
    }
  }

  // View<float> converts to View<const float>.
  template <typename U, typename = std::enable_if_t<std::is_same_v<const U, T> &&
                                                    !std::is_same_v<U, T>>>
  View(const View<U>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), rank(other.rank), shape(other.shape), stride(other.stride) {}

  bool given() const { return rank > 0; }
  // An mha::Error if the count does not fit in int64.
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) {
      if (__builtin_mul_overflow(n, shape[i], &n)) ThrowTooLarge();
    }
    return rank > 0 ? n : 0;
  }
  // Row-major with no gaps (dimensions of size 1 may have any stride).
  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = rank - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != s) return false;
      s *= shape[i];
    }
    return true;
  }
  // Element (i0, i1, i2, i3); indices past the rank must be 0. Checked: an index outside its
  // dimension is an mha::Error (the kernels read through raw pointers, not through at()).
  T& at(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const {
    const int64_t index[kMaxRank] = {i0, i1, i2, i3};
    for (int d = 0; d < kMaxRank; ++d) {
      if (index[d] < 0 || index[d] >= (d < rank ? shape[d] : 1)) ThrowIndex(index);
    }
    return data[i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3]];
  }
  // The same memory with dimensions a and b (each in [0, rank)) swapped (no copy).
  View transposed(int a, int b) const {
    if (a < 0 || a >= rank || b < 0 || b >= rank) {
      throw Error("View::transposed: dimensions " + std::to_string(a) + " and " + std::to_string(b) +
                  " must be in [0, " + std::to_string(rank) + ") for shape " + shape_string(*this));
    }
    View t = *this;
    std::swap(t.shape[a], t.shape[b]);
    std::swap(t.stride[a], t.stride[b]);
    return t;
  }

 private:
  [[noreturn]] void ThrowIndex(const int64_t (&index)[kMaxRank]) const {
    std::string at;
    for (int d = 0; d < kMaxRank; ++d) at += (d ? ", " : "(") + std::to_string(index[d]);
    throw Error("View::at: index " + at + ") is outside the view's shape " + shape_string(*this) +
                " (indices past the rank must be 0)");
  }
  [[noreturn]] void ThrowTooLarge() const {
    throw Error("View::numel: shape " + shape_string(*this) + " has more elements than int64 can count");
  }
  static void CheckRank(size_t n) {
    if (n == 0 || n > kMaxRank) throw Error("View: rank must be 1..4, got " + std::to_string(n));
  }
};

// "(2, 8, 16, 64)", or "(not given)" for rank 0.
std::string shape_string(const int64_t* shape, int rank);
template <typename T>
std::string shape_string(const View<T>& v) {
  return shape_string(v.shape.data(), v.rank);
}

enum class DType : uint8_t { kF32, kF64, kF16, kBF16, kBool, kU8, kI8, kI16, kI32, kI64 };

size_t dtype_size(DType dtype);

template <typename T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kF32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kF64; };
template <> struct DTypeOf<bfloat16> { static constexpr DType value = DType::kBF16; };
template <> struct DTypeOf<float16> { static constexpr DType value = DType::kF16; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::kU8; };
template <> struct DTypeOf<int8_t> { static constexpr DType value = DType::kI8; };
template <> struct DTypeOf<int16_t> { static constexpr DType value = DType::kI16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kI64; };
// safetensors spelling: "F32", "BOOL", ...
const char* dtype_name(DType dtype);

class Tensor {
 public:
  Tensor() = default;
  // Zero-filled.
  Tensor(DType dtype, std::vector<int64_t> shape);
  static Tensor zeros(std::vector<int64_t> shape) { return Tensor(DType::kF32, std::move(shape)); }

  // A moved-from tensor is undefined (defined() is false).
  Tensor(Tensor&& other) noexcept
      : defined_(std::exchange(other.defined_, false)),
        dtype_(other.dtype_),
        shape_(std::move(other.shape_)),
        storage_(std::move(other.storage_)) {
    other.shape_.clear();
  }
  Tensor& operator=(Tensor&& other) noexcept {
    defined_ = std::exchange(other.defined_, false);
    dtype_ = other.dtype_;
    shape_ = std::move(other.shape_);
    other.shape_.clear();
    storage_ = std::move(other.storage_);
    return *this;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor clone() const;

  bool defined() const { return defined_; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  void* raw() { return storage_.get(); }
  const void* raw() const { return storage_.get(); }

  // Typed access; throws mha::Error on a dtype mismatch (kBool reads as uint8_t) or, for
  // view(), on rank 0 or rank > 4.
  template <typename T>
  T* data() {
    CheckDType(DTypeOf<T>::value);
    return reinterpret_cast<T*>(storage_.get());
  }
  template <typename T>
  const T* data() const {
    CheckDType(DTypeOf<T>::value);
    return reinterpret_cast<const T*>(storage_.get());
  }
  template <typename T>
  View<T> view() {
    return View<T>(data<T>(), shape_);
  }
  template <typename T>
  View<const T> view() const {
    return View<const T>(data<T>(), shape_);
  }

  // Same elements, another shape (numel must match). Returns a new owner (copy).
  Tensor reshaped(std::vector<int64_t> shape) const;
  // A copy converted between the floating dtypes F64, F32, F16 and BF16 (rounding to nearest
  // even, see mha/half.h); throws mha::Error for other dtypes. to_f32() is converted(kF32).
  Tensor converted(DType dtype) const;
  Tensor to_f32() const { return converted(DType::kF32); }

 private:
  void CheckDType(DType wanted) const;
  struct FreeAligned {
    void operator()(std::byte* p) const;
  };
  bool defined_ = false;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::unique_ptr<std::byte[], FreeAligned> storage_;
};

// A contiguous tensor holding a copy of any view, of the same shape (dimensions of size 1 stay,
// so a copied mask still broadcasts). A view that is not given (rank 0) gives an undefined
// tensor.
Tensor to_tensor(const View<const float>& v);
Tensor to_tensor(const View<const uint8_t>& v);
Tensor to_tensor(const View<const int64_t>& v);
Tensor to_tensor(const View<const bfloat16>& v);
Tensor to_tensor(const View<const float16>& v);

}  // namespace mha

#endif  // MHA_TENSOR_H_
