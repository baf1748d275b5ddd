// mha._mha: the nanobind extension under the Python package (python/mha/). It exposes the C++
// library with the least policy: arrays arrive as nanobind ndarrays (numpy through the buffer
// protocol or DLPack, torch through DLPack), any strides, never copied; outputs are written into
// arrays the Python layer allocated, or returned as numpy arrays that own the C++ tensor.
// Semantics (torch's argument conventions, broadcasting, kinds) live in python/mha/*.py.
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
namespace {

using In = nb::ndarray<nb::ro, nb::device::cpu>;   // read-only input, any dtype and strides
using Out = nb::ndarray<nb::device::cpu>;          // writable output
using Numpy = nb::ndarray<nb::numpy, float>;

const char* dtype_label(nb::dlpack::dtype t) {
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
DType element_type(const In& q, const In& k, const In& v) {
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
nb::ndarray<nb::numpy> to_numpy(Tensor&& t) {
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

DType dtype_of(const std::string& name) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  throw Error("dtype must be 'float32', 'bfloat16' or 'float16'; got '" + name + "'");
}

CacheType cache_type_of(const std::string& name, const char* who) {
  for (CacheType t : {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4})
    if (name == cache_type_name(t)) return t;
  throw Error(std::string(who) + ": dtype must be 'float32', 'bfloat16', 'float16', 'int8' or 'int4'; got '" + name +
              "'");
}

const char* dtype_label(DType t) {
  return t == DType::kBF16 ? "bfloat16" : t == DType::kF16 ? "float16" : "float32";
}

Causal causal_of(int c) {
  if (c < 0 || c > 2) throw Error("causal must be 0 (none), 1 (top-left) or 2 (bottom-right); got " + std::to_string(c));
  return static_cast<Causal>(c);
}

// A sequence index from any Python object: a non-integer, or an integer past int64, is an
// mha.Error naming the accessor (not nanobind's signature dump); the range is checked by KvCache.
int64_t sequence_index(const nb::handle& b, const char* accessor) {
  int64_t index = 0;
  if (PyBool_Check(b.ptr()) || !PyLong_Check(b.ptr()) || !nb::try_cast(b, index)) {
    throw Error(std::string("KvCache.") + accessor + ": b must be an integer sequence index; got " +
                nb::repr(b).c_str());
  }
  return index;
}

Backend backend_of(const std::string& b) {
  if (b == "auto") return Backend::kAuto;
  if (b == "reference") return Backend::kReference;
  if (b == "fast") return Backend::kFast;
  throw Error("backend must be 'auto', 'reference' or 'fast'; got '" + b + "'");
}

AttentionOptions options_of(std::optional<float> scale, int causal, int64_t window, float dropout_p,
                            uint64_t dropout_seed, int num_threads, const std::string& backend, float softcap = 0.0f) {
  AttentionOptions o;
  o.scale = scale;
  o.softcap = softcap;
  o.causal = causal_of(causal);
  o.window = window;
  o.dropout_p = dropout_p;
  o.dropout_seed = dropout_seed;
  o.num_threads = num_threads;
  o.backend = backend_of(backend);
  return o;
}

// The per-head score inputs (docs/semantics.md "Score variants"): both optional, float32.
struct ScoreInputs {
  std::optional<In> alibi_slopes, sinks;
};

template <typename T>
BasicAttentionInputs<T> inputs_of(const In& q, const In& k, const In& v, const std::optional<In>& keep_mask,
                                  const std::optional<In>& attn_bias, const std::optional<In>& key_lengths,
                                  const ScoreInputs& score = {}) {
  BasicAttentionInputs<T> in;
  in.alibi_slopes = optional_view<const float>(score.alibi_slopes, "alibi_slopes");
  in.sinks = optional_view<const float>(score.sinks, "sinks");
  in.query = view_of<const T>(q, "query");
  in.key = view_of<const T>(k, "key");
  in.value = view_of<const T>(v, "value");
  in.keep_mask = optional_view<const uint8_t>(keep_mask, "attn_mask");
  in.attn_bias = optional_view<const float>(attn_bias, "attn_mask");
  in.key_lengths = optional_view<const int64_t>(key_lengths, "key_lengths");
  return in;
}

// out and weights in the dtype of q, k and v; lse float32.
template <typename T>
void attention_typed(const In& q, const In& k, const In& v, const Out& out, const std::optional<In>& keep_mask,
                     const std::optional<In>& attn_bias, const std::optional<In>& key_lengths,
                     const std::optional<Out>& lse, const std::optional<Out>& weights, const ScoreInputs& score,
                     const AttentionOptions& opt) {
  const BasicAttentionInputs<T> in = inputs_of<T>(q, k, v, keep_mask, attn_bias, key_lengths, score);
  BasicAttentionOutputs<T> o;
  o.out = view_of<T>(out, "out");
  o.lse = optional_view<float>(lse, "lse");
  o.weights = optional_view<T>(weights, "weights");
  nb::gil_scoped_release release;
  attention(in, o, opt);
}

void attention_py(const In& q, const In& k, const In& v, const Out& out, const std::optional<In>& keep_mask,
                  const std::optional<In>& attn_bias, const std::optional<In>& key_lengths, const std::optional<Out>& lse,
                  const std::optional<Out>& weights, std::optional<float> scale, int causal, int64_t window,
                  float dropout_p, uint64_t dropout_seed, int num_threads, const std::string& backend, float softcap,
                  const std::optional<In>& alibi_slopes, const std::optional<In>& sinks) {
  const AttentionOptions opt = options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, backend, softcap);
  const ScoreInputs score{alibi_slopes, sinks};
  switch (element_type(q, k, v)) {
    case DType::kBF16:
      return attention_typed<bfloat16>(q, k, v, out, keep_mask, attn_bias, key_lengths, lse, weights, score, opt);
    case DType::kF16:
      return attention_typed<float16>(q, k, v, out, keep_mask, attn_bias, key_lengths, lse, weights, score, opt);
    default:
      return attention_typed<float>(q, k, v, out, keep_mask, attn_bias, key_lengths, lse, weights, score, opt);
  }
}

template <typename T>
void backward_typed(const In& q, const In& k, const In& v, const In& out, const In& lse, const In& grad_out,
                    const Out& dq, const Out& dk, const Out& dv, const std::optional<In>& keep_mask,
                    const std::optional<In>& attn_bias, const std::optional<In>& key_lengths, const ScoreInputs& score,
                    const std::optional<Out>& grad_sinks, const AttentionOptions& opt) {
  const BasicAttentionInputs<T> in = inputs_of<T>(q, k, v, keep_mask, attn_bias, key_lengths, score);
  const BasicAttentionInputGrads<T> g{view_of<T>(dq, "grad_query"), view_of<T>(dk, "grad_key"),
                                      view_of<T>(dv, "grad_value"), optional_view<float>(grad_sinks, "grad_sinks")};
  const View<const T> o = view_of<const T>(out, "out"), go = view_of<const T>(grad_out, "grad_out");
  const View<const float> l = view_of<const float>(lse, "lse");
  nb::gil_scoped_release release;
  attention_backward(in, o, l, go, g, opt);
}

void attention_backward_py(const In& q, const In& k, const In& v, const In& out, const In& lse, const In& grad_out,
                           const Out& dq, const Out& dk, const Out& dv, const std::optional<In>& keep_mask,
                           const std::optional<In>& attn_bias, const std::optional<In>& key_lengths,
                           std::optional<float> scale, int causal, int64_t window, float dropout_p,
                           uint64_t dropout_seed, int num_threads, const std::string& backend, float softcap,
                           const std::optional<In>& alibi_slopes, const std::optional<In>& sinks,
                           const std::optional<Out>& grad_sinks) {
  const AttentionOptions opt = options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, backend, softcap);
  const ScoreInputs score{alibi_slopes, sinks};
  switch (element_type(q, k, v)) {
    case DType::kBF16:
      return backward_typed<bfloat16>(q, k, v, out, lse, grad_out, dq, dk, dv, keep_mask, attn_bias, key_lengths, score,
                                      grad_sinks, opt);
    case DType::kF16:
      return backward_typed<float16>(q, k, v, out, lse, grad_out, dq, dk, dv, keep_mask, attn_bias, key_lengths, score,
                                     grad_sinks, opt);
    default:
      return backward_typed<float>(q, k, v, out, lse, grad_out, dq, dk, dv, keep_mask, attn_bias, key_lengths, score,
                                   grad_sinks, opt);
  }
}

// --- varlen_attention -------------------------------------------------------------------------------

template <typename T>
BasicVarlenInputs<T> varlen_inputs_of(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k) {
  return {view_of<const T>(q, "q"), view_of<const T>(k, "k"), view_of<const T>(v, "v"),
          view_of<const int64_t>(cu_q, "cu_seqlens_q"), view_of<const int64_t>(cu_k, "cu_seqlens_k")};
}

template <typename T>
void varlen_typed(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const Out& out,
                  const Out& lse, const AttentionOptions& opt) {
  const BasicVarlenInputs<T> in = varlen_inputs_of<T>(q, k, v, cu_q, cu_k);
  const View<T> o = view_of<T>(out, "out");
  const View<float> l = view_of<float>(lse, "lse");
  nb::gil_scoped_release release;
  varlen_attention(in, o, l, opt);
}

void varlen_py(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const Out& out, const Out& lse,
               std::optional<float> scale, int causal, int64_t window, float dropout_p, uint64_t dropout_seed,
               int num_threads) {
  const AttentionOptions opt = options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, "auto");
  switch (element_type(q, k, v)) {
    case DType::kBF16: return varlen_typed<bfloat16>(q, k, v, cu_q, cu_k, out, lse, opt);
    case DType::kF16: return varlen_typed<float16>(q, k, v, cu_q, cu_k, out, lse, opt);
    default: return varlen_typed<float>(q, k, v, cu_q, cu_k, out, lse, opt);
  }
}

template <typename T>
void varlen_backward_typed(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const In& out,
                           const In& lse, const In& grad_out, const Out& dq, const Out& dk, const Out& dv,
                           const AttentionOptions& opt) {
  const BasicVarlenInputs<T> in = varlen_inputs_of<T>(q, k, v, cu_q, cu_k);
  const BasicVarlenGrads<T> g{view_of<T>(dq, "grad_q"), view_of<T>(dk, "grad_k"), view_of<T>(dv, "grad_v")};
  const View<const T> o = view_of<const T>(out, "out"), go = view_of<const T>(grad_out, "grad_out");
  const View<const float> l = view_of<const float>(lse, "lse");
  nb::gil_scoped_release release;
  varlen_attention_backward(in, o, l, go, g, opt);
}

void varlen_backward_py(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const In& out,
                        const In& lse, const In& grad_out, const Out& dq, const Out& dk, const Out& dv,
                        std::optional<float> scale, int causal, int64_t window, float dropout_p, uint64_t dropout_seed,
                        int num_threads) {
  const AttentionOptions opt = options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, "auto");
  switch (element_type(q, k, v)) {
    case DType::kBF16: return varlen_backward_typed<bfloat16>(q, k, v, cu_q, cu_k, out, lse, grad_out, dq, dk, dv, opt);
    case DType::kF16: return varlen_backward_typed<float16>(q, k, v, cu_q, cu_k, out, lse, grad_out, dq, dk, dv, opt);
    default: return varlen_backward_typed<float>(q, k, v, cu_q, cu_k, out, lse, grad_out, dq, dk, dv, opt);
  }
}

// --- Module ---------------------------------------------------------------------------------------

// Weights arrive as float32 (the Python layer widens every floating dtype exactly); the module
// converts them to its own dtype.
StateDict state_dict_of(const std::map<std::string, In>& arrays) {
  StateDict sd;
  for (const auto& [name, a] : arrays) {
    if (a.dtype() != nb::dtype<float>()) {
      throw Error("weights: '" + name + "' must be float32 here (the Python layer converts); got " +
                  dtype_label(a.dtype()));
    }
    const View<const float> v = a.ndim() == 0 ? View<const float>(static_cast<const float*>(a.data()), {1})
                                               : view_of<const float>(a, name.c_str());
    sd.emplace(name, to_tensor(v));
  }
  return sd;
}

struct PyMha {
  MultiHeadAttention m;
  std::string layout;                // what from_state_dict recognised
  std::vector<std::string> ignored;  // names it did not use
};

MultiHeadAttentionConfig config_of(int64_t embed_dim, int64_t num_heads, int64_t num_kv_heads, int64_t kdim, int64_t vdim,
                                   int64_t qk_proj_dim, int64_t v_proj_dim, int64_t out_dim, bool bias, bool out_proj,
                                   float attn_dropout, float out_dropout, int causal, int64_t window,
                                   int64_t max_seq_len, bool batch_first, const std::string& dtype) {
  MultiHeadAttentionConfig c;
  c.dtype = dtype_of(dtype);
  c.embed_dim = embed_dim;
  c.num_heads = num_heads;
  c.num_kv_heads = num_kv_heads;
  c.kdim = kdim;
  c.vdim = vdim;
  c.qk_proj_dim = qk_proj_dim;
  c.v_proj_dim = v_proj_dim;
  c.out_dim = out_dim;
  c.bias = bias;
  c.out_proj = out_proj;
  c.attn_dropout = attn_dropout;
  c.out_dropout = out_dropout;
  c.causal = causal_of(causal);
  c.window = window;
  c.max_seq_len = max_seq_len;
  c.batch_first = batch_first;
  return c;
}

RopeScaling rope_scaling_of(const std::string& s) {
  if (s == "none") return RopeScaling::kNone;
  if (s == "linear") return RopeScaling::kLinear;
  if (s == "ntk") return RopeScaling::kNtk;
  if (s == "yarn") return RopeScaling::kYarn;
  throw Error("MultiheadAttention: rotary scaling must be 'none', 'linear', 'ntk' or 'yarn'; got '" + s + "'");
}
const char* rope_scaling_name(RopeScaling s) {
  return s == RopeScaling::kLinear ? "linear" : s == RopeScaling::kNtk ? "ntk" : s == RopeScaling::kYarn ? "yarn" : "none";
}

// The score variants and position settings of a module (docs/semantics.md); rotary: a dict with
// the RotaryConfig fields (dims, theta, interleaved, scaling, factor, original_max_positions,
// beta_fast, beta_slow), or None.
void apply_variants(MultiHeadAttentionConfig& c, float softcap, bool alibi, bool sinks, bool qk_norm, float qk_norm_eps,
                    const std::optional<nb::dict>& rotary) {
  c.softcap = softcap;
  c.alibi = alibi;
  c.sinks = sinks;
  c.qk_norm = qk_norm;
  c.qk_norm_eps = qk_norm_eps;
  if (!rotary) return;
  for (auto [key, value] : *rotary) {
    const std::string k = nb::cast<std::string>(nb::str(key));
    try {
      if (k == "dims") {
        c.rotary.dims = nb::cast<int64_t>(value);
      } else if (k == "theta") {
        c.rotary.theta = nb::cast<float>(value);
      } else if (k == "interleaved") {
        c.rotary.interleaved = nb::cast<bool>(value);
      } else if (k == "scaling") {
        c.rotary.scaling = rope_scaling_of(nb::cast<std::string>(value));
      } else if (k == "factor") {
        c.rotary.factor = nb::cast<float>(value);
      } else if (k == "original_max_positions") {
        c.rotary.original_max_positions = nb::cast<int64_t>(value);
      } else if (k == "beta_fast") {
        c.rotary.beta_fast = nb::cast<float>(value);
      } else if (k == "beta_slow") {
        c.rotary.beta_slow = nb::cast<float>(value);
      } else {
        throw Error("MultiheadAttention: rotary has no setting '" + k + "' (dims, theta, interleaved, scaling, factor, "
                    "original_max_positions, beta_fast, beta_slow)");
      }
    } catch (const nb::cast_error&) {
      throw Error("MultiheadAttention: rotary['" + k + "'] has the wrong type: " + nb::repr(value).c_str());
    }
  }
}

nb::dict config_dict(const MultiHeadAttentionConfig& c, const MultiHeadAttention& m) {
  nb::dict d;
  d["embed_dim"] = c.embed_dim;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["kdim"] = c.kdim;
  d["vdim"] = c.vdim;
  d["qk_proj_dim"] = c.qk_proj_dim;
  d["v_proj_dim"] = c.v_proj_dim;
  d["out_dim"] = m.output_dim();
  d["bias"] = c.bias;
  d["out_proj"] = c.out_proj;
  d["attn_dropout"] = c.attn_dropout;
  d["out_dropout"] = c.out_dropout;
  d["causal"] = static_cast<int>(c.causal);
  d["window"] = c.window;
  d["max_seq_len"] = c.max_seq_len;
  d["batch_first"] = c.batch_first;
  d["dtype"] = dtype_label(c.dtype);
  d["softcap"] = c.softcap;
  d["alibi"] = c.alibi;
  d["sinks"] = c.sinks;
  d["qk_norm"] = c.qk_norm;
  d["qk_norm_eps"] = c.qk_norm_eps;
  nb::dict r;
  r["dims"] = c.rotary.dims;
  r["theta"] = c.rotary.theta;
  r["interleaved"] = c.rotary.interleaved;
  r["scaling"] = rope_scaling_name(c.rotary.scaling);
  r["factor"] = c.rotary.factor;
  r["original_max_positions"] = c.rotary.original_max_positions;
  r["beta_fast"] = c.rotary.beta_fast;
  r["beta_slow"] = c.rotary.beta_slow;
  d["rotary"] = r;
  return d;
}

}  // namespace
}  // namespace mha::python

NB_MODULE(_mha, m) {
  using namespace mha;
  using namespace mha::python;
  m.doc() = "mha's C++ core; use the mha package, not this module";
  nb::exception<Error>(m, "Error", PyExc_ValueError);
  m.attr("MAX_THREADS") = kMaxThreads;  // the most threads a call may ask for

  m.def("attention", &attention_py, nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("out"),
        nb::arg("keep_mask").none() = nb::none(), nb::arg("attn_bias").none() = nb::none(),
        nb::arg("key_lengths").none() = nb::none(), nb::arg("lse").none() = nb::none(),
        nb::arg("weights").none() = nb::none(), nb::arg("scale").none() = nb::none(), nb::arg("causal") = 0,
        nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0, nb::arg("num_threads") = 0,
        nb::arg("backend") = "auto", nb::arg("softcap") = 0.0f, nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("sinks").none() = nb::none());
  m.def("attention_backward", &attention_backward_py, nb::arg("query"), nb::arg("key"), nb::arg("value"),
        nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"), nb::arg("grad_query"), nb::arg("grad_key"),
        nb::arg("grad_value"), nb::arg("keep_mask").none() = nb::none(), nb::arg("attn_bias").none() = nb::none(),
        nb::arg("key_lengths").none() = nb::none(), nb::arg("scale").none() = nb::none(), nb::arg("causal") = 0,
        nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0, nb::arg("num_threads") = 0,
        nb::arg("backend") = "auto", nb::arg("softcap") = 0.0f, nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("sinks").none() = nb::none(), nb::arg("grad_sinks").none() = nb::none());

  m.def("varlen_attention", &varlen_py, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("out"), nb::arg("lse"), nb::arg("scale").none() = nb::none(),
        nb::arg("causal") = 0, nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0,
        nb::arg("num_threads") = 0);
  m.def("varlen_attention_backward", &varlen_backward_py, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"),
        nb::arg("grad_q"), nb::arg("grad_k"), nb::arg("grad_v"), nb::arg("scale").none() = nb::none(),
        nb::arg("causal") = 0, nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0,
        nb::arg("num_threads") = 0);

  nb::class_<KvCache>(m, "KvCache")
      .def("length", [](const KvCache& c, const nb::handle& b) { return c.length(sequence_index(b, "length")); },
           nb::arg("b").none())
      .def("stored", [](const KvCache& c, const nb::handle& b) { return c.stored(sequence_index(b, "stored")); },
           nb::arg("b").none())
      .def_prop_ro("capacity", &KvCache::capacity)
      .def_prop_ro("batch", [](const KvCache& c) { return c.config().batch; })
      .def_prop_ro("dtype", [](const KvCache& c) { return std::string(cache_type_name(c.config().dtype)); })
      .def_prop_ro("nbytes", &KvCache::nbytes)
      .def("reset", &KvCache::reset);

  nb::class_<PagedKvCache>(m, "PagedKvCache")
      .def(
          "__init__",
          [](PagedKvCache* self, int64_t kv_heads, int64_t head_dim_qk, int64_t head_dim_v, int64_t page_size,
             int64_t pages, int64_t max_pages, int64_t window, const std::string& dtype) {
            PagedKvCacheConfig c;
            c.kv_heads = kv_heads;
            c.head_dim_qk = head_dim_qk;
            c.head_dim_v = head_dim_v;
            c.page_size = page_size;
            c.pages = pages;
            c.max_pages = max_pages;
            c.window = window;
            c.dtype = cache_type_of(dtype, "PagedKvCache");
            new (self) PagedKvCache(c);
          },
          nb::arg("kv_heads"), nb::arg("head_dim_qk"), nb::arg("head_dim_v"), nb::arg("page_size"), nb::arg("pages"),
          nb::arg("max_pages"), nb::arg("window"), nb::arg("dtype"))
      .def("add_sequence", &PagedKvCache::add_sequence)
      .def("fork", &PagedKvCache::fork, nb::arg("id"))
      .def("free_sequence", &PagedKvCache::free_sequence, nb::arg("id"))
      .def(
          "append",
          [](PagedKvCache& c, int64_t id, const In& k, const In& v) {
            c.append(id, view_of<const float>(k, "k"), view_of<const float>(v, "v"));
          },
          nb::arg("id"), nb::arg("k"), nb::arg("v"))
      .def("length", &PagedKvCache::length, nb::arg("id"))
      .def("block_table", &PagedKvCache::block_table, nb::arg("id"))
      .def("first_position", &PagedKvCache::first_position, nb::arg("id"))
      .def("sequences", &PagedKvCache::sequences)
      .def("references", &PagedKvCache::references, nb::arg("page"))
      .def("keys_as_float", [](const PagedKvCache& c, int64_t id) { return to_numpy(c.keys_as_float(id)); },
           nb::arg("id"))
      .def("values_as_float", [](const PagedKvCache& c, int64_t id) { return to_numpy(c.values_as_float(id)); },
           nb::arg("id"))
      .def_prop_ro("pages", &PagedKvCache::pages)
      .def_prop_ro("free_pages", &PagedKvCache::free_pages)
      .def_prop_ro("nbytes", &PagedKvCache::nbytes)
      .def_prop_ro("dtype", [](const PagedKvCache& c) { return std::string(cache_type_name(c.config().dtype)); })
      .def_prop_ro("head_dim_v", [](const PagedKvCache& c) { return c.config().head_dim_v; })
      .def(
          "attend",
          [](const PagedKvCache& c, const In& q, const std::vector<int64_t>& ids, const Out& out, int num_threads) {
            const View<const float> qv = view_of<const float>(q, "q");
            const View<float> ov = view_of<float>(out, "out");
            AttentionOptions o;
            o.num_threads = num_threads;
            nb::gil_scoped_release release;
            attend(qv, c, ids, ov, o);
          },
          nb::arg("q"), nb::arg("ids"), nb::arg("out"), nb::arg("num_threads") = 0);

  nb::class_<PyMha>(m, "Module")
      .def(
          "__init__",
          [](PyMha* self, int64_t embed_dim, int64_t num_heads, int64_t num_kv_heads, int64_t kdim, int64_t vdim,
             int64_t qk_proj_dim, int64_t v_proj_dim, int64_t out_dim, bool bias, bool out_proj, float attn_dropout,
             float out_dropout, int causal, int64_t window, int64_t max_seq_len, bool batch_first, uint64_t seed,
             const std::string& dtype, float softcap, bool alibi, bool sinks, bool qk_norm, float qk_norm_eps,
             const std::optional<nb::dict>& rotary) {
            MultiHeadAttentionConfig c = config_of(embed_dim, num_heads, num_kv_heads, kdim, vdim, qk_proj_dim,
                                                   v_proj_dim, out_dim, bias, out_proj, attn_dropout, out_dropout,
                                                   causal, window, max_seq_len, batch_first, dtype);
            apply_variants(c, softcap, alibi, sinks, qk_norm, qk_norm_eps, rotary);
            new (self) PyMha{MultiHeadAttention(c, seed), "", {}};
          },
          nb::arg("embed_dim"), nb::arg("num_heads"), nb::arg("num_kv_heads") = 0, nb::arg("kdim") = 0,
          nb::arg("vdim") = 0, nb::arg("qk_proj_dim") = 0, nb::arg("v_proj_dim") = 0, nb::arg("out_dim") = 0,
          nb::arg("bias") = true, nb::arg("out_proj") = true, nb::arg("attn_dropout") = 0.0f,
          nb::arg("out_dropout") = 0.0f, nb::arg("causal") = 0, nb::arg("window") = 0, nb::arg("max_seq_len") = 0,
          nb::arg("batch_first") = true, nb::arg("seed") = 0, nb::arg("dtype") = "float32", nb::arg("softcap") = 0.0f,
          nb::arg("alibi") = false, nb::arg("sinks") = false, nb::arg("qk_norm") = false,
          nb::arg("qk_norm_eps") = 1e-6f, nb::arg("rotary").none() = nb::none())
      .def_static(
          "from_state_dict",
          [](const std::map<std::string, In>& arrays, int64_t num_heads, int causal, int64_t window,
             int64_t max_seq_len, bool batch_first, float attn_dropout, float out_dropout, const std::string& prefix,
             const std::string& dtype, float softcap, bool alibi, float qk_norm_eps, const std::optional<nb::dict>& rotary) {
            MultiHeadAttentionConfig base;
            // sinks and qk_norm follow the weights (from_state_dict finds them).
            apply_variants(base, softcap, alibi, false, false, qk_norm_eps, rotary);
            base.dtype = dtype_of(dtype);
            base.num_heads = num_heads;
            base.causal = causal_of(causal);
            base.window = window;
            base.max_seq_len = max_seq_len;
            base.batch_first = batch_first;
            base.attn_dropout = attn_dropout;
            base.out_dropout = out_dropout;
            LoadReport report;
            MultiHeadAttention m = MultiHeadAttention::from_state_dict(state_dict_of(arrays), base, &report, prefix);
            return PyMha{std::move(m), report.layout, report.ignored};
          },
          nb::arg("state_dict"), nb::arg("num_heads"), nb::arg("causal") = 0, nb::arg("window") = 0,
          nb::arg("max_seq_len") = 0, nb::arg("batch_first") = true, nb::arg("attn_dropout") = 0.0f,
          nb::arg("out_dropout") = 0.0f, nb::arg("prefix") = "", nb::arg("dtype") = "float32", nb::arg("softcap") = 0.0f,
          nb::arg("alibi") = false, nb::arg("qk_norm_eps") = 1e-6f, nb::arg("rotary").none() = nb::none())
      .def_ro("layout", &PyMha::layout)
      .def_ro("ignored", &PyMha::ignored)
      .def(
          "load_state_dict",
          [](PyMha& self, const std::map<std::string, In>& arrays, const std::string& prefix) {
            const LoadReport r = self.m.load_state_dict(state_dict_of(arrays), prefix);
            return std::make_tuple(r.layout, r.used, r.ignored);
          },
          nb::arg("state_dict"), nb::arg("prefix") = "")
      .def("state_dict",
           [](const PyMha& self) {
             // float32 arrays for every module dtype (16-bit values widen exactly).
             std::map<std::string, Numpy> out;
             for (auto& [name, t] : self.m.state_dict()) {
               Tensor* owner = new Tensor(t.to_f32());
               nb::capsule deleter(owner, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
               std::vector<size_t> shape(owner->shape().begin(), owner->shape().end());
               out.emplace(name, Numpy(owner->data<float>(), shape.size(), shape.data(), deleter));
             }
             return out;
           })
      .def_prop_ro("config", [](const PyMha& self) { return config_dict(self.m.config(), self.m); })
      .def(
          "forward",
          [](const PyMha& self, const In& query, const std::optional<In>& key, const std::optional<In>& value,
             const std::optional<In>& keep_mask, const std::optional<In>& attn_bias,
             const std::optional<In>& key_padding_mask, bool need_weights, bool average_weights, bool training,
             std::optional<int> causal, std::optional<uint64_t> dropout_seed, int num_threads,
             const std::string& backend) {
            auto inputs = [&](auto type_tag) {
              using T = decltype(type_tag);
              BasicMhaInputs<T> in;
              in.query = view_of<const T>(query, "query");
              in.key = optional_view<const T>(key, "key");
              in.value = optional_view<const T>(value, "value");
              in.keep_mask = optional_view<const uint8_t>(keep_mask, "attn_mask");
              in.attn_bias = optional_view<const float>(attn_bias, "attn_mask");
              in.key_padding_mask = optional_view<const uint8_t>(key_padding_mask, "key_padding_mask");
              return in;
            };
            // Every setting travels with the call: the module is shared, never changed here.
            MhaCallOptions options;
            options.need_weights = need_weights;
            options.average_weights = average_weights;
            options.training = training;
            if (causal) options.causal = causal_of(*causal);
            options.dropout_seed = dropout_seed;
            options.num_threads = num_threads;
            options.backend = backend_of(backend);
            MhaOutputs r;
            switch (self.m.config().dtype) {
              case DType::kBF16: {
                const auto in = inputs(bfloat16{});
                nb::gil_scoped_release release;
                r = self.m.forward(in, options);
                break;
              }
              case DType::kF16: {
                const auto in = inputs(float16{});
                nb::gil_scoped_release release;
                r = self.m.forward(in, options);
                break;
              }
              default: {
                const auto in = inputs(float{});
                nb::gil_scoped_release release;
                r = self.m.forward(in, options);
                break;
              }
            }
            nb::object weights = need_weights ? nb::cast(to_numpy(std::move(r.weights))) : nb::none();
            return std::make_tuple(to_numpy(std::move(r.output)), weights);
          },
          nb::arg("query"), nb::arg("key").none() = nb::none(), nb::arg("value").none() = nb::none(),
          nb::arg("keep_mask").none() = nb::none(), nb::arg("attn_bias").none() = nb::none(),
          nb::arg("key_padding_mask").none() = nb::none(), nb::arg("need_weights") = false,
          nb::arg("average_weights") = true, nb::arg("training") = false, nb::arg("causal").none() = nb::none(),
          nb::arg("dropout_seed").none() = nb::none(), nb::arg("num_threads") = 0, nb::arg("backend") = "auto")
      .def(
          "make_cache",
          [](const PyMha& self, int64_t batch, int64_t capacity, const std::string& dtype) {
            return self.m.make_cache(batch, capacity, cache_type_of(dtype, "make_cache"));
          },
          nb::arg("batch"), nb::arg("capacity") = 0, nb::arg("dtype") = "float32")
      .def(
          "step",
          [](const PyMha& self, const In& x, KvCache& cache, const std::vector<int64_t>& new_tokens, int num_threads) {
            MhaCallOptions options;
            options.num_threads = num_threads;
            MhaOutputs r;
            auto run = [&](auto type_tag) {
              using T = decltype(type_tag);
              const View<const T> v = view_of<const T>(x, "x");
              nb::gil_scoped_release release;
              r = self.m.step(v, cache, new_tokens, options);
            };
            switch (self.m.config().dtype) {
              case DType::kBF16: run(bfloat16{}); break;
              case DType::kF16: run(float16{}); break;
              default: run(float{}); break;
            }
            return to_numpy(std::move(r.output));
          },
          nb::arg("x"), nb::arg("cache"), nb::arg("new_tokens") = std::vector<int64_t>(), nb::arg("num_threads") = 0);
}
