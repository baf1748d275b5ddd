// mha._mha's Module class: MultiHeadAttention with its configuration, weights, forward and
// step (see mha_ext.cc).
#include "ext_common.h"

namespace mha::python {
namespace {

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
                    const std::optional<nb::dict>& rotary, int64_t sink_tokens) {
  c.softcap = softcap;
  c.sink_tokens = sink_tokens;
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
  d["sink_tokens"] = c.sink_tokens;
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

void bind_module(nb::module_& m) {
  nb::class_<PyMha>(m, "Module")
      .def(
          "__init__",
          [](PyMha* self, int64_t embed_dim, int64_t num_heads, int64_t num_kv_heads, int64_t kdim, int64_t vdim,
             int64_t qk_proj_dim, int64_t v_proj_dim, int64_t out_dim, bool bias, bool out_proj, float attn_dropout,
             float out_dropout, int causal, int64_t window, int64_t max_seq_len, bool batch_first, uint64_t seed,
             const std::string& dtype, float softcap, bool alibi, bool sinks, bool qk_norm, float qk_norm_eps,
             const std::optional<nb::dict>& rotary, int64_t sink_tokens) {
            MultiHeadAttentionConfig c = config_of(embed_dim, num_heads, num_kv_heads, kdim, vdim, qk_proj_dim,
                                                   v_proj_dim, out_dim, bias, out_proj, attn_dropout, out_dropout,
                                                   causal, window, max_seq_len, batch_first, dtype);
            apply_variants(c, softcap, alibi, sinks, qk_norm, qk_norm_eps, rotary, sink_tokens);
            new (self) PyMha{MultiHeadAttention(c, seed), "", {}};
          },
          nb::arg("embed_dim"), nb::arg("num_heads"), nb::arg("num_kv_heads") = 0, nb::arg("kdim") = 0,
          nb::arg("vdim") = 0, nb::arg("qk_proj_dim") = 0, nb::arg("v_proj_dim") = 0, nb::arg("out_dim") = 0,
          nb::arg("bias") = true, nb::arg("out_proj") = true, nb::arg("attn_dropout") = 0.0f,
          nb::arg("out_dropout") = 0.0f, nb::arg("causal") = 0, nb::arg("window") = 0, nb::arg("max_seq_len") = 0,
          nb::arg("batch_first") = true, nb::arg("seed") = 0, nb::arg("dtype") = "float32", nb::arg("softcap") = 0.0f,
          nb::arg("alibi") = false, nb::arg("sinks") = false, nb::arg("qk_norm") = false,
          nb::arg("qk_norm_eps") = 1e-6f, nb::arg("rotary").none() = nb::none(), nb::arg("sink_tokens") = 0)
      .def_static(
          "from_state_dict",
          [](const std::map<std::string, In>& arrays, int64_t num_heads, int causal, int64_t window,
             int64_t max_seq_len, bool batch_first, float attn_dropout, float out_dropout, const std::string& prefix,
             const std::string& dtype, float softcap, bool alibi, float qk_norm_eps, const std::optional<nb::dict>& rotary,
             int64_t sink_tokens) {
            MultiHeadAttentionConfig base;
            // sinks and qk_norm follow the weights (from_state_dict finds them).
            apply_variants(base, softcap, alibi, false, false, qk_norm_eps, rotary, sink_tokens);
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
          nb::arg("alibi") = false, nb::arg("qk_norm_eps") = 1e-6f, nb::arg("rotary").none() = nb::none(),
          nb::arg("sink_tokens") = 0)
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

}  // namespace mha::python
