// `mha bench --dtypes`: the same work in float32, bfloat16 and float16, side by side — attention
// forward and backward, the module forward, and decoding — with the 16-bit columns as speed
// ratios over float32. 16-bit inputs hold the float32 benchmark values rounded.
#include <fmt/format.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/suite.h"
#include "mha/attention.h"
#include "mha/multi_head_attention.h"

namespace mha::bench {
namespace {

const DType kDtypes[3] = {DType::kF32, DType::kBF16, DType::kF16};

Tensor filled(std::vector<int64_t> shape, float scale, DType t) {
  Tensor f(DType::kF32, std::move(shape));
  float* p = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) p[i] = scale * static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
  return f.converted(t);
}

template <typename T>
double time_attention(const AttentionCase& c, int threads, double seconds, bool backward) {
  const DType t = DTypeOf<T>::value;
  const Tensor q = filled({c.B, c.H, c.Tq, c.D}, 1.0f, t), k = filled({c.B, c.Hkv, c.Tk, c.D}, 0.1f, t);
  const Tensor v = filled({c.B, c.Hkv, c.Tk, c.Dv}, 1.0f, t);
  Tensor out(t, {c.B, c.H, c.Tq, c.Dv}), lse(DType::kF32, {c.B, c.H, c.Tq});
  AttentionOptions opt;
  opt.num_threads = threads;
  opt.causal = c.causal ? (c.Tq == 1 ? Causal::kBottomRight : Causal::kTopLeft) : Causal::kNone;
  const BasicAttentionInputs<T> in{q.view<T>(), k.view<T>(), v.view<T>()};
  attention(in, BasicAttentionOutputs<T>{out.view<T>(), lse.view<float>()}, opt);
  if (!backward) {
    return time_calls([&] { attention(in, BasicAttentionOutputs<T>{out.view<T>()}, opt); }, seconds);
  }
  const Tensor dout = filled({c.B, c.H, c.Tq, c.Dv}, 1.0f, t);
  Tensor dq(t, q.shape()), dk(t, k.shape()), dv(t, v.shape());
  const BasicAttentionInputGrads<T> g{dq.view<T>(), dk.view<T>(), dv.view<T>()};
  return time_calls([&] { attention_backward(in, out.view<T>(), lse.view<float>(), dout.view<T>(), g, opt); },
                    seconds);
}

template <typename T>
double time_module(const ModuleCase& c, int threads, double seconds) {
  MultiHeadAttentionConfig config;
  config.embed_dim = c.E;
  config.num_heads = c.H;
  config.dtype = DTypeOf<T>::value;
  MultiHeadAttention m(config, 1);
  MhaCallOptions options;
  options.num_threads = threads;
  const Tensor x = filled({c.B, c.T, c.E}, 1.0f, config.dtype);
  BasicMhaInputs<T> in;
  in.query = x.view<T>();
  return time_calls([&] { m.forward(in, options); }, seconds);
}

double by_dtype(DType t, const std::function<double(DType)>& f) { return f(t); }

}  // namespace

void run_dtypes(const Options& o) {
  struct Case {
    std::string suite, name;
    double work;       // flops, or bytes for decode
    bool bytes;
    std::function<double(DType)> time;
  };
  std::vector<Case> cases;
  auto attention_case = [&](const char* suite, AttentionCase c, bool backward) {
    const double work = backward ? c.backward_flops() : c.flops();
    cases.push_back({suite, fmt::format("({}, {}/{}, {}, {}){}", c.B, c.H, c.Hkv, c.Tq, c.D, c.causal ? " causal" : ""),
                     work, false, [=](DType t) {
                       switch (t) {
                         case DType::kBF16: return time_attention<bfloat16>(c, o.threads, o.seconds, backward);
                         case DType::kF16: return time_attention<float16>(c, o.threads, o.seconds, backward);
                         default: return time_attention<float>(c, o.threads, o.seconds, backward);
                       }
                     }});
  };
  for (const AttentionCase& c : {AttentionCase{"", 4, 12, 12, 512, 512, 64, 64, false},
                                 AttentionCase{"", 1, 8, 8, 4096, 4096, 64, 64, false},
                                 AttentionCase{"", 1, 16, 16, 2048, 2048, 128, 128, true},
                                 AttentionCase{"", 8, 12, 12, 128, 128, 64, 64, false}}) {
    attention_case("forward", c, false);
  }
  attention_case("backward", AttentionCase{"", 1, 8, 8, 2048, 2048, 64, 64, true}, true);
  for (const ModuleCase& c : standard_module_cases()) {
    if (c.T < 128) continue;
    cases.push_back({"module", c.name, c.flops(), false, [=](DType t) {
                       switch (t) {
                         case DType::kBF16: return time_module<bfloat16>(c, o.threads, o.seconds);
                         case DType::kF16: return time_module<float16>(c, o.threads, o.seconds);
                         default: return time_module<float>(c, o.threads, o.seconds);
                       }
                     }});
  }
  for (int64_t mib : {16, 256}) {
    // GQA 32/8, D = 128; L set by the float32 cache size (the 16-bit caches hold the same L).
    const int64_t L = mib * (1 << 20) / (8 * 2 * 128 * 4);
    const AttentionCase c{"", 1, 32, 8, 1, L, 128, 128, true};
    const double bytes = 2.0 * 8 * L * 128;  // elements of K and V; times the element size below
    cases.push_back({"decode", fmt::format("gqa 32/8 L={}", L), bytes, true, [=](DType t) {
                       switch (t) {
                         case DType::kBF16: return time_attention<bfloat16>(c, o.threads, o.seconds, false);
                         case DType::kF16: return time_attention<float16>(c, o.threads, o.seconds, false);
                         default: return time_attention<float>(c, o.threads, o.seconds, false);
                       }
                     }});
  }
  fmt::print("threads {}; forward/backward/module: GFLOP/s; decode: GB/s of K and V read\n", o.threads);
  fmt::print("{:<9} {:<26} {:>10} {:>9} {:>10} {:>9} {:>7} {:>10} {:>9} {:>7}\n", "suite", "case", "fp32 ms", "rate",
             "bf16 ms", "rate", "×fp32", "fp16 ms", "rate", "×fp32");
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::fprintf(stderr, "[%zu/%zu] %s %s ...\n", i + 1, cases.size(), c.suite.c_str(), c.name.c_str());
    double s[3];
    for (int d = 0; d < 3; ++d) s[d] = by_dtype(kDtypes[d], c.time);
    auto rate = [&](int d) {
      const double work = c.bytes ? c.work * static_cast<double>(dtype_size(kDtypes[d])) : c.work;
      return work / s[d] / 1e9;
    };
    fmt::print("{:<9} {:<26} {:>10.3f} {:>9.1f} {:>10.3f} {:>9.1f} {:>6.2f}x {:>10.3f} {:>9.1f} {:>6.2f}x\n", c.suite,
               c.name, s[0] * 1e3, rate(0), s[1] * 1e3, rate(1), s[0] / s[1], s[2] * 1e3, rate(2), s[0] / s[2]);
  }
}

}  // namespace mha::bench
