// `mha bench --variants`: softcap, ALiBi and sinks against plain attention at one shape, and
// rotary embeddings and QK-norm inside the module (see suite.h).
#include <fmt/format.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

#include "bench/suite.h"
#include "mha/attention.h"
#include "mha/multi_head_attention.h"

namespace mha::bench {
namespace {

// Per call of f, the medians over calls for `seconds`: wall seconds, and the process's CPU
// seconds (all threads). CPU time leaves out what the hypervisor's neighbours take (steal): on
// the shared project VM, wall-clock ratios of equal work moved by ±11% between runs (a sinks
// forward — plain work plus one fold per row — read 89% of plain), so the ratios use CPU time.
struct CallTime {
  double wall, cpu;
};

CallTime time_call(const std::function<void()>& f, double seconds) {
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  f();  // warm-up
  std::vector<double> wall, cpu;
  double total = 0;
  while (total < seconds || wall.size() < 3) {
    const double c0 = cpu_now();
    const auto w0 = std::chrono::steady_clock::now();
    f();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count());
    cpu.push_back(cpu_now() - c0);
    total += wall.back();
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

}  // namespace

void run_variants(const Options& o) {
  struct Variant {
    const char* name;
    bool softcap, alibi, sinks;
  };
  const Variant variants[] = {{"plain", false, false, false}, {"softcap 50", true, false, false},
                              {"alibi", false, true, false},  {"sinks", false, false, true},
                              {"all three", true, true, true}};
  // Prefill (forward, backward) at a Llama-style GQA shape, and one decode step over 8192 keys.
  const int64_t B = 1, Hq = 32, Hkv = 8, T = 2048, D = 128, L = 8192;
  auto slopes_for = [](int64_t H) {
    Tensor t(DType::kF32, {H});
    for (int64_t h = 0; h < H; ++h) t.data<float>()[h] = std::exp2(-8.0f * static_cast<float>(h + 1) / H);
    return t;
  };
  const Tensor slopes = slopes_for(Hq), sinks = filled({Hq}, 0.5f);
  const Tensor q = filled({B, Hq, T, D}, 0.5f), k = filled({B, Hkv, T, D}, 0.25f), v = filled({B, Hkv, T, D}, 1.0f);
  const Tensor dout = filled({B, Hq, T, D}, 1.0f);
  Tensor out(DType::kF32, {B, Hq, T, D}), lse(DType::kF32, {B, Hq, T});
  Tensor dq(DType::kF32, {B, Hq, T, D}), dk(DType::kF32, {B, Hkv, T, D}), dv(DType::kF32, {B, Hkv, T, D});
  Tensor dsinks(DType::kF32, {Hq});
  const Tensor q1 = filled({B, Hq, 1, D}, 0.5f), kc = filled({B, Hkv, L, D}, 0.25f), vc = filled({B, Hkv, L, D}, 1.0f);
  Tensor out1(DType::kF32, {B, Hq, 1, D});
  const AttentionCase c{"", B, Hq, Hkv, T, T, D, D, true};
  fmt::print("threads {}; causal prefill (B, Hq, Hkv, T, D) = ({}, {}, {}, {}, {}); decode: 1 token against {} keys\n",
             o.threads, B, Hq, Hkv, T, D, L);
  fmt::print("{:<12} {:>10} {:>8} {:>8} {:>10} {:>8} {:>8} {:>11} {:>8}\n", "", "fwd ms", "GFLOP/s", "% plain",
             "bwd ms", "GFLOP/s", "% plain", "decode µs", "% plain");
  // Timings on a shared VM drift by 10-40% within minutes: every variant is measured right after
  // plain in each of eleven rounds; reported are the fastest round's wall time of each and the
  // median over the rounds of the ratio of CPU times (time_call) within a round — the fastest
  // rounds of two variants could be minutes apart, and their ratio moved by ±10% from run to run
  // — except for decoding, whose steps are too short for CPU time to mean anything (threads
  // spinning between regions count): wall.
  constexpr int kRounds = 11;
  constexpr size_t kVariants = sizeof(variants) / sizeof(variants[0]);
  std::vector<CallTime> times[kVariants][3];
  auto best = [](const std::vector<CallTime>& v) {  // the fastest round's wall time
    double x = v[0].wall;
    for (const CallTime& t : v) x = std::min(x, t.wall);
    return x;
  };
  auto wall_ratio = [&](const std::vector<CallTime>& base, const std::vector<CallTime>& v) { return best(base) / best(v); };
  auto ratio = [](const std::vector<CallTime>& base, const std::vector<CallTime>& v) {  // of CPU time
    std::vector<double> r;
    for (size_t i = 0; i < base.size(); ++i) r.push_back(base[i].cpu / v[i].cpu);
    std::sort(r.begin(), r.end());
    return r[r.size() / 2];
  };
  for (int round = 0; round < kRounds; ++round) {
  for (size_t vi = 0; vi < kVariants; ++vi) {
    const Variant& var = variants[vi];
    AttentionOptions opt;
    opt.num_threads = o.threads;
    opt.causal = Causal::kBottomRight;
    opt.softcap = var.softcap ? 50.0f : 0.0f;
    AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
    if (var.alibi) in.alibi_slopes = slopes.view<float>();
    if (var.sinks) in.sinks = sinks.view<float>();
    const CallTime f = time_call([&] { attention(in, {out.view<float>(), lse.view<float>()}, opt); }, o.seconds);
    const AttentionInputGrads g{dq.view<float>(), dk.view<float>(), dv.view<float>(),
                                var.sinks ? dsinks.view<float>() : View<float>()};
    const CallTime b = time_call(
        [&] { attention_backward(in, out.view<float>(), lse.view<float>(), dout.view<float>(), g, opt); }, o.seconds);
    AttentionInputs dec{q1.view<float>(), kc.view<float>(), vc.view<float>()};
    dec.alibi_slopes = in.alibi_slopes;
    dec.sinks = in.sinks;
    const CallTime d = time_call([&] { attention(dec, {out1.view<float>()}, opt); }, o.seconds);
    times[vi][0].push_back(f);
    times[vi][1].push_back(b);
    times[vi][2].push_back(d);
  }
  }
  // Rotary embeddings and QK-norm inside the module at gpt2-512 (B = 4, T = 512, E = 768, 12
  // heads, causal): inference forward and a training step (forward + backward).
  struct ModuleVariant {
    const char* name;
    bool rotary, qk_norm;
  };
  // "plain, again": the same module as plain, measured second in each round — the control
  // that shows what the ratios read for equal work (the noise floor of this measurement).
  const ModuleVariant module_variants[] = {
      {"plain", false, false}, {"plain, again", false, false}, {"rotary", true, false}, {"rotary + qk-norm", true, true}};
  constexpr size_t kModuleVariants = sizeof(module_variants) / sizeof(module_variants[0]);
  const int64_t MB = 4, MT = 512, ME = 768;
  const Tensor mx = filled({MB, MT, ME}, 1.0f), mr = filled({MB, MT, ME}, 1.0f);
  std::vector<CallTime> mtimes[kModuleVariants][2];
  for (int round = 0; round < kRounds; ++round) {
    for (size_t vi = 0; vi < kModuleVariants; ++vi) {
      MultiHeadAttentionConfig config;
      config.embed_dim = ME;
      config.num_heads = 12;
      config.causal = Causal::kTopLeft;
      if (module_variants[vi].rotary) config.rotary.dims = ME / 12;
      config.qk_norm = module_variants[vi].qk_norm;
      MultiHeadAttention m(config, 1);
      MhaCallOptions options;
      options.num_threads = o.threads;
      MhaInputs in;
      in.query = mx.view<float>();
      const CallTime f = time_call([&] { m.forward(in, options); }, o.seconds);
      options.training = true;
      MhaParamGrads grads = m.make_grads();
      const CallTime t = time_call(
          [&] {
            MhaTape tape;
            m.forward(in, options, &tape);
            m.backward(tape, mr.view<float>(), &grads, options);
          },
          o.seconds);
      mtimes[vi][0].push_back(f);
      mtimes[vi][1].push_back(t);
    }
  }
  for (size_t vi = 0; vi < kVariants; ++vi) {
    const double f = best(times[vi][0]), b = best(times[vi][1]), d = best(times[vi][2]);
    fmt::print("{:<12} {:>10.2f} {:>8.1f} {:>7.1f}% {:>10.2f} {:>8.1f} {:>7.1f}% {:>11.1f} {:>7.1f}%\n", variants[vi].name,
               f * 1e3, c.flops() / f / 1e9, 100 * ratio(times[0][0], times[vi][0]), b * 1e3,
               c.backward_flops() / b / 1e9, 100 * ratio(times[0][1], times[vi][1]), d * 1e6,
               100 * wall_ratio(times[0][2], times[vi][2]));
  }
  fmt::print("\nmodule at gpt2-512 (B, T, E, H) = ({}, {}, {}, 12), causal; rotary on all 64 head dims\n", MB, MT, ME);
  fmt::print("{:<18} {:>12} {:>12} {:>16} {:>12}\n", "", "forward ms", "cost", "train step ms", "cost");
  for (size_t vi = 0; vi < kModuleVariants; ++vi) {
    fmt::print("{:<18} {:>12.2f} {:>11.1f}% {:>16.2f} {:>11.1f}%\n", module_variants[vi].name,
               best(mtimes[vi][0]) * 1e3, 100 * (1 / ratio(mtimes[0][0], mtimes[vi][0]) - 1),
               best(mtimes[vi][1]) * 1e3, 100 * (1 / ratio(mtimes[0][1], mtimes[vi][1]) - 1));
  }
}

}  // namespace mha::bench
