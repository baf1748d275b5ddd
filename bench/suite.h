// The benchmark suite shared by `mha bench` and the mha_bench binary: attention and module
// timings reported as GFLOP/s, % of this machine's measured fp32 FMA peak, and the ratio
// against a peer (PyTorch) measured in the same run. Benchmarks only measure; tests never time.
#ifndef MHA_BENCH_SUITE_H_
#define MHA_BENCH_SUITE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mha::bench {

struct AttentionCase {
  std::string name;
  int64_t B, H, Hkv, Tq, Tk, D, Dv;
  bool causal;
  double flops() const;  // 4·B·H·(visible pairs)·(D+Dv)/2: only the unmasked part when causal
};

struct ModuleCase {
  std::string name;
  int64_t B, T, E, H;
  double flops() const;  // QKV and output projections + attention
};

// Seconds per call of a peer implementation, or a negative value when it has none.
struct Peer {
  std::string name;
  std::function<double(const AttentionCase&, int threads, double seconds)> attention;
  std::function<double(const ModuleCase&, int threads, double seconds)> module;
};

struct Row {
  std::string suite, name, shape;
  double flops = 0;
  double mha_s = 0, peer_s = -1;
};

struct Options {
  int threads = 2;
  double seconds = 0.5;  // per measurement
  std::string csv, json;
};

// Median seconds per call of f over at least `seconds` (after one warm-up call).
double time_calls(const std::function<void()>& f, double seconds);

// fp32 FMA throughput of `threads` threads running an FMA loop with the widest vectors here.
double measure_peak_gflops(int threads);

std::vector<AttentionCase> standard_attention_cases();  // the shapes and the seed shapes
std::vector<AttentionCase> sequence_sweep();             // B=1, H=8, D=64, T = 128 .. 8192
std::vector<ModuleCase> standard_module_cases();

double time_mha_attention(const AttentionCase& c, int threads, double seconds);
double time_mha_module(const ModuleCase& c, int threads, double seconds);

// Peak resident memory of one attention call at (1, 8, 32768, 64), beyond its inputs and
// outputs (which are allocated and touched first). Prints and returns the extra MiB.
double memory_check(int threads, bool causal);

// Runs the cases, printing progress to stderr, then the table to stdout; writes CSV/JSON if asked.
std::vector<Row> run_suites(const Options& options, const Peer* peer, bool sweep);
void report(const std::vector<Row>& rows, double peak_gflops, const Options& options, const Peer* peer);

}  // namespace mha::bench

#endif  // MHA_BENCH_SUITE_H_
