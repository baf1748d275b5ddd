#include "bench/suite.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>

#include "mha/attention.h"
#include "mha/error.h"
#include "mha/varlen.h"
#include "mha/multi_head_attention.h"
#include "util/parallel.h"

namespace mha::bench {

double AttentionCase::flops() const {
  // Visible (query, key) pairs: all, or the top-left causal triangle.
  double pairs = static_cast<double>(Tq) * Tk;
  if (causal) {
    pairs = 0;
    for (int64_t i = 0; i < Tq; ++i) pairs += static_cast<double>(std::min<int64_t>(i + 1, Tk));
  }
  return 2.0 * B * H * pairs * static_cast<double>(D + Dv);
}

double AttentionCase::backward_flops() const { return flops() / (2.0 * (D + Dv)) * (6.0 * D + 4.0 * Dv); }

double ModuleCase::train_flops() const {
  const double rows = static_cast<double>(B) * T;
  const double projections = 2.0 * rows * E * 4 * E;
  AttentionCase a{"", B, H, H, T, T, E / H, E / H, false};
  return 3 * projections + a.flops() + a.backward_flops();
}

double ModuleCase::flops() const {
  const double rows = static_cast<double>(B) * T;
  return 2.0 * rows * E * 3 * E + 4.0 * B * static_cast<double>(T) * T * E + 2.0 * rows * E * E;
}

double DecodeCase::bytes() const { return 2.0 * B * Hkv * static_cast<double>(L) * D * sizeof(float); }

Timed time_calls_alongside(const std::function<void()>& f, const ReadProbe* probe, double seconds) {
  f();
  std::vector<double> t, r;
  double total = 0;
  while (total < seconds || t.size() < 3) {
    if (probe) r.push_back(probe->gbps());
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    total += t.back();
  }
  std::sort(t.begin(), t.end());
  std::sort(r.begin(), r.end());
  return {t[t.size() / 2], probe ? r[r.size() / 2] : 0.0};
}

double time_calls(const std::function<void()>& f, double seconds) {
  return time_calls_alongside(f, nullptr, seconds).seconds;
}

std::vector<AttentionCase> standard_attention_cases() {
  return {
      {"issue", 8, 12, 12, 128, 128, 64, 64, false},
      {"issue", 4, 12, 12, 512, 512, 64, 64, false},
      {"issue", 1, 12, 12, 1024, 1024, 64, 64, true},
      {"issue", 1, 8, 8, 4096, 4096, 64, 64, false},
      {"issue", 1, 32, 32, 2048, 2048, 128, 128, true},
      {"issue", 1, 8, 8, 4096, 4096, 64, 64, true},
      {"gqa", 1, 32, 8, 2048, 2048, 128, 128, true},
      {"head dim", 1, 8, 8, 2048, 2048, 32, 32, false},
      {"head dim", 1, 8, 8, 2048, 2048, 80, 80, false},
      {"head dim", 1, 8, 8, 2048, 2048, 96, 96, false},
      {"head dim", 1, 8, 8, 2048, 2048, 256, 256, false},
      {"seed000", 10, 8, 8, 10, 10, 96, 96, true},
      {"seed002", 2, 8, 8, 10, 10, 64, 64, false},
      {"seed003", 4, 8, 8, 12, 12, 16, 12, false},
  };
}

std::vector<AttentionCase> sequence_sweep() {
  std::vector<AttentionCase> v;
  for (bool causal : {false, true})
    for (int64_t T : {128, 256, 512, 1024, 2048, 4096, 8192}) v.push_back({"sweep", 1, 8, 8, T, T, 64, 64, causal});
  return v;
}

std::vector<ModuleCase> standard_module_cases() {
  return {
      {"seed000", 10, 10, 768, 8},
      {"seed002", 2, 10, 512, 8},
      {"bert-base", 8, 128, 768, 12},
      {"gpt2-512", 4, 512, 768, 12},
  };
}

Tensor filled(std::vector<int64_t> shape, float scale) {
  Tensor t(DType::kF32, std::move(shape));
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = scale * static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
  return t;
}

double time_mha_attention(const AttentionCase& c, int threads, double seconds) {
  const Tensor q = filled({c.B, c.H, c.Tq, c.D}, 1.0f), k = filled({c.B, c.Hkv, c.Tk, c.D}, 1.0f);
  const Tensor v = filled({c.B, c.Hkv, c.Tk, c.Dv}, 1.0f);
  Tensor out(DType::kF32, {c.B, c.H, c.Tq, c.Dv});
  AttentionOptions opt;
  opt.num_threads = threads;
  opt.causal = c.causal ? Causal::kTopLeft : Causal::kNone;
  const AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  const AttentionOutputs o{out.view<float>()};
  return time_calls([&] { attention(in, o, opt); }, seconds);
}

double time_mha_module(const ModuleCase& c, int threads, double seconds) {
  MultiHeadAttentionConfig config;
  config.embed_dim = c.E;
  config.num_heads = c.H;
  MultiHeadAttention m(config, 1);
  MhaCallOptions options;
  options.num_threads = threads;
  const Tensor x = filled({c.B, c.T, c.E}, 1.0f);
  MhaInputs in;
  in.query = x.view<float>();
  return time_calls([&] { m.forward(in, options); }, seconds);
}

namespace {

// VmHWM (peak resident set) in MiB; resettable through /proc/self/clear_refs.
double peak_rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return -1;
}

void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

}  // namespace

double memory_check(int threads, bool causal) {
  const int64_t B = 1, H = 8, T = 32768, D = 64;
  Tensor q = filled({B, H, T, D}, 1.0f), k = filled({B, H, T, D}, 1.0f), v = filled({B, H, T, D}, 1.0f);
  Tensor out(DType::kF32, {B, H, T, D});
  reset_peak_rss();
  const double before = peak_rss_mib();
  AttentionOptions opt;
  opt.num_threads = threads;
  opt.causal = causal ? Causal::kTopLeft : Causal::kNone;
  const auto start = std::chrono::steady_clock::now();
  attention({q.view<float>(), k.view<float>(), v.view<float>()}, {out.view<float>()}, opt);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double after = peak_rss_mib();
  const double io = 4.0 * static_cast<double>(q.nbytes()) / (1 << 20);
  fmt::print("memory: (1, 8, 32768, 64){} in {:.2f} s: peak RSS {:.1f} MiB with {:.1f} MiB of inputs and outputs "
             "resident before the call; the call added {:.1f} MiB\n",
             causal ? " causal" : "", s, after, io, after - before);
  return after - before;
}


void run_varlen(const Options& o) {
  const int64_t H = 16, D = 64, S = 16;
  std::vector<int64_t> lengths;
  int64_t total = 0, longest = 0;
  double flops = 0;  // useful work: causal, each sequence alone
  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = 100 + (1900 * ((s * 7) % 16)) / 15;  // 100 .. 2000, shuffled
    lengths.push_back(L);
    total += L;
    longest = std::max(longest, L);
    flops += 4.0 * H * D * static_cast<double>(L) * static_cast<double>(L + 1) / 2;
  }
  const Tensor q = filled({total, H, D}, 0.5f), k = filled({total, H, D}, 0.25f), v = filled({total, H, D}, 1.0f);
  Tensor out(DType::kF32, {total, H, D}), cu(DType::kI64, {S + 1});
  cu.data<int64_t>()[0] = 0;
  for (int64_t s = 0; s < S; ++s) cu.data<int64_t>()[s + 1] = cu.data<int64_t>()[s] + lengths[s];
  AttentionOptions opt;
  opt.num_threads = o.threads;
  opt.causal = Causal::kBottomRight;
  const BasicVarlenInputs<float> in{q.view<float>(), k.view<float>(), v.view<float>(), cu.view<int64_t>(),
                                    cu.view<int64_t>()};
  const auto run_packed = [&] { varlen_attention(in, out.view<float>(), {}, opt); };
  // One by one: each sequence in its own contiguous (1, H, L, D) tensors.
  std::vector<Tensor> qs, ks, vs, os;
  for (int64_t L : lengths) {
    qs.push_back(filled({1, H, L, D}, 0.5f));
    ks.push_back(filled({1, H, L, D}, 0.25f));
    vs.push_back(filled({1, H, L, D}, 1.0f));
    os.emplace_back(DType::kF32, std::vector<int64_t>{1, H, L, D});
  }
  const auto run_alone = [&] {
    for (int64_t s = 0; s < S; ++s)
      attention({qs[s].view<float>(), ks[s].view<float>(), vs[s].view<float>()}, {os[s].view<float>()}, opt);
  };
  // Padded: (S, H, longest, D) with key lengths; bottom-right causal per sequence.
  const Tensor qp = filled({S, H, longest, D}, 0.5f), kp = filled({S, H, longest, D}, 0.25f);
  const Tensor vp = filled({S, H, longest, D}, 1.0f);
  Tensor op(DType::kF32, {S, H, longest, D}), lens(DType::kI64, {S});
  std::copy(lengths.begin(), lengths.end(), lens.data<int64_t>());
  AttentionInputs pin{qp.view<float>(), kp.view<float>(), vp.view<float>()};
  pin.key_lengths = lens.view<int64_t>();
  const auto run_padded = [&] { attention(pin, {op.view<float>()}, opt); };
  // The three take turns, three rounds, the best of each kept: this machine's speed drifts by
  // more than the differences measured here.
  double packed = 1e30, alone = 1e30, padded = 1e30;
  for (int round = 0; round < 3; ++round) {
    packed = std::min(packed, time_calls(run_packed, o.seconds / 3));
    alone = std::min(alone, time_calls(run_alone, o.seconds / 3));
    padded = std::min(padded, time_calls(run_padded, o.seconds / 3));
  }
  fmt::print("threads {}; causal prefill of {} sequences of 100 .. 2000 tokens (total {}), H = {}, D = {}\n", o.threads,
             S, total, H, D);
  fmt::print("{:<28} {:>10} {:>10} {:>12}\n", "", "ms", "GFLOP/s", "× packed");
  for (auto [name, t] : {std::pair<const char*, double>{"varlen_attention (packed)", packed},
                         {"one by one", alone}, {"padded batch + key_lengths", padded}}) {
    fmt::print("{:<28} {:>10.2f} {:>10.1f} {:>11.2f}x\n", name, t * 1e3, flops / t / 1e9, t / packed);
  }
}

std::vector<AttentionCase> training_attention_cases() {
  std::vector<AttentionCase> v;
  for (const AttentionCase& c : standard_attention_cases()) {
    if (c.name == "issue" || c.name == "gqa") v.push_back(c);
  }
  return v;
}

namespace {

// The backward alone (given the forward's output and LSE), or forward + backward.
double time_backward(const AttentionCase& c, int threads, double seconds, bool with_forward) {
  const Tensor q = filled({c.B, c.H, c.Tq, c.D}, 1.0f), k = filled({c.B, c.Hkv, c.Tk, c.D}, 1.0f);
  const Tensor v = filled({c.B, c.Hkv, c.Tk, c.Dv}, 1.0f), dout = filled({c.B, c.H, c.Tq, c.Dv}, 1.0f);
  Tensor out(DType::kF32, {c.B, c.H, c.Tq, c.Dv}), lse(DType::kF32, {c.B, c.H, c.Tq});
  Tensor dq(DType::kF32, {c.B, c.H, c.Tq, c.D}), dk(DType::kF32, {c.B, c.Hkv, c.Tk, c.D});
  Tensor dv(DType::kF32, {c.B, c.Hkv, c.Tk, c.Dv});
  AttentionOptions opt;
  opt.num_threads = threads;
  opt.causal = c.causal ? Causal::kTopLeft : Causal::kNone;
  const AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  const AttentionOutputs fwd{out.view<float>(), lse.view<float>()};
  if (!with_forward) attention(in, fwd, opt);
  return time_calls(
      [&] {
        if (with_forward) attention(in, fwd, opt);
        attention_backward(in, out.view<float>(), lse.view<float>(), dout.view<float>(),
                           {dq.view<float>(), dk.view<float>(), dv.view<float>()}, opt);
      },
      seconds);
}

}  // namespace

double time_mha_attention_backward(const AttentionCase& c, int threads, double seconds) {
  return time_backward(c, threads, seconds, false);
}

double time_mha_attention_fwd_bwd(const AttentionCase& c, int threads, double seconds) {
  return time_backward(c, threads, seconds, true);
}

double time_mha_module_train(const ModuleCase& c, int threads, double seconds) {
  MultiHeadAttentionConfig config;
  config.embed_dim = c.E;
  config.num_heads = c.H;
  MultiHeadAttention m(config, 1);
  MhaCallOptions options;
  options.num_threads = threads;
  options.training = true;
  const Tensor x = filled({c.B, c.T, c.E}, 1.0f), r = filled({c.B, c.T, c.E}, 1.0f);
  MhaInputs in;
  in.query = x.view<float>();
  MhaParamGrads grads = m.make_grads();
  return time_calls(
      [&] {
        MhaTape tape;
        m.forward(in, options, &tape);
        m.backward(tape, r.view<float>(), &grads, options);
      },
      seconds);
}

namespace {

std::string attention_shape(const AttentionCase& c) {
  return fmt::format("({}, {}{}, {}, {}{})", c.B, c.H, c.Hkv != c.H ? fmt::format("/{}", c.Hkv) : "", c.Tq, c.D,
                     c.Dv != c.D ? fmt::format("/{}", c.Dv) : "");
}

}  // namespace

namespace {

// Seconds per call of one implementation on one case.
using Timer = std::function<double(int threads, double seconds)>;

// Binds a peer's timer to a case; empty when there is no peer or it lacks this measurement.
template <typename Case>
Timer peer_timer(const Peer* peer, std::function<double(const Case&, int, double)> Peer::*member, const Case& c) {
  if (!peer || !(peer->*member)) return {};
  return [peer, member, &c](int threads, double seconds) { return (peer->*member)(c, threads, seconds); };
}

// Measures one row, mha then the peer, printing progress to stderr.
class RowRunner {
 public:
  RowRunner(const Options& o, size_t total) : o_(o), total_(total) {}
  Row run(std::string suite, std::string name, std::string shape, double flops, const Timer& mha, const Timer& peer) {
    std::fprintf(stderr, "[%zu/%zu] %s %s %s ...\n", ++done_, total_, suite.c_str(), name.c_str(), shape.c_str());
    Row r;
    r.suite = std::move(suite);
    r.name = std::move(name);
    r.shape = std::move(shape);
    r.flops = flops;
    r.mha_s = mha(o_.threads, o_.seconds);
    if (peer) r.peer_s = peer(o_.threads, o_.seconds);
    return r;
  }

 private:
  const Options& o_;
  size_t total_, done_ = 0;
};

std::string case_name(const AttentionCase& c) { return c.name + (c.causal ? " causal" : ""); }
std::string module_shape(const ModuleCase& c) { return fmt::format("B={} T={} E={} H={}", c.B, c.T, c.E, c.H); }

}  // namespace

std::vector<Row> run_training(const Options& o, const Peer* peer) {
  const std::vector<AttentionCase> att = training_attention_cases();
  std::vector<ModuleCase> mods;
  for (const ModuleCase& c : standard_module_cases())
    if (c.T >= 128) mods.push_back(c);
  RowRunner runner(o, 2 * att.size() + mods.size());
  std::vector<Row> rows;
  for (const AttentionCase& c : att) {
    rows.push_back(runner.run("backward", case_name(c), attention_shape(c), c.backward_flops(),
                              [&](int t, double s) { return time_mha_attention_backward(c, t, s); },
                              peer_timer(peer, &Peer::attention_backward, c)));
  }
  for (const AttentionCase& c : att) {
    rows.push_back(runner.run("fwd+bwd", case_name(c), attention_shape(c), c.flops() + c.backward_flops(),
                              [&](int t, double s) { return time_mha_attention_fwd_bwd(c, t, s); },
                              peer_timer(peer, &Peer::attention_fwd_bwd, c)));
  }
  for (const ModuleCase& c : mods) {
    rows.push_back(runner.run("module train", c.name, module_shape(c), c.train_flops(),
                              [&](int t, double s) { return time_mha_module_train(c, t, s); },
                              peer_timer(peer, &Peer::module_train, c)));
  }
  return rows;
}

std::vector<Row> run_suites(const Options& o, const Peer* peer, bool sweep) {
  std::vector<AttentionCase> att = standard_attention_cases();
  if (sweep) {
    for (const auto& c : sequence_sweep()) att.push_back(c);
  }
  const std::vector<ModuleCase> mods = standard_module_cases();
  RowRunner runner(o, att.size() + mods.size());
  std::vector<Row> rows;
  for (const AttentionCase& c : att) {
    const std::string suite = c.name == "sweep" ? (c.causal ? "sweep-causal" : "sweep") : "attention";
    rows.push_back(runner.run(suite, case_name(c), attention_shape(c), c.flops(),
                              [&](int t, double s) { return time_mha_attention(c, t, s); },
                              peer_timer(peer, &Peer::attention, c)));
  }
  for (const ModuleCase& c : mods) {
    rows.push_back(runner.run("module", c.name, module_shape(c), c.flops(),
                              [&](int t, double s) { return time_mha_module(c, t, s); },
                              peer_timer(peer, &Peer::module, c)));
  }
  return rows;
}

void report(const std::vector<Row>& rows, double peak, const Options& o, const Peer* peer) {
  const std::string peer_name = peer ? peer->name : "peer";
  fmt::print("threads {}, measured fp32 FMA peak {:.1f} GFLOP/s\n", o.threads, peak);
  fmt::print("{:<13} {:<16} {:<24} {:>10} {:>9} {:>7} {:>10} {:>9} {:>7}\n", "suite", "case", "shape (B, H, T, D)",
             "mha ms", "GFLOP/s", "% peak", peer_name + " ms", "GFLOP/s", "ratio");
  for (const Row& r : rows) {
    const double g = r.flops / r.mha_s / 1e9;
    std::string peer_cols = fmt::format("{:>10} {:>9} {:>7}", "-", "-", "-");
    if (r.peer_s > 0)
      peer_cols =
          fmt::format("{:>10.3f} {:>9.1f} {:>6.2f}x", r.peer_s * 1e3, r.flops / r.peer_s / 1e9, r.peer_s / r.mha_s);
    fmt::print("{:<13} {:<16} {:<24} {:>10.3f} {:>9.1f} {:>6.1f}% {}\n", r.suite, r.name, r.shape, r.mha_s * 1e3, g,
               peak > 0 ? 100 * g / peak : 0.0, peer_cols);
  }
  if (!o.csv.empty()) {
    std::ofstream f = open_output(o.csv, std::ios::out);
    f << "suite,case,shape,flops,mha_seconds,mha_gflops,percent_of_peak,peer,peer_seconds,peer_gflops,ratio\n";
    for (const Row& r : rows) {
      const double g = r.flops / r.mha_s / 1e9;
      f << r.suite << "," << r.name << ",\"" << r.shape << "\"," << r.flops << "," << r.mha_s << "," << g << ","
        << (peak > 0 ? 100 * g / peak : 0) << "," << peer_name << ","
        << (r.peer_s > 0 ? std::to_string(r.peer_s) : "") << ","
        << (r.peer_s > 0 ? std::to_string(r.flops / r.peer_s / 1e9) : "") << ","
        << (r.peer_s > 0 ? std::to_string(r.peer_s / r.mha_s) : "") << "\n";
    }
    close_output(f, o.csv);
  }
  if (!o.json.empty()) {
    nlohmann::json j;
    j["threads"] = o.threads;
    j["peak_gflops"] = peak;
    j["peer"] = peer_name;
    for (const Row& r : rows) {
      nlohmann::json e = {{"suite", r.suite}, {"case", r.name}, {"shape", r.shape}, {"flops", r.flops},
                          {"mha_seconds", r.mha_s}, {"mha_gflops", r.flops / r.mha_s / 1e9}};
      if (r.peer_s > 0) e["peer_seconds"] = r.peer_s, e["peer_gflops"] = r.flops / r.peer_s / 1e9;
      j["rows"].push_back(e);
    }
    std::ofstream f = open_output(o.json, std::ios::out);
    f << j.dump(1) << "\n";
    close_output(f, o.json);
  }
}

std::ofstream open_output(const std::string& path, std::ios::openmode mode) {
  std::ofstream f(path, mode);
  if (!f) throw Error(fmt::format("bench: cannot write '{}' (does its directory exist?)", path));
  return f;
}

void close_output(std::ofstream& f, const std::string& path) {
  f.close();
  if (!f) throw Error(fmt::format("bench: cannot write '{}' (is the disk full?)", path));
}

void resolve_options(Options& o) {
  for (const std::string& path : {o.csv, o.json}) {
    if (!path.empty()) open_output(path, std::ios::app);
  }
  o.threads = resolve_threads(o.threads);
}

}  // namespace mha::bench
