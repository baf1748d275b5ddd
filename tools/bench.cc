// mha bench: the benchmark suite without a peer (mha_bench built with libtorch adds PyTorch).
#include <algorithm>
#include <cstdio>

#include "bench/suite.h"
#include "tools/commands.h"

namespace mha::tools {

int run_bench(const BenchArgs& args) {
  bench::Options o;
  o.csv = args.csv;
  o.json = args.json;
  o.threads = args.threads;
  o.seconds = args.seconds;
  bench::resolve_options(o);  // 0 threads: all available, as everywhere else
  if (args.peak) {
    const double peak = std::max(bench::measure_peak_gflops(o.threads), bench::measure_peak_gflops(o.threads));
    const double bf16 = std::max(bench::measure_bf16_peak_gflops(o.threads), bench::measure_bf16_peak_gflops(o.threads));
    std::printf("fp32 FMA peak: %.1f GFLOP/s on %d threads\n", peak, o.threads);
    std::printf("bf16 dot-product peak: %.1f GFLOP/s on %d threads (0: no AVX512-BF16)\n", bf16, o.threads);
    const double amx = std::max(bench::measure_amx_bf16_peak_gflops(o.threads),
                                bench::measure_amx_bf16_peak_gflops(o.threads));
    std::printf("bf16 AMX tile peak: %.1f GFLOP/s on %d threads (0: no AMX-BF16 or no tile state)\n", amx, o.threads);
    return 0;
  }
  if (args.dtypes) {
    bench::run_dtypes(o);
    return 0;
  }
  if (args.variants) {
    bench::run_variants(o);
    return 0;
  }
  if (args.varlen) {
    bench::run_varlen(o);
    return 0;
  }
  if (args.decode) {
    bench::run_decode(o, nullptr);
    bench::run_cache_types(o);
    return 0;
  }
  if (args.memory) {
    bench::memory_check(o.threads, false);
    bench::memory_check(o.threads, true);
    return 0;
  }
  const double peak = bench::measure_peak_gflops(o.threads);
  const auto rows = args.train ? bench::run_training(o, nullptr) : bench::run_suites(o, nullptr, args.sweep);
  // Measured again after the suite; the larger is the machine's peak.
  bench::report(rows, std::max(peak, bench::measure_peak_gflops(o.threads)), o, nullptr);
  std::printf("(PyTorch columns: bench/run.sh builds mha_bench with libtorch; see README.md, Speed)\n");
  return 0;
}

}  // namespace mha::tools
