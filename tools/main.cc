// mha: the command-line tool. `mha demo`, `mha forward`, `mha train`, `mha bench`, `mha --help`.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "mha/attention.h"
#include "mha/error.h"
#include "tools/commands.h"

namespace {

// An integer option in [lo, hi]; `expected` says what in the message, which names the value
// given (CLI11's PositiveNumber prints the whole double range).
CLI::Validator IntegerIn(long long lo, long long hi, const std::string& expected, const std::string& name) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const long long v = std::stoll(value, &used);
          if (used == value.size() && v >= lo && v <= hi) return "";
        } catch (const std::exception&) {
        }
        return "must be " + expected + "; got '" + value + "'";
      },
      name);
}

// A real option in (lo, hi]: finite (CLI11 reads "nan" and "inf" as doubles).
CLI::Validator RealAbove(double lo, double hi, const std::string& name) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && std::isfinite(v) && v > lo && v <= hi) return "";
        } catch (const std::exception&) {
        }
        return fmt::format("must be a number in ({}, {}]; got '{}'", lo, hi, value);
      },
      name);
}

const CLI::Validator kPositive = IntegerIn(1, 2147483647, "a positive integer", "POSITIVE");
const CLI::Validator kThreads =
    IntegerIn(0, mha::kMaxThreads, fmt::format("an integer in [0, {}] (0: all available)", mha::kMaxThreads), "THREADS");

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mha: multi-head attention on the CPU, checked against PyTorch"};
  app.require_subcommand(1);

  int demo_threads = 0;
  CLI::App* demo = app.add_subcommand("demo", "Run the three seed modules on built-in inputs, fast path vs reference");
  demo->add_option("--threads", demo_threads, "Threads (0: all)")->check(kThreads);

  mha::tools::ForwardArgs fa;
  CLI::App* fwd = app.add_subcommand("forward", "Run a MultiHeadAttention module from safetensors files");
  fwd->add_option("--weights", fa.weights, "Module weights (a PyTorch state_dict in safetensors)")->required();
  fwd->add_option("--input", fa.input, "Inputs: x, or query/key/value; optional keep_mask, attn_bias, key_padding_mask")
      ->required();
  fwd->add_option("--output", fa.output, "Where to write output (and attn_weights)")->required();
  fwd->add_option("--heads", fa.heads, "Number of query heads")->required()->check(kPositive);
  fwd->add_option("--kv-heads", fa.kv_heads, "Key/value heads (default: inferred from the weights)")->check(kPositive);
  fwd->add_flag("--causal", fa.causal, "Causal masking");
  fwd->add_option("--causal-align", fa.causal_align, "top-left (PyTorch SDPA) or bottom-right (FlashAttention)")
      ->check(CLI::IsMember({"top-left", "bottom-right"}));
  fwd->add_flag("--need-weights", fa.need_weights, "Also write attn_weights, per head (B, H, T, S)");
  fwd->add_flag("--average-weights", fa.average_weights, "With --need-weights: average over heads, (B, T, S)");
  fwd->add_option("--prefix", fa.prefix, "Name prefix of the module inside the weights file");
  fwd->add_flag("--seq-first", fa.seq_first, "Inputs are (T, B, E), PyTorch's batch_first=False");
  fwd->add_flag("--reference", fa.reference, "Use the plain double-accumulating reference path");
  fwd->add_option("--threads", fa.threads, "Threads (0: all)")->check(kThreads);

  mha::tools::TrainArgs ta;
  CLI::App* train = app.add_subcommand("train", "Train a small GPT built from mha layers to reverse digit sequences");
  train->add_option("--length", ta.length, "Digits per sequence")->check(CLI::Range(1, 64));
  train->add_option("--steps", ta.steps, "Most training steps (stops at 99% token accuracy)")->check(kPositive);
  train->add_option("--lr", ta.lr, "Adam learning rate")->check(RealAbove(0, 1, "LR"));
  train->add_option("--seed", ta.seed, "Seed of the weights and the data");
  train->add_option("--threads", ta.threads, "Threads (0: all)")->check(kThreads);

  CLI::App* info = app.add_subcommand("info", "Print this CPU's SIMD features and the kernels that run on it");

  mha::tools::BenchArgs ba;
  CLI::App* bench = app.add_subcommand("bench", "Benchmark attention and the module (GFLOP/s, % of measured peak)");
  bench->add_option("--threads", ba.threads, "Threads (default 2; 0: all available)")->check(kThreads);
  bench->add_option("--seconds", ba.seconds, "Measuring time per case")->check(RealAbove(0, 3600, "SECONDS"));
  bench->add_flag("--sweep", ba.sweep, "Also sweep the sequence length");
  bench->add_flag("--memory", ba.memory, "Only measure the peak memory of (1, 8, 32768, 64) attention");
  bench->add_flag("--decode", ba.decode, "Only the decoding table (KV caches against memory bandwidth)");
  bench->add_flag("--train", ba.train, "Only the training table (attention backward, forward + backward, module steps)");
  bench->add_flag("--dtypes", ba.dtypes, "Only the dtype table: float32, bfloat16 and float16 side by side");
  bench->add_flag("--varlen", ba.varlen, "Only the variable-length table: packed, one by one and padded");
  bench->add_flag("--variants", ba.variants, "Only the score-variant table: softcap, ALiBi, sinks against plain");
  bench->add_flag("--peak", ba.peak, "Only measure this machine's fp32 FMA peak (bench/peers.sh reads it)");
  CLI::Option* csv = bench->add_option("--csv", ba.csv, "Write the table as CSV (the suite, --train, --decode)");
  CLI::Option* json = bench->add_option("--json", ba.json, "Write the table as JSON (the suite, --train)");
  // One table per run, and --csv / --json only where the table writes them: never silently ignored.
  const std::vector<std::string> modes = {"--memory", "--decode", "--train", "--dtypes", "--varlen", "--variants",
                                          "--peak"};
  for (size_t i = 0; i < modes.size(); ++i) {
    for (size_t j = i + 1; j < modes.size(); ++j) bench->get_option(modes[i])->excludes(modes[j]);
    bench->get_option("--sweep")->excludes(modes[i]);  // the suite's alone
    if (modes[i] != "--train" && modes[i] != "--decode") csv->excludes(modes[i]);
    if (modes[i] != "--train") json->excludes(modes[i]);
  }

  // Usage errors exit with 1, as every other error (CLI11's own codes are 100 and up); --help
  // prints and exits with 0. Arguments quoted in messages are made printable.
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "mha: error: %s (see mha --help)\n", mha::printable(e.what()).c_str());
    return 1;
  }
  try {
    if (demo->parsed()) return mha::tools::run_demo(demo_threads);
    if (fwd->parsed()) return mha::tools::run_forward(fa);
    if (train->parsed()) return mha::tools::run_train(ta);
    if (info->parsed()) return mha::tools::run_info();
    if (bench->parsed()) return mha::tools::run_bench(ba);
  } catch (const mha::Error& e) {
    std::fprintf(stderr, "mha: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mha: error: %s\n", mha::printable(e.what()).c_str());
    return 1;
  }
  return 0;
}
