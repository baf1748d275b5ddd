// mha._mha: the nanobind extension under the Python package (python/mha/). It exposes the C++
// library with the least policy: arrays arrive as nanobind ndarrays (numpy through the buffer
// protocol or DLPack, torch through DLPack), any strides, never copied; outputs are written into
// arrays the Python layer allocated, or returned as numpy arrays that own the C++ tensor.
// Semantics (torch's argument conventions, broadcasting, kinds) live in python/mha/*.py.
#include "ext_common.h"

namespace mha::python {
namespace {

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
                  const std::optional<In>& alibi_slopes, const std::optional<In>& sinks, int64_t sink_tokens) {
  const AttentionOptions opt =
      options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, backend, softcap, sink_tokens);
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
                    const std::optional<Out>& grad_sinks, const std::optional<Out>& grad_attn_bias,
                    const AttentionOptions& opt) {
  const BasicAttentionInputs<T> in = inputs_of<T>(q, k, v, keep_mask, attn_bias, key_lengths, score);
  const BasicAttentionInputGrads<T> g{view_of<T>(dq, "grad_query"), view_of<T>(dk, "grad_key"),
                                      view_of<T>(dv, "grad_value"), optional_view<float>(grad_sinks, "grad_sinks"),
                                      optional_view<float>(grad_attn_bias, "grad_attn_bias")};
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
                           const std::optional<Out>& grad_sinks, int64_t sink_tokens,
                           const std::optional<Out>& grad_attn_bias) {
  const AttentionOptions opt =
      options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, backend, softcap, sink_tokens);
  const ScoreInputs score{alibi_slopes, sinks};
  switch (element_type(q, k, v)) {
    case DType::kBF16:
      return backward_typed<bfloat16>(q, k, v, out, lse, grad_out, dq, dk, dv, keep_mask, attn_bias, key_lengths, score,
                                      grad_sinks, grad_attn_bias, opt);
    case DType::kF16:
      return backward_typed<float16>(q, k, v, out, lse, grad_out, dq, dk, dv, keep_mask, attn_bias, key_lengths, score,
                                     grad_sinks, grad_attn_bias, opt);
    default:
      return backward_typed<float>(q, k, v, out, lse, grad_out, dq, dk, dv, keep_mask, attn_bias, key_lengths, score,
                                   grad_sinks, grad_attn_bias, opt);
  }
}

// --- varlen_attention -------------------------------------------------------------------------------

template <typename T>
BasicVarlenInputs<T> varlen_inputs_of(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k,
                                      const std::optional<In>& alibi_slopes) {
  return {view_of<const T>(q, "q"),
          view_of<const T>(k, "k"),
          view_of<const T>(v, "v"),
          view_of<const int64_t>(cu_q, "cu_seqlens_q"),
          view_of<const int64_t>(cu_k, "cu_seqlens_k"),
          optional_view<const float>(alibi_slopes, "alibi_slopes")};
}

template <typename T>
void varlen_typed(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const Out& out,
                  const Out& lse, const std::optional<In>& alibi_slopes, const AttentionOptions& opt) {
  const BasicVarlenInputs<T> in = varlen_inputs_of<T>(q, k, v, cu_q, cu_k, alibi_slopes);
  const View<T> o = view_of<T>(out, "out");
  const View<float> l = view_of<float>(lse, "lse");
  nb::gil_scoped_release release;
  varlen_attention(in, o, l, opt);
}

void merge_py(const Out& out, const Out& lse, const In& part_out, const In& part_lse, int num_threads) {
  const View<float> o = view_of<float>(out, "out"), l = view_of<float>(lse, "lse");
  const View<const float> po = view_of<const float>(part_out, "part_out"), pl = view_of<const float>(part_lse, "part_lse");
  nb::gil_scoped_release release;
  merge_attention(o, l, po, pl, num_threads);
}

void varlen_py(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const Out& out, const Out& lse,
               std::optional<float> scale, int causal, int64_t window, float dropout_p, uint64_t dropout_seed,
               int num_threads, float softcap, const std::optional<In>& alibi_slopes) {
  const AttentionOptions opt =
      options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, "auto", softcap);
  switch (element_type(q, k, v)) {
    case DType::kBF16: return varlen_typed<bfloat16>(q, k, v, cu_q, cu_k, out, lse, alibi_slopes, opt);
    case DType::kF16: return varlen_typed<float16>(q, k, v, cu_q, cu_k, out, lse, alibi_slopes, opt);
    default: return varlen_typed<float>(q, k, v, cu_q, cu_k, out, lse, alibi_slopes, opt);
  }
}

template <typename T>
void varlen_backward_typed(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const In& out,
                           const In& lse, const In& grad_out, const Out& dq, const Out& dk, const Out& dv,
                           const std::optional<In>& alibi_slopes, const AttentionOptions& opt) {
  const BasicVarlenInputs<T> in = varlen_inputs_of<T>(q, k, v, cu_q, cu_k, alibi_slopes);
  const BasicVarlenGrads<T> g{view_of<T>(dq, "grad_q"), view_of<T>(dk, "grad_k"), view_of<T>(dv, "grad_v")};
  const View<const T> o = view_of<const T>(out, "out"), go = view_of<const T>(grad_out, "grad_out");
  const View<const float> l = view_of<const float>(lse, "lse");
  nb::gil_scoped_release release;
  varlen_attention_backward(in, o, l, go, g, opt);
}

void varlen_backward_py(const In& q, const In& k, const In& v, const In& cu_q, const In& cu_k, const In& out,
                        const In& lse, const In& grad_out, const Out& dq, const Out& dk, const Out& dv,
                        std::optional<float> scale, int causal, int64_t window, float dropout_p, uint64_t dropout_seed,
                        int num_threads, float softcap, const std::optional<In>& alibi_slopes) {
  const AttentionOptions opt =
      options_of(scale, causal, window, dropout_p, dropout_seed, num_threads, "auto", softcap);
  switch (element_type(q, k, v)) {
    case DType::kBF16:
      return varlen_backward_typed<bfloat16>(q, k, v, cu_q, cu_k, out, lse, grad_out, dq, dk, dv, alibi_slopes, opt);
    case DType::kF16:
      return varlen_backward_typed<float16>(q, k, v, cu_q, cu_k, out, lse, grad_out, dq, dk, dv, alibi_slopes, opt);
    default:
      return varlen_backward_typed<float>(q, k, v, cu_q, cu_k, out, lse, grad_out, dq, dk, dv, alibi_slopes, opt);
  }
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
        nb::arg("sinks").none() = nb::none(), nb::arg("sink_tokens") = 0);
  m.def("attention_backward", &attention_backward_py, nb::arg("query"), nb::arg("key"), nb::arg("value"),
        nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"), nb::arg("grad_query"), nb::arg("grad_key"),
        nb::arg("grad_value"), nb::arg("keep_mask").none() = nb::none(), nb::arg("attn_bias").none() = nb::none(),
        nb::arg("key_lengths").none() = nb::none(), nb::arg("scale").none() = nb::none(), nb::arg("causal") = 0,
        nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0, nb::arg("num_threads") = 0,
        nb::arg("backend") = "auto", nb::arg("softcap") = 0.0f, nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("sinks").none() = nb::none(), nb::arg("grad_sinks").none() = nb::none(), nb::arg("sink_tokens") = 0,
        nb::arg("grad_attn_bias").none() = nb::none());

  m.def("merge_attention", &merge_py, nb::arg("out"), nb::arg("lse"), nb::arg("part_out"), nb::arg("part_lse"),
        nb::arg("num_threads") = 0);
  m.def("varlen_attention", &varlen_py, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("out"), nb::arg("lse"), nb::arg("scale").none() = nb::none(),
        nb::arg("causal") = 0, nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0,
        nb::arg("num_threads") = 0, nb::arg("softcap") = 0.0f, nb::arg("alibi_slopes").none() = nb::none());
  m.def("varlen_attention_backward", &varlen_backward_py, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"),
        nb::arg("grad_q"), nb::arg("grad_k"), nb::arg("grad_v"), nb::arg("scale").none() = nb::none(),
        nb::arg("causal") = 0, nb::arg("window") = 0, nb::arg("dropout_p") = 0.0f, nb::arg("dropout_seed") = 0,
        nb::arg("num_threads") = 0, nb::arg("softcap") = 0.0f, nb::arg("alibi_slopes").none() = nb::none());

  mha::python::bind_caches(m);
  mha::python::bind_module(m);
}
