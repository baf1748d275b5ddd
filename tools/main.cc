// mha: the command-line tool. `mha demo`, `mha forward`, `mha train`, `mha bench`, `mha --help`.
#include <CLI/CLI.hpp>

#include "tools/cli.h"
#include "tools/commands.h"

namespace {

using mha::cli::RealAbove;
const CLI::Validator kPositive = mha::cli::Positive();
const CLI::Validator kThreads = mha::cli::Threads();

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
  bench->add_option("--csv", ba.csv, "Write the table as CSV (the suite, --train, --decode)");
  bench->add_option("--json", ba.json, "Write the table as JSON (the suite, --train)");
  mha::cli::OneTablePerRun(bench, {"--memory", "--decode", "--train", "--dtypes", "--varlen", "--variants", "--peak"},
                           /*csv_tables=*/{"--train", "--decode"}, /*json_tables=*/{"--train"});

  return mha::cli::ParseAndRun(app, argc, argv, "mha", [&] {
    if (demo->parsed()) return mha::tools::run_demo(demo_threads);
    if (fwd->parsed()) return mha::tools::run_forward(fa);
    if (train->parsed()) return mha::tools::run_train(ta);
    if (info->parsed()) return mha::tools::run_info();
    return mha::tools::run_bench(ba);  // require_subcommand(1): the one left
  });
}
