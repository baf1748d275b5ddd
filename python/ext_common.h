// What the three sources of mha._mha share (mha_ext.cc: attention and varlen; ext_caches.cc:
// KvCache and PagedKvCache; ext_module.cc: MultiHeadAttention): ndarray types, views of them,
// and the conversions of Python arguments to mha's enums.
#ifndef MHA_PYTHON_EXT_COMMON_H_
#define MHA_PYTHON_EXT_COMMON_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>

#include "mha/attention.h"
#include "mha/error.h"
#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "mha/paged_kv_cache.h"
#include "mha/varlen.h"

namespace nb = nanobind;

namespace mha::python {

using In = nb::ndarray<nb::ro, nb::device::cpu>;   // read-only input, any dtype and strides
using Out = nb::ndarray<nb::device::cpu>;          // writable output
using Numpy = nb::ndarray<nb::numpy, float>;

inline const char* dtype_label(nb::dlpack::dtype t) {
  if (t == nb::dtype<float>()) return "float32";
  if (t == nb::dtype<double>()) return "float64";
  if (t == nb::dtype<bool>()) return "bool";
  if (t == nb::dtype<uint8_t>()) return "uint8";
  if (t == nb::dtype<int32_t>()) return "int32";
  if (t == nb::dtype<int64_t>()) return "int64";
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return "float16";
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat)) return "bfloat16";
  return "another dtype";
}

constexpr nb::dlpack::dtype kFloat16{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
constexpr nb::dlpack::dtype kBfloat16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};

// The element type of q, k and v: one of float32, bfloat16, float16 for all three.
inline DType element_type(const In& q, const In& k, const In& v) {
  const auto t = q.dtype();
  if (!(t == nb::dtype<float>() || t == kFloat16 || t == kBfloat16)) {
    throw Error(std::string("query: mha takes float32, bfloat16 or float16; got ") + dtype_label(t));
  }
  if (k.dtype() != t || v.dtype() != t) {
    throw Error(std::string("query, key and value must have one dtype; got ") + dtype_label(t) + ", " +
                dtype_label(k.dtype()) + " and " + dtype_label(v.dtype()));
  }
  return t == kFloat16 ? DType::kF16 : t == kBfloat16 ? DType::kBF16 : DType::kF32;
}

// A View of an array whose dtype must be T (bool arrays read as uint8).
template <typename T, typename A>
View<T> view_of(const A& a, const char* name) {
  using U = std::remove_const_t<T>;
  bool ok;
  if constexpr (std::is_same_v<U, bfloat16>) {
    ok = a.dtype() == kBfloat16;
  } else if constexpr (std::is_same_v<U, float16>) {
    ok = a.dtype() == kFloat16;
  } else {
    ok = a.dtype() == nb::dtype<U>() || (std::is_same_v<U, uint8_t> && a.dtype() == nb::dtype<bool>());
  }
  if (!ok) {
    const char* want = std::is_same_v<U, float>      ? "float32"
                       : std::is_same_v<U, bfloat16> ? "bfloat16 (the dtype of query)"
                       : std::is_same_v<U, float16>  ? "float16 (the dtype of query)"
                       : std::is_same_v<U, uint8_t>  ? "bool or uint8"
                                                     : "int64";
    throw Error(std::string(name) + ": mha needs " + want + ", got " + dtype_label(a.dtype()));
  }
  if (a.ndim() < 1 || a.ndim() > 4) {
    throw Error(std::string(name) + ": needs 1 to 4 dimensions, got " + std::to_string(a.ndim()));
  }
  View<T> v;
  v.data = static_cast<T*>(const_cast<void*>(static_cast<const void*>(a.data())));
  v.rank = static_cast<int>(a.ndim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.stride[i] = a.stride(i);
  }
  return v;
}

template <typename T, typename A>
View<T> optional_view(const std::optional<A>& a, const char* name) {
  return a ? view_of<T>(*a, name) : View<T>();
}

// A numpy array owning `t` (no copy): float32, float16, or for bfloat16 (which numpy lacks) its
// bits as uint16, which the Python layer views as torch.bfloat16.
inline nb::ndarray<nb::numpy> to_numpy(Tensor&& t) {
  if (!t.defined()) throw Error("internal: returning an undefined tensor");
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kF16 && t.dtype() != DType::kBF16) {
    throw Error(std::string("internal: returning a tensor of dtype ") + dtype_name(t.dtype()));
  }
  auto* owner = new Tensor(std::move(t));
  nb::capsule deleter(owner, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<size_t> shape(owner->shape().begin(), owner->shape().end());
  const nb::dlpack::dtype dtype = owner->dtype() == DType::kF32    ? nb::dtype<float>()
                                  : owner->dtype() == DType::kF16 ? kFloat16
                                                                  : nb::dtype<uint16_t>();
  return nb::ndarray<nb::numpy>(owner->raw(), shape.size(), shape.data(), deleter, nullptr, dtype);
}

inline DType dtype_of(const std::string& name) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  throw Error("dtype must be 'float32', 'bfloat16' or 'float16'; got '" + name + "'");
}

inline CacheType cache_type_of(const std::string& name, const char* who) {
  for (CacheType t : {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4})
    if (name == cache_type_name(t)) return t;
  throw Error(std::string(who) + ": dtype must be 'float32', 'bfloat16', 'float16', 'int8' or 'int4'; got '" + name +
              "'");
}

inline const char* dtype_label(DType t) {
  return t == DType::kBF16 ? "bfloat16" : t == DType::kF16 ? "float16" : "float32";
}

inline Causal causal_of(int c) {
  if (c < 0 || c > 2) throw Error("causal must be 0 (none), 1 (top-left) or 2 (bottom-right); got " + std::to_string(c));
  return static_cast<Causal>(c);
}

// A sequence index from any Python object: a non-integer, or an integer past int64, is an
// mha.Error naming the accessor (not nanobind's signature dump); the range is checked by KvCache.
inline int64_t sequence_index(const nb::handle& b, const char* accessor) {
  int64_t index = 0;
  if (PyBool_Check(b.ptr()) || !PyLong_Check(b.ptr()) || !nb::try_cast(b, index)) {
    throw Error(std::string("KvCache.") + accessor + ": b must be an integer sequence index; got " +
                nb::repr(b).c_str());
  }
  return index;
}

inline Backend backend_of(const std::string& b) {
  if (b == "auto") return Backend::kAuto;
  if (b == "reference") return Backend::kReference;
  if (b == "fast") return Backend::kFast;
  throw Error("backend must be 'auto', 'reference' or 'fast'; got '" + b + "'");
}

inline AttentionOptions options_of(std::optional<float> scale, int causal, int64_t window, float dropout_p,
                            uint64_t dropout_seed, int num_threads, const std::string& backend, float softcap = 0.0f,
                                  int64_t sink_tokens = 0) {
  AttentionOptions o;
  o.scale = scale;
  o.softcap = softcap;
  o.sink_tokens = sink_tokens;
  o.causal = causal_of(causal);
  o.window = window;
  o.dropout_p = dropout_p;
  o.dropout_seed = dropout_seed;
  o.num_threads = num_threads;
  o.backend = backend_of(backend);
  return o;
}

// The classes of the extension, bound by their own sources.
void bind_caches(nb::module_& m);
void bind_module(nb::module_& m);

}  // namespace mha::python

#endif  // MHA_PYTHON_EXT_COMMON_H_
