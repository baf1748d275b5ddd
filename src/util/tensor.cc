#include "mha/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sys/mman.h>

#include <fmt/format.h>

#include "util/convert.h"
#include "util/fp16.h"

namespace mha {

std::string shape_string(const int64_t* shape, int rank) {
  if (rank == 0) return "(not given)";
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += fmt::format(i ? ", {}" : "{}", shape[i]);
  if (rank == 1) s += ",";
  return s + ")";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16:
      return 2;
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kBool: return "BOOL";
    case DType::kU8: return "U8";
    case DType::kI8: return "I8";
    case DType::kI16: return "I16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

void Tensor::FreeAligned::operator()(std::byte* p) const { std::free(p); }

Tensor::Tensor(DType dtype, std::vector<int64_t> shape)
    : defined_(true), dtype_(dtype), shape_(std::move(shape)) {
  int64_t n = 1;
  for (int64_t d : shape_) {
    if (d < 0) throw Error("Tensor: negative dimension in shape " + shape_string(shape_.data(), rank()));
    if (d != 0 && n > (int64_t{1} << 46) / d)
      throw Error("Tensor: shape " + shape_string(shape_.data(), rank()) + " is too large");
    n *= d;
  }
  // Round up to a whole cache line; at least one line so raw() is never null.
  size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  size_t padded = (bytes + 63) / 64 * 64 + 64;
  // Tensors of 2 MiB or more start on a 2 MiB boundary and ask for transparent huge pages over
  // their whole 2 MiB extents: streaming a large KV cache then walks one page table entry per
  // 2 MiB instead of per 4 KiB (one decoding step over a 256 MiB float32 cache: 10.2 → 8.9 ms,
  // medians on the Zen 5 VM, docs/benchmarks.md). The allocation is rounded up to the alignment (aligned_alloc's
  // rule); bytes past `padded` are never touched, so they cost no memory. madvise is a hint: a
  // kernel without transparent huge pages refuses it and nothing changes.
  constexpr size_t kHugePage = size_t{2} << 20;
  const bool huge = padded >= kHugePage;
  void* p = huge ? std::aligned_alloc(kHugePage, (padded + kHugePage - 1) / kHugePage * kHugePage)
                 : std::aligned_alloc(64, padded);
  if (p != nullptr && huge) (void)madvise(p, padded / kHugePage * kHugePage, MADV_HUGEPAGE);
  if (p == nullptr) {
    throw Error(fmt::format("Tensor: cannot allocate {} bytes for shape {}", padded, shape_string(shape_.data(), rank())));
  }
  std::memset(p, 0, padded);
  storage_.reset(static_cast<std::byte*>(p));
}

int64_t Tensor::numel() const {
  if (!defined_) return 0;
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

void Tensor::CheckDType(DType wanted) const {
  if (!defined_) throw Error("Tensor: access to an undefined tensor");
  bool ok = dtype_ == wanted || (wanted == DType::kU8 && dtype_ == DType::kBool);
  if (!ok)
    throw Error(fmt::format("Tensor: dtype is {}, accessed as {}", dtype_name(dtype_),
                            dtype_name(wanted)));
}

Tensor Tensor::clone() const {
  if (!defined_) return Tensor();
  Tensor t(dtype_, shape_);
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor Tensor::reshaped(std::vector<int64_t> shape) const {
  Tensor t(dtype_, std::move(shape));
  if (t.numel() != numel())
    throw Error("Tensor::reshaped: " + shape_string(shape_.data(), rank()) + " cannot become " +
                shape_string(t.shape_.data(), t.rank()));
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

namespace {

bool is_floating(DType t) {
  return t == DType::kF32 || t == DType::kF64 || t == DType::kF16 || t == DType::kBF16;
}

// Element i of a floating tensor's storage as double (exact for every source dtype).
double load_floating(const void* raw, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(raw)[i];
    case DType::kF64: return static_cast<const double*>(raw)[i];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(raw)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(raw)[i]);
  }
}

}  // namespace

Tensor Tensor::converted(DType dtype) const {
  if (!defined_) throw Error("Tensor::converted: the tensor is undefined");
  if (!is_floating(dtype_) || !is_floating(dtype))
    throw Error(fmt::format("Tensor::converted: {} to {}: only F64, F32, F16 and BF16 convert", dtype_name(dtype_),
                            dtype_name(dtype)));
  if (dtype == dtype_) return clone();
  Tensor t(dtype, shape_);
  const int64_t n = numel();
  if (dtype_ == DType::kF32 && (dtype == DType::kBF16 || dtype == DType::kF16)) {
    narrow_from_f32(static_cast<const float*>(raw()), dtype, t.raw(), n);
    return t;
  }
  if (dtype == DType::kF32 && (dtype_ == DType::kBF16 || dtype_ == DType::kF16)) {
    widen_to_f32(raw(), dtype_, static_cast<float*>(t.raw()), n);
    return t;
  }
  // float64 → 16 bits goes through float32 (double rounding differs from torch's direct rounding
  // in at most one ulp of the 16-bit result, only for values within 2⁻²⁹ relative of a tie).
  for (int64_t i = 0; i < n; ++i) {
    const double x = load_floating(raw(), dtype_, i);
    switch (dtype) {
      case DType::kF32: static_cast<float*>(t.raw())[i] = static_cast<float>(x); break;
      case DType::kF64: static_cast<double*>(t.raw())[i] = x; break;
      case DType::kF16: static_cast<uint16_t*>(t.raw())[i] = float_to_half(static_cast<float>(x)); break;
      default: static_cast<uint16_t*>(t.raw())[i] = float_to_bf16(static_cast<float>(x)); break;
    }
  }
  return t;
}

namespace {

template <typename T>
Tensor copy_view(const View<const T>& v) {
  if (!v.given()) return Tensor();
  Tensor t(DTypeOf<T>::value, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.rank));
  T* out = t.data<T>();
  const int64_t d0 = v.shape[0], d1 = v.rank > 1 ? v.shape[1] : 1;
  const int64_t d2 = v.rank > 2 ? v.shape[2] : 1, d3 = v.rank > 3 ? v.shape[3] : 1;
  int64_t n = 0;
  for (int64_t a = 0; a < d0; ++a)
    for (int64_t b = 0; b < d1; ++b)
      for (int64_t c = 0; c < d2; ++c)
        for (int64_t d = 0; d < d3; ++d) out[n++] = v.at(a, b, c, d);
  return t;
}

}  // namespace

Tensor to_tensor(const View<const float>& v) { return copy_view(v); }
Tensor to_tensor(const View<const uint8_t>& v) { return copy_view(v); }
Tensor to_tensor(const View<const int64_t>& v) { return copy_view(v); }
Tensor to_tensor(const View<const bfloat16>& v) { return copy_view(v); }
Tensor to_tensor(const View<const float16>& v) { return copy_view(v); }

}  // namespace mha
