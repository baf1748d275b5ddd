// The decoding benchmarks (`mha bench --decode`): a decode step through attention() over
// float32 K/V of 1 .. 256 MiB against a peer, and over a KvCache of each storage type and a
// PagedKvCache, with the read bandwidth measured beside it.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "bench/suite.h"
#include "mha/attention.h"
#include "mha/error.h"
#include "mha/kv_cache.h"
#include "mha/paged_kv_cache.h"

namespace mha::bench {

std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> v;
  for (int64_t mib : {1, 4, 16, 64, 256}) {
    // GQA as in Llama-style models (32 query heads, 8 kv heads, D 128) and plain MHA.
    v.push_back({"gqa 32/8", 1, 32, 8, mib * (1 << 20) / (8 * 2 * 128 * 4), 128});
    v.push_back({"mha 32", 1, 32, 32, mib * (1 << 20) / (32 * 2 * 128 * 4), 128});
  }
  return v;
}

double time_mha_decode(const DecodeCase& c, int threads, double seconds) {
  const Tensor q = filled({c.B, c.Hq, 1, c.D}, 1.0f), k = filled({c.B, c.Hkv, c.L, c.D}, 0.1f);
  const Tensor v = filled({c.B, c.Hkv, c.L, c.D}, 1.0f);
  Tensor out(DType::kF32, {c.B, c.Hq, 1, c.D});
  AttentionOptions opt;
  opt.num_threads = threads;
  opt.causal = Causal::kBottomRight;  // the new token sees the whole cache
  const AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  const AttentionOutputs o{out.view<float>()};
  return time_calls([&] { attention(in, o, opt); }, seconds);
}

void run_decode(const Options& o, const Peer* peer) {
  const Bandwidth bw = measure_bandwidth(o.threads);
  const auto cases = decode_cases();
  std::vector<std::pair<double, double>> times;
  size_t done = 0;
  for (const DecodeCase& c : cases) {
    std::fprintf(stderr, "[%zu/%zu] decode %s, cache %.0f MiB ...\n", ++done, cases.size(), c.name.c_str(),
                 c.bytes() / (1 << 20));
    times.emplace_back(time_mha_decode(c, o.threads, o.seconds),
                       peer && peer->decode ? peer->decode(c, o.threads, o.seconds) : -1.0);
  }
  const Bandwidth after = measure_bandwidth(o.threads);
  const double read = std::max(bw.read, after.read);
  const std::string peer_name = peer ? peer->name : "peer";
  fmt::print(
      "\nthreads {}, measured memory bandwidth: read {:.1f} GB/s, triad {:.1f} GB/s (best of before and after)\n",
             o.threads, read, std::max(bw.triad, after.triad));
  fmt::print("{:<10} {:>9} {:>7} {:>10} {:>8} {:>7} {:>10} {:>8} {:>7}\n", "decode", "cache MiB", "L", "mha ms", "GB/s",
             "% read", peer_name + " ms", "GB/s", "ratio");
  std::ofstream csv;
  if (!o.csv.empty()) {
    csv = open_output(o.csv, std::ios::app);
    csv << "decode,case,cache_mib,L,mha_seconds,mha_gbps,percent_of_read_bandwidth,peer_seconds,peer_gbps,ratio\n";
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const DecodeCase& c = cases[i];
    const double gb = c.bytes() / times[i].first / 1e9;
    std::string peer_cols = fmt::format("{:>10} {:>8} {:>7}", "-", "-", "-");
    if (times[i].second > 0)
      peer_cols = fmt::format("{:>10.3f} {:>8.1f} {:>6.2f}x", times[i].second * 1e3, c.bytes() / times[i].second / 1e9,
                              times[i].second / times[i].first);
    fmt::print("{:<10} {:>9.0f} {:>7} {:>10.3f} {:>8.1f} {:>6.1f}% {}\n", c.name, c.bytes() / (1 << 20), c.L,
               times[i].first * 1e3, gb, 100 * gb / read, peer_cols);
    if (csv.is_open())
      csv << "decode," << c.name << "," << c.bytes() / (1 << 20) << "," << c.L << "," << times[i].first << "," << gb
          << "," << 100 * gb / read << "," << times[i].second << ","
          << (times[i].second > 0 ? c.bytes() / times[i].second / 1e9 : 0)
          << "," << (times[i].second > 0 ? times[i].second / times[i].first : 0) << "\n";
  }
  if (csv.is_open()) close_output(csv, o.csv);
}

namespace {

// Values in [-1, 1) from a 64-bit LCG: quantization sees ordinary data.
void fill_uniform(Tensor& t, uint64_t& x) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t.data<float>()[i] = static_cast<float>(static_cast<double>(x >> 40) / (1 << 23) - 1.0);
  }
}

// A decoding call over a cache built for it (the call owns the cache, query and output), and
// the bytes of cache it reads.
struct CacheCall {
  std::string name;  // L, "paged" or "interleaved"
  CacheType type;
  int64_t bytes;
  std::function<void()> call;
};

// One decoding step (32 query heads, one new token) over a KvCache of `type` holding L
// positions of GQA 32/8, D = 128: attend() reads the cache in its stored format.
CacheCall cache_call(CacheType type, int64_t L, int threads) {
  KvCacheConfig c;
  c.kv_heads = 8;
  c.head_dim_qk = c.head_dim_v = 128;
  c.capacity = L;
  c.dtype = type;
  auto cache = std::make_shared<KvCache>(c);
  Tensor k(DType::kF32, {1, 8, L, 128}), v(DType::kF32, {1, 8, L, 128});
  uint64_t x = 12345;
  fill_uniform(k, x);
  fill_uniform(v, x);
  cache->append(k.view<float>(), v.view<float>());
  auto q = std::make_shared<Tensor>(filled({1, 32, 1, 128}, 0.5f));
  auto out = std::make_shared<Tensor>(DType::kF32, std::vector<int64_t>{1, 32, 1, 128});
  AttentionOptions opt;
  opt.num_threads = threads;
  return {std::to_string(L), type, cache->nbytes(),
          [=] { attend(q->view<float>(), *cache, out->view<float>(), opt); }};
}

// One batched decoding step over 16 sequences of a paged pool, lengths spread over 100 .. 8000
// (GQA 32/8, D = 128, pages of 64); the bytes are those of the pages read. Each sequence is
// appended whole (a prefill: its pages are taken one after another), or, `interleaved`, 64
// positions at a time in turn (as decoding grows them: each sequence's pages alternate with the
// others').
CacheCall paged_call(CacheType type, bool interleaved, int threads) {
  PagedKvCacheConfig c;
  c.kv_heads = 8;
  c.head_dim_qk = c.head_dim_v = 128;
  c.page_size = 64;
  c.pages = 1024;
  c.dtype = type;
  auto cache = std::make_shared<PagedKvCache>(c);
  std::vector<int64_t> ids, lengths;
  for (int s = 0; s < 16; ++s) {
    ids.push_back(cache->add_sequence());
    lengths.push_back(100 + (7900 * static_cast<int64_t>((s * 7) % 16)) / 15);  // 100 .. 8000, shuffled
  }
  uint64_t x = 12345;
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const int64_t step = interleaved ? c.page_size : longest;
  for (int64_t at = 0; at < longest; at += step) {
    for (size_t s = 0; s < ids.size(); ++s) {
      const int64_t n = std::min(step, lengths[s] - at);
      if (n <= 0) continue;
      Tensor k(DType::kF32, {8, n, 128}), v(DType::kF32, {8, n, 128});
      fill_uniform(k, x);
      fill_uniform(v, x);
      cache->append(ids[s], k.view<float>(), v.view<float>());
    }
  }
  const int64_t positions = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  const auto bytes = static_cast<int64_t>(static_cast<double>(cache->nbytes()) * static_cast<double>(positions) /
                                          static_cast<double>(cache->pages() * c.page_size));
  auto q = std::make_shared<Tensor>(filled({16, 32, 1, 128}, 0.5f));
  auto out = std::make_shared<Tensor>(DType::kF32, std::vector<int64_t>{16, 32, 1, 128});
  AttentionOptions opt;
  opt.num_threads = threads;
  return {interleaved ? "interleaved" : "paged", type, bytes,
          [=] { attend(q->view<float>(), *cache, ids, out->view<float>(), opt); }};
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// A row's figures: the median over the rounds of its time and of the sweep beside it; of its
// share of that sweep and its ratio to the group's first call (float32), each taken within a
// round (the same moments of a noisy machine).
struct Turns {
  double seconds, sweep_gbps, share, ratio;
};

// The calls of a group take turns, `rounds` times, each timed for seconds / rounds per round
// (time_calls_alongside: with a probe, a read sweep before each call).
std::vector<Turns> time_in_turns(const std::vector<CacheCall>& calls, const ReadProbe* probe, double seconds,
                                 int rounds) {
  std::vector<std::vector<double>> t(calls.size()), sweep(calls.size()), share(calls.size()), ratio(calls.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < calls.size(); ++i) {
      const Timed x = time_calls_alongside(calls[i].call, probe, seconds / rounds);
      t[i].push_back(x.seconds);
      sweep[i].push_back(x.read_gbps);
      share[i].push_back(x.read_gbps > 0 ? static_cast<double>(calls[i].bytes) / x.seconds / 1e9 / x.read_gbps : 0);
      ratio[i].push_back(x.seconds / t[0].back());
    }
  }
  std::vector<Turns> out;
  for (size_t i = 0; i < calls.size(); ++i)
    out.push_back({median(t[i]), median(sweep[i]), median(share[i]), median(ratio[i])});
  return out;
}

}  // namespace

void run_cache_types(const Options& o) {
  const Bandwidth bw = measure_bandwidth(o.threads);
  const ReadProbe probe(o.threads);
  const CacheType types[] = {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4};
  constexpr int kRounds = 5;
  struct Row {  // a call's figures (its cache is gone once its group is timed)
    std::string name;
    CacheType type;
    int64_t bytes;
    Turns turns;
  };
  std::vector<Row> rows;
  // Groups of one shape, every type: built together (at most ~1.3 GB, freed before the next
  // group), then timed in turns.
  const auto group = [&](const char* what, const std::function<CacheCall(CacheType)>& make, bool sweeps) {
    std::vector<CacheCall> calls;
    for (CacheType t : types) calls.push_back(make(t));
    std::fprintf(stderr, "%s: %d rounds of the five cache types ...\n", what, kRounds);
    // A 16 MiB cache is partly in L3 from call to call; a read sweep between calls would evict it.
    const std::vector<Turns> turns = time_in_turns(calls, sweeps ? &probe : nullptr, 2 * o.seconds, kRounds);
    for (size_t i = 0; i < calls.size(); ++i) rows.push_back({calls[i].name, calls[i].type, calls[i].bytes, turns[i]});
  };
  for (int64_t mib : {16, 256}) {
    const int64_t L = mib * (1 << 20) / (8 * 2 * 128 * 4);  // the float32 cache's size sets L
    group(mib > 16 ? "cache of 256 MiB as float32" : "cache of 16 MiB as float32",
          [&](CacheType t) { return cache_call(t, L, o.threads); }, mib > 16);
  }
  for (bool interleaved : {false, true})
    group(interleaved ? "paged, interleaved" : "paged",
          [&](CacheType t) { return paged_call(t, interleaved, o.threads); }, true);
  const Bandwidth after = measure_bandwidth(o.threads);
  const double read = std::max(bw.read, after.read);
  fmt::print("\nthreads {}, measured read bandwidth {:.1f} GB/s (best sweep before and after); decode step over a "
             "KvCache, GQA 32/8, D = 128\n",
             o.threads, read);
  fmt::print("{:<9} {:>11} {:>9} {:>9} {:>7} {:>7} {:>10} {:>9} {:>7}\n", "cache", "L", "MiB read", "ms", "GB/s",
             "% read", "sweep GB/s", "% sweep", "× fp32");
  for (const Row& r : rows) {
    const double gb = static_cast<double>(r.bytes) / r.turns.seconds / 1e9;
    const std::string sweep = r.turns.sweep_gbps > 0 ? fmt::format("{:.1f}", r.turns.sweep_gbps) : "-";
    const std::string share = r.turns.sweep_gbps > 0 ? fmt::format("{:.1f}%", 100 * r.turns.share) : "-";
    fmt::print("{:<9} {:>11} {:>9.1f} {:>9.3f} {:>7.1f} {:>6.1f}% {:>10} {:>9} {:>6.2f}x\n",
               cache_type_name(r.type), r.name, static_cast<double>(r.bytes) / (1 << 20),
               r.turns.seconds * 1e3, gb, 100 * gb / read, sweep, share, r.turns.ratio);
  }
  fmt::print("The five types of a shape take turns, {} rounds: ms and sweep GB/s are medians over the rounds;\n"
             "% sweep (of the read sweeps taken one before each call) and × fp32 are medians of each round's.\n"
             "paged: one attend() over 16 sequences of 100 .. 8000 positions in pages of 64, each appended whole "
             "(its pages taken in a row);\ninterleaved: the same, appended 64 positions at a time in turn. MiB read: "
             "their pages. % read: of the best sweep.\n",
             kRounds);
}

}  // namespace mha::bench
