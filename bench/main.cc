// mha_bench: the benchmark binary. With libtorch (-DMHA_TORCH_DIR=...), every case is also run
// on PyTorch in the same process and the table shows the ratio.
#include <CLI/CLI.hpp>

#include <algorithm>

#include "bench/suite.h"
#include "tools/cli.h"

namespace mha::bench {
#ifdef MHA_WITH_TORCH
Peer torch_peer();
#endif
}  // namespace mha::bench

int main(int argc, char** argv) {
  CLI::App app{"mha_bench: attention and module throughput against this machine's peak and PyTorch"};
  mha::bench::Options o;
  bool sweep = false, memory = false, decode = false, train = false;
  app.add_option("--threads", o.threads, "Threads for mha and the peer (default 2; 0: all available)")
      ->check(mha::cli::Threads());
  app.add_option("--seconds", o.seconds, "Measuring time per case and implementation")
      ->check(mha::cli::RealAbove(0, 3600, "SECONDS"));
  app.add_option("--csv", o.csv, "Write the table as CSV (the suite, --train, --decode)");
  app.add_option("--json", o.json, "Write the table as JSON, input of bench/plot.py (the suite, --train)");
  app.add_flag("--sweep", sweep, "Also sweep the sequence length (for the plot)");
  app.add_flag("--memory", memory, "Only measure the peak memory of (1, 8, 32768, 64) attention");
  app.add_flag("--decode", decode, "Only the decoding table (KV caches of 1 to 256 MiB against memory bandwidth)");
  app.add_flag("--train", train, "Only the training table (attention backward, forward + backward, module steps)");
  mha::cli::OneTablePerRun(&app, {"--memory", "--decode", "--train"}, /*csv_tables=*/{"--train", "--decode"},
                           /*json_tables=*/{"--train"});
  return mha::cli::ParseAndRun(app, argc, argv, "mha_bench", [&] {
    mha::bench::resolve_options(o);
    if (memory) {
      mha::bench::memory_check(o.threads, false);
      mha::bench::memory_check(o.threads, true);
      return 0;
    }
#ifdef MHA_WITH_TORCH
    const mha::bench::Peer torch = mha::bench::torch_peer();
    const mha::bench::Peer* peer = &torch;
#else
    const mha::bench::Peer* peer = nullptr;
#endif
    if (decode) {
      mha::bench::run_decode(o, peer);
      mha::bench::run_cache_types(o);
      return 0;
    }
    const double peak = mha::bench::measure_peak_gflops(o.threads);
    const auto rows = train ? mha::bench::run_training(o, peer) : mha::bench::run_suites(o, peer, sweep);
    // Measured again after the suite; the larger is the machine's peak.
    mha::bench::report(rows, std::max(peak, mha::bench::measure_peak_gflops(o.threads)), o, peer);
    return 0;
  });
}
