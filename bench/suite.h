// The benchmark suite shared by `mha bench` and the mha_bench binary: attention and module
// timings reported as GFLOP/s, % of this machine's measured fp32 FMA peak, and the ratio
// against a peer (PyTorch) measured in the same run. Benchmarks only measure; tests never time.
#ifndef MHA_BENCH_SUITE_H_
#define MHA_BENCH_SUITE_H_

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha::bench {

struct AttentionCase {
  std::string name;
  int64_t B, H, Hkv, Tq, Tk, D, Dv;
  bool causal;
  double flops() const;  // 4·B·H·(visible pairs)·(D+Dv)/2: only the unmasked part when causal
  // Backward: per visible pair S = QKᵀ recomputed (2D), dP = dO·Vᵀ (2Dv), dV (2Dv), dQ (2D), dK (2D).
  double backward_flops() const;
};

struct ModuleCase {
  std::string name;
  int64_t B, T, E, H;
  double flops() const;  // QKV and output projections + attention
  double train_flops() const;  // forward + backward: projections 3x, attention forward + backward
};

// One decoding step: Hq query heads of one new token against a cache of L positions.
struct DecodeCase {
  std::string name;
  int64_t B, Hq, Hkv, L, D;
  double bytes() const;  // K and V read: B·Hkv·L·2D floats
};

// Seconds per call of a peer implementation, or a negative value when it has none.
struct Peer {
  std::string name;
  std::function<double(const AttentionCase&, int threads, double seconds)> attention;
  std::function<double(const ModuleCase&, int threads, double seconds)> module;
  std::function<double(const DecodeCase&, int threads, double seconds)> decode;
  // Training: the attention backward alone (given the forward's results), forward + backward,
  // and one module step (forward + backward of sum(output · R)).
  std::function<double(const AttentionCase&, int threads, double seconds)> attention_backward;
  std::function<double(const AttentionCase&, int threads, double seconds)> attention_fwd_bwd;
  std::function<double(const ModuleCase&, int threads, double seconds)> module_train;
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

// A float32 tensor of a fixed pseudo-random pattern in [0, scale): benchmark inputs.
Tensor filled(std::vector<int64_t> shape, float scale);

// Median seconds per call of f over at least `seconds` (after one warm-up call).
double time_calls(const std::function<void()>& f, double seconds);

// fp32 FMA throughput of `threads` threads running an FMA loop with the widest vectors here.
double measure_peak_gflops(int threads);
// The bf16 dot-product (vdpbf16ps) peak, measured the same way; 0 without AVX512-BF16.
double measure_bf16_peak_gflops(int threads);
// The AMX bfloat16 tile-product (TDPBF16PS) peak, measured the same way; 0 without AMX-BF16 or
// where forward_amx_bf16() is off (no tile state granted).
double measure_amx_bf16_peak_gflops(int threads);

// STREAM-like memory bandwidth in GB/s of `threads` threads over 256 MiB arrays: a read-only
// sweep (what a decoding step does) and the triad a[i] = b[i] + s·c[i] (3 arrays counted).
struct Bandwidth {
  double read, triad;
};
Bandwidth measure_bandwidth(int threads);
// The read sweep of measure_bandwidth, one pass at a time, to take alongside a kernel's calls
// (the same moments of a noisy machine, the same statistic): GB/s of one pass. Its array is a
// Tensor, on transparent huge pages as a KvCache's storage is (a std::vector's 4 KiB pages read
// at 25 GB/s where the same sweep on huge pages read 37 on the Xeon VM: docs/benchmarks.md).
class ReadProbe {
 public:
  explicit ReadProbe(int threads);
  double gbps() const;

 private:
  int threads_;
  Tensor a_;
};
// time_calls's median seconds, and with a probe the median GB/s of read sweeps taken one before
// each call: the machine's read bandwidth at the same moments.
struct Timed {
  double seconds;
  double read_gbps;  // 0 without a probe
};
Timed time_calls_alongside(const std::function<void()>& f, const ReadProbe* probe, double seconds);
// The decode step over a KvCache of every storage type (float32 … int4), 16 and 256 MiB of
// float32-equivalent cache, and over paged pools: time, bytes read, share of the read bandwidth,
// ratio to float32 (bench/decode.cc).
void run_cache_types(const Options& o);
// Softcap, ALiBi and sinks (each, and all three) against plain attention at the same shape:
// prefill forward, backward, and a decode step — time and speed as % of plain.
void run_variants(const Options& o);
// Causal prefill of 16 sequences of mixed lengths: varlen_attention on the packed batch, the
// sequences one by one, and a padded batch (key lengths) — time and GFLOP/s of useful work.
void run_varlen(const Options& o);

std::vector<AttentionCase> standard_attention_cases();  // the shapes and the seed shapes
std::vector<AttentionCase> sequence_sweep();             // B=1, H=8, D=64, T = 128 .. 8192
std::vector<ModuleCase> standard_module_cases();
std::vector<DecodeCase> decode_cases();  // GQA and MHA caches of 1 MiB .. 256 MiB

double time_mha_attention(const AttentionCase& c, int threads, double seconds);
// `mha bench --dtypes`: float32, bfloat16 and float16 side by side (bench/dtypes.cc).
void run_dtypes(const Options& o);
double time_mha_module(const ModuleCase& c, int threads, double seconds);
double time_mha_decode(const DecodeCase& c, int threads, double seconds);
double time_mha_attention_backward(const AttentionCase& c, int threads, double seconds);
double time_mha_attention_fwd_bwd(const AttentionCase& c, int threads, double seconds);
double time_mha_module_train(const ModuleCase& c, int threads, double seconds);

// The training table: attention backward, forward + backward and module training steps.
std::vector<Row> run_training(const Options& options, const Peer* peer);
std::vector<AttentionCase> training_attention_cases();

// The decoding table: step time, GB/s of K/V read, % of the measured read bandwidth, peer
// (bench/decode.cc).
void run_decode(const Options& options, const Peer* peer);

// Peak resident memory of one attention call at (1, 8, 32768, 64), beyond its inputs and
// outputs (which are allocated and touched first). Prints and returns the extra MiB.
double memory_check(int threads, bool causal);

// Runs the cases, printing progress to stderr, then the table to stdout; writes CSV/JSON if asked.
std::vector<Row> run_suites(const Options& options, const Peer* peer, bool sweep);
void report(const std::vector<Row>& rows, double peak_gflops, const Options& options, const Peer* peer);

// An output file of the bench (--csv, --json) opened with `mode`, or an mha::Error naming it.
std::ofstream open_output(const std::string& path, std::ios::openmode mode);
// Closes what open_output opened: an mha::Error naming `path` if a write failed (a full disk),
// not a table cut short in silence.
void close_output(std::ofstream& f, const std::string& path);

// Checks options.csv and options.json (an mha::Error naming the one that cannot be written:
// found before the measurements, not after minutes of them; each is opened for appending), then
// turns options.threads 0 into all available threads. In that order: a usage error must not
// start the OpenMP runtime (under TSan its warning would make the error two lines).
void resolve_options(Options& options);

}  // namespace mha::bench

#endif  // MHA_BENCH_SUITE_H_
