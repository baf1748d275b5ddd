// The decoding benchmarks (`mha bench --decode`): a decode step through attention() over
// float32 K/V of 1 .. 256 MiB against a peer, and over a KvCache of each storage type and a
// PagedKvCache, with the read bandwidth measured beside it.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "bench/suite.h"
#include "mha/attention.h"
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
  fmt::print("\nthreads {}, measured memory bandwidth: read {:.1f} GB/s, triad {:.1f} GB/s (best of before and after)\n",
             o.threads, read, std::max(bw.triad, after.triad));
  fmt::print("{:<10} {:>9} {:>7} {:>10} {:>8} {:>7} {:>10} {:>8} {:>7}\n", "decode", "cache MiB", "L", "mha ms", "GB/s",
             "% read", peer_name + " ms", "GB/s", "ratio");
  std::ofstream csv;
  if (!o.csv.empty()) {
    csv.open(o.csv, std::ios::app);
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
          << "," << 100 * gb / read << "," << times[i].second << "," << (times[i].second > 0 ? c.bytes() / times[i].second / 1e9 : 0)
          << "," << (times[i].second > 0 ? times[i].second / times[i].first : 0) << "\n";
  }
}

namespace {

// Values in [-1, 1) from a 64-bit LCG: quantization sees ordinary data.
void fill_uniform(Tensor& t, uint64_t& x) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t.data<float>()[i] = static_cast<float>(static_cast<double>(x >> 40) / (1 << 23) - 1.0);
  }
}

// One decoding step (32 query heads, one new token) over a KvCache of `type` holding L
// positions of GQA 32/8, D = 128: attend() reads the cache in its stored format.
Timed time_cache_decode(CacheType type, int64_t L, int threads, double seconds, const ReadProbe* probe,
                        int64_t* bytes) {
  KvCacheConfig c;
  c.kv_heads = 8;
  c.head_dim_qk = c.head_dim_v = 128;
  c.capacity = L;
  c.dtype = type;
  KvCache cache(c);
  Tensor k(DType::kF32, {1, 8, L, 128}), v(DType::kF32, {1, 8, L, 128});
  uint64_t x = 12345;
  fill_uniform(k, x);
  fill_uniform(v, x);
  cache.append(k.view<float>(), v.view<float>());
  *bytes = cache.nbytes();
  const Tensor q = filled({1, 32, 1, 128}, 0.5f);
  Tensor out(DType::kF32, {1, 32, 1, 128});
  AttentionOptions opt;
  opt.num_threads = threads;
  return time_calls_alongside([&] { attend(q.view<float>(), cache, out.view<float>(), opt); }, probe, seconds);
}

// One batched decoding step over 16 sequences of a paged pool, lengths spread over 100 .. 8000
// (GQA 32/8, D = 128, pages of 64): the bytes of the pages read, in *bytes. Each sequence is
// appended whole (a prefill: its pages are taken one after another), or, `interleaved`, 64
// positions at a time in turn (as decoding grows them: each sequence's pages alternate with the
// others').
Timed time_paged_decode(CacheType type, bool interleaved, int threads, double seconds, const ReadProbe* probe,
                        int64_t* bytes) {
  PagedKvCacheConfig c;
  c.kv_heads = 8;
  c.head_dim_qk = c.head_dim_v = 128;
  c.page_size = 64;
  c.pages = 1024;
  c.dtype = type;
  PagedKvCache cache(c);
  std::vector<int64_t> ids, lengths;
  for (int s = 0; s < 16; ++s) {
    ids.push_back(cache.add_sequence());
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
      cache.append(ids[s], k.view<float>(), v.view<float>());
    }
  }
  const int64_t positions = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  *bytes = static_cast<int64_t>(static_cast<double>(cache.nbytes()) * static_cast<double>(positions) /
                                static_cast<double>(cache.pages() * c.page_size));
  const Tensor q = filled({16, 32, 1, 128}, 0.5f);
  Tensor out(DType::kF32, {16, 32, 1, 128});
  AttentionOptions opt;
  opt.num_threads = threads;
  return time_calls_alongside([&] { attend(q.view<float>(), cache, ids, out.view<float>(), opt); }, probe, seconds);
}

}  // namespace

void run_cache_types(const Options& o) {
  const Bandwidth bw = measure_bandwidth(o.threads);
  const ReadProbe probe(o.threads);
  const CacheType types[] = {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4};
  struct Row {
    std::string name;  // "L = ...", "paged", "interleaved"
    CacheType type;
    Timed time;
    int64_t bytes;
  };
  std::vector<Row> rows;
  for (int64_t mib : {16, 256}) {
    const int64_t L = mib * (1 << 20) / (8 * 2 * 128 * 4);  // the float32 cache's size sets L
    for (CacheType t : types) {
      std::fprintf(stderr, "cache %s, L = %ld ...\n", cache_type_name(t), static_cast<long>(L));
      int64_t bytes = 0;
      // A 16 MiB cache is partly in L3 from call to call; a read sweep between calls would evict it.
      const Timed time = time_cache_decode(t, L, o.threads, o.seconds, mib > 16 ? &probe : nullptr, &bytes);
      rows.push_back({std::to_string(L), t, time, bytes});
    }
  }
  for (bool interleaved : {false, true}) {
    for (CacheType t : types) {
      std::fprintf(stderr, "paged cache %s, 16 sequences%s ...\n", cache_type_name(t),
                   interleaved ? ", interleaved" : "");
      int64_t bytes = 0;
      const Timed time = time_paged_decode(t, interleaved, o.threads, o.seconds, &probe, &bytes);
      rows.push_back({interleaved ? "interleaved" : "paged", t, time, bytes});
    }
  }
  const Bandwidth after = measure_bandwidth(o.threads);
  const double read = std::max(bw.read, after.read);
  fmt::print("\nthreads {}, measured read bandwidth {:.1f} GB/s (best sweep before and after); decode step over a "
             "KvCache, GQA 32/8, D = 128\n",
             o.threads, read);
  fmt::print("{:<9} {:>11} {:>9} {:>9} {:>7} {:>7} {:>10} {:>9} {:>7}\n", "cache", "L", "MiB read", "ms", "GB/s",
             "% read", "sweep GB/s", "% sweep", "× fp32");
  double f32 = 0;
  for (const Row& r : rows) {
    if (r.type == CacheType::kF32) f32 = r.time.seconds;
    const double gb = static_cast<double>(r.bytes) / r.time.seconds / 1e9;
    const std::string sweep = r.time.read_gbps > 0 ? fmt::format("{:.1f}", r.time.read_gbps) : "-";
    const std::string share = r.time.read_gbps > 0 ? fmt::format("{:.1f}%", 100 * gb / r.time.read_gbps) : "-";
    fmt::print("{:<9} {:>11} {:>9.1f} {:>9.3f} {:>7.1f} {:>6.1f}% {:>10} {:>9} {:>6.2f}x\n", cache_type_name(r.type),
               r.name, static_cast<double>(r.bytes) / (1 << 20), r.time.seconds * 1e3, gb, 100 * gb / read, sweep,
               share, r.time.seconds / f32);
  }
  fmt::print("paged: one attend() over 16 sequences of 100 .. 8000 positions in pages of 64, each appended whole "
             "(its pages taken in a row);\ninterleaved: the same, appended 64 positions at a time in turn. MiB read: "
             "their pages. % read: of the best sweep;\nsweep GB/s: the median of read sweeps taken one before each "
             "call (the same moments), % sweep: of it\n");
}

}  // namespace mha::bench
