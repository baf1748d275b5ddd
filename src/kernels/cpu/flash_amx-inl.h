// The bfloat16 forward's two block products with AMX tiles (Intel's TDPBF16PS), in place of
// widening K and V to float32 for the FMA tiles: AVX3 target, where the CPU has AMX-BF16 and
// the OS grants the tile state (forward_amx_bf16()), for head dims D % 32 == 0 and Dv % 16 == 0
// and unit-stride K and V rows, key rows not reversed (AmxBlocks::Applies). The tiles keep
// flash_fwd.cc's layout, query rows in the columns, so the softmax, masks, dropout and the rest of
// the task are unchanged:
//
//   St (keys × rows)  = K_blk (16 keys × 32 channels, loaded from K's rows as they lie)
//                       · Qp (16 channel pairs × 16 rows, the task's query words packed once)
//   Ot (Dv × rows)   += Vt (16 channels × 32 keys: a block's value rows, pairs of keys
//                       interleaved and transposed) · Pp (16 key pairs × 16 rows: P rounded)
//
// Numerics (docs/numerics.md): the products of two bfloat16 are exact in float32 and TDPBF16PS
// adds them to float32 sums (flushing denormal inputs and results), so the scores are the float32
// path's within its rounding bound, and the scale is applied to the sums (the FMA path scales Q
// first). P is rounded to bfloat16 for the second product, as FlashAttention does on GPUs; the
// row sums l stay those of the unrounded P. The intrinsics need their own target (Highway 1.0
// has no tile ops), as decode_amx-inl.h's.
#if defined(MHA_KERNELS_CPU_FLASH_AMX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_FLASH_AMX_INL_H_
#undef MHA_KERNELS_CPU_FLASH_AMX_INL_H_
#else
#define MHA_KERNELS_CPU_FLASH_AMX_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/amx_config.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/flash_blocks-inl.h"
#include "kernels/cpu/transpose-inl.h"
#include "kernels/workspace.h"
#include "mha/half.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace flash {

#if HWY_TARGET == HWY_AVX3

// Rows per task with the tiles: four row tiles, so the 2 × 2 result blocks are all whole (48, the
// float32 tiles' choice, leaves a half-empty block per step and measured slower; 96 and 128 were
// level with 64 within the noise on 2026-12-06, docs/benchmarks.md).
constexpr int64_t kAmxRows = 64;

#define MHA_AMX_TARGET __attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16,amx-tile,amx-bf16")))

// Every tile 16 rows of 64 bytes: tiles 0-3 hold four 16 × 16 float32 blocks of a result (2 × 2),
// 4-5 two tiles of the left operand, 6-7 two of the right one.
MHA_AMX_TARGET inline void LoadTileConfig() {
  AmxTileConfig config;
  for (int x = 0; x < 8; ++x) {
    config.rows[x] = 16;
    config.colsb[x] = 64;
  }
  // GCC 12 does not see ldtilecfg read the configuration and drops its stores (as in
  // decode_amx-inl.h): the asm statement makes the object escape.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Two operand tiles side by side: the first at `at`, the second `next` bytes on (if `two`), each
// 16 rows of `ld` bytes; a product step's operands lie `step` bytes on from the last step's.
struct TileOperands {
  const char* at;
  size_t ld, next, step;
  bool two;
};

// Result tiles 0-3 += Σ over `steps` steps of the left operands (tiles 4, 5) times the right
// ones (6, 7): result tile 2i + j from left tile i and right tile j.
MHA_AMX_TARGET inline void TileProducts(const TileOperands& left, const TileOperands& right, size_t steps) {
  for (size_t x = 0; x < steps; ++x) {
    const char* a = left.at + x * left.step;
    const char* b = right.at + x * right.step;
    _tile_loadd(4, a, left.ld);
    _tile_loadd(6, b, right.ld);
    _tile_dpbf16ps(0, 4, 6);
    if (right.two) {
      _tile_loadd(7, b + right.next, right.ld);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (left.two) {
      _tile_loadd(5, a + left.next, left.ld);
      _tile_dpbf16ps(2, 5, 6);
      if (right.two) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// The result tiles in use to or from c (rows of ldc floats): tile 2i + j at 16·i rows and 16·j
// columns on, for i < 1 + two_left and j < 1 + two_right.
MHA_AMX_TARGET inline void LoadResults(const float* c, size_t ldc, bool two_left, bool two_right) {
  const size_t bytes = ldc * sizeof(float);
  _tile_loadd(0, c, bytes);
  if (two_right) _tile_loadd(1, c + 16, bytes);
  if (two_left) _tile_loadd(2, c + 16 * ldc, bytes);
  if (two_left && two_right) _tile_loadd(3, c + 16 * ldc + 16, bytes);
}
MHA_AMX_TARGET inline void StoreResults(float* c, size_t ldc, bool two_left, bool two_right) {
  const size_t bytes = ldc * sizeof(float);
  _tile_stored(0, c, bytes);
  if (two_right) _tile_stored(1, c + 16, bytes);
  if (two_left) _tile_stored(2, c + 16 * ldc, bytes);
  if (two_left && two_right) _tile_stored(3, c + 16 * ldc + 16, bytes);
}

// Words 0-15 of x and words 16-31 interleaved: word 2i from i, word 2i + 1 from 16 + i.
MHA_AMX_TARGET inline __m512i InterleaveHalves(__m512i x) {
  const __m512i idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                        0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                        0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
  return _mm512_permutexvar_epi16(idx, x);
}

// Channel pairs of M rows (M a multiple of 16): pairs[c][r] holds channels 2c and 2c + 1 of row
// r in one dword, (depth / 2) × M of them, zero where row(r) is null. row(r): the row's first
// element, its channels cs elements apart. Unit-stride rows are read as 16 dwords (32 channels)
// and transposed 16 rows at a time (Transpose16 moves bits only).
template <class Row>
MHA_AMX_TARGET void PackChannelPairs(const Row& row, int64_t cs, size_t depth, size_t M, uint32_t* pairs) {
  const size_t n = depth / 2;
  if (cs != 1) {
    for (size_t r = 0; r < M; ++r) {
      const bfloat16* x = row(r);
      for (size_t c = 0; c < n; ++c) {
        const int64_t at = static_cast<int64_t>(2 * c) * cs;
        pairs[c * M + r] = x ? uint32_t{x[at].bits} | uint32_t{x[at + cs].bits} << 16 : 0;
      }
    }
    return;
  }
  for (size_t r0 = 0; r0 < M; r0 += 16) {
    for (size_t c0 = 0; c0 < n; c0 += 16) {
      __m512 w[16];
      for (size_t x = 0; x < 16; ++x) {
        const bfloat16* src = row(r0 + x);
        w[x] = src ? _mm512_loadu_ps(reinterpret_cast<const float*>(src + 2 * c0)) : _mm512_setzero_ps();
      }
      Transpose16(w);
      for (size_t c = 0; c < 16; ++c) _mm512_store_ps(reinterpret_cast<float*>(pairs + (c0 + c) * M + r0), w[c]);
    }
  }
}

// St (keys × M) = the sums Σ_c row_j[c] · pairs[c][r] for keys a .. a + n of rows at base (row
// stride rs, `depth` channels, unit stride; rows past `last` repeat it, through stage: kKeyBlock
// × depth words); rows n .. to a multiple of 16 are written and not read.
MHA_AMX_TARGET inline void TileSums(const bfloat16* base, int64_t rs, int64_t a, int64_t n, int64_t last, size_t depth,
                                    const uint32_t* pairs, size_t M, uint16_t* stage, float* st) {
  const size_t nk = static_cast<size_t>(n + 15) / 16 * 16;
  const uint16_t* k = reinterpret_cast<const uint16_t*>(base + a * rs);
  int64_t stride = rs;
  if (a + static_cast<int64_t>(nk) - 1 > last) {  // the block's last tile reads past the end
    for (size_t x = 0; x < nk; ++x) {
      const bfloat16* row = base + std::min<int64_t>(a + static_cast<int64_t>(x), last) * rs;
      std::memcpy(stage + x * depth, row, depth * sizeof(uint16_t));
    }
    k = stage;
    stride = static_cast<int64_t>(depth);
  }
  const size_t kb = static_cast<size_t>(stride) * sizeof(uint16_t), qb = M * sizeof(uint32_t);
  const size_t key_tiles = nk / 16, row_tiles = M / 16;
  for (size_t kt = 0; kt < key_tiles; kt += 2) {
    const bool k1 = kt + 1 < key_tiles;
    for (size_t rt = 0; rt < row_tiles; rt += 2) {
      const bool r1 = rt + 1 < row_tiles;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      // Steps of 32 channels: 64 bytes along a key row, 16 channel-pair rows down the pairs.
      const TileOperands keys{reinterpret_cast<const char*>(k + kt * 16 * static_cast<size_t>(stride)), kb, 16 * kb,
                              64, k1};
      const TileOperands rows{reinterpret_cast<const char*>(pairs + rt * 16), qb, 64, 16 * qb, r1};
      TileProducts(keys, rows, depth / 32);
      StoreResults(st + kt * 16 * M + rt * 16, M, k1, r1);
    }
  }
}

// Query row r of task t (bfloat16 q), or null for an invalid row.
inline const bfloat16* QueryRow(const AttentionParams& p, const TaskRows& t, size_t r) {
  if (!t.valid[r]) return nullptr;
  return static_cast<const bfloat16*>(p.q) + t.b * p.q_stride[0] + t.head[r] * p.q_stride[1] +
         t.query[r] * p.q_stride[2];
}

// The scores St (keys × rows) of keys a .. a + n (of the head's rows kbase, stride ks, the last
// `last`) against the task's query pairs qp: the sums times scale. A score that is not finite is
// taken again as the float path takes it, Σ k·(q·scale): an infinite or NaN input gives the same
// Inf or NaN, and a sum q·k past the float range that the scaled products stay inside (a small
// explicit scale) its finite value.
MHA_AMX_TARGET inline void TileScores(const AttentionParams& p, const TaskRows& t, const uint32_t* qp, uint16_t* stage,
                                      const bfloat16* kbase, int64_t ks, int64_t a, int64_t n, int64_t last,
                                      float scale, float* st) {
  const size_t M = t.mpad, depth = static_cast<size_t>(p.head_dim_qk);
  TileSums(kbase, ks, a, n, last, depth, qp, M, stage, st);
  const __m512 sc = _mm512_set1_ps(scale), inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __mmask16 bad = 0;
  for (size_t x = 0; x < static_cast<size_t>(n) * M; x += 16) {
    const __m512 s = _mm512_mul_ps(_mm512_load_ps(st + x), sc);
    _mm512_store_ps(st + x, s);
    bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(s), inf, _CMP_NLT_UQ);
  }
  if (bad == 0) return;
  for (int64_t j = 0; j < n; ++j) {
    const bfloat16* key = kbase + std::min(a + j, last) * ks;
    for (size_t r = 0; r < M; ++r) {
      float& s = st[static_cast<size_t>(j) * M + r];
      if (!t.valid[r] || std::isfinite(s)) continue;
      // Row r's score as the float path sums it (QkTile: one FMA per channel, in order).
      const bfloat16* q = QueryRow(p, t, r);
      s = 0.0f;
      for (size_t c = 0; c < depth; ++c) {
        s = std::fma(to_float(key[c]), to_float(q[static_cast<int64_t>(c) * p.q_stride[3]]) * scale, s);
      }
    }
  }
}

// Words of `width` channels of rows v (row stride vs) transposed: out[c][j] = V[j][c] for j < nk
// (zero from nv on), rows of ld words; 32 rows × 16 channels at a time: pairs of rows interleaved
// into dwords, then a 16 × 16 dword transpose. width % 16 == 0, nk % 32 == 0.
MHA_AMX_TARGET inline void TransposeWords(const bfloat16* v, int64_t vs, size_t nv, size_t nk, size_t width, size_t ld,
                                          uint16_t* out) {
  const __m256i zero = _mm256_setzero_si256();
  for (size_t k0 = 0; k0 < nk; k0 += 32) {
    for (size_t c0 = 0; c0 < width; c0 += 16) {
      auto row = [&](size_t j) {  // channels c0 .. c0 + 16 of row j
        if (j >= nv) return zero;
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + static_cast<int64_t>(j) * vs + c0));
      };
      __m512 w[16];
      for (size_t x = 0; x < 16; ++x) {
        const size_t j = k0 + 2 * x;
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(row(j)), row(j + 1), 1);
        w[x] = _mm512_castsi512_ps(InterleaveHalves(both));
      }
      Transpose16(w);  // w[c]: channel c0 + c of the 32 rows, a pair per dword
      for (size_t c = 0; c < 16; ++c) _mm512_store_ps(reinterpret_cast<float*>(out + (c0 + c) * ld + k0), w[c]);
    }
  }
}

// Holds the tile state for one forward task of bfloat16 inputs and the task's packed query.
class AmxBlocks {
 public:
  static bool Applies(const AttentionParams& p) {
    // Key rows laid forward (stride >= 0): a tile load's rows step by the stride from the first.
    return p.dtype == DType::kBF16 && p.head_dim_qk % 32 == 0 && p.head_dim_qk > 0 && p.head_dim_v % 16 == 0 &&
           p.head_dim_v > 0 && p.k_stride[3] == 1 && p.v_stride[3] == 1 && p.k_stride[2] >= 0 && forward_amx_bf16();
  }

  // Packs the task's query rows (zeros for invalid rows): Qp[c][r] holds channels 2c and 2c + 1 of
  // row r in one dword, (D / 2) × M of them. Loads the tile configuration.
  MHA_AMX_TARGET AmxBlocks(const AttentionParams& p, const TaskRows& t, Workspace& ws)
      : p_(p),
        t_(t),
        M_(t.mpad),
        depth_(static_cast<size_t>(p.head_dim_qk)),
        dv_(static_cast<size_t>(p.head_dim_v)),
        qp_(ws.get<uint32_t>(Workspace::kAmxQueryPairs, depth_ / 2 * M_)),
        pp_(ws.get<uint32_t>(Workspace::kAmxProbPairs, kKeyBlock / 2 * M_)),
        vt_(ws.get<uint16_t>(Workspace::kAmxValueT, dv_ * kKeyBlock)),
        kstage_(ws.get<uint16_t>(Workspace::kAmxKeyStage, kKeyBlock * depth_)) {
    PackChannelPairs([&](size_t r) { return QueryRow(p_, t_, r); }, p_.q_stride[3], depth_, M_, qp_);
    LoadTileConfig();
  }
  MHA_AMX_TARGET ~AmxBlocks() { _tile_release(); }
  AmxBlocks(const AmxBlocks&) = delete;
  AmxBlocks& operator=(const AmxBlocks&) = delete;

  // St rows 0 .. n (keys a .. a + n; more rows, to a multiple of 16, are written and not read):
  // TileScores of the task's query. kbase: the head's key rows (row stride ks); rows past last
  // repeat it.
  MHA_AMX_TARGET void Scores(const bfloat16* kbase, int64_t ks, int64_t a, int64_t n, int64_t last, float scale,
                             float* st) const {
    TileScores(p_, t_, qp_, kstage_, kbase, ks, a, n, last, scale, st);
  }

  // Vt of the block's keys 0 .. nv (value rows at v, row stride vs) into vt (Dv × kKeyBlock words):
  // Vt[c][j] = V[j][c], pairs of keys interleaved into dwords, keys nv .. to a multiple of 32 zero.
  MHA_AMX_TARGET void PackValues(const bfloat16* v, int64_t vs, int64_t nv, uint16_t* vt) const {
    TransposeWords(v, vs, static_cast<size_t>(nv), static_cast<size_t>(nv + 31) / 32 * 32, dv_, kKeyBlock, vt);
  }

  // Ot = alpha · Ot + Vᵀ · P for the block's keys 0 .. nv and P in St rows 0 .. nv. vt: the block's
  // values packed by PackValues, or null to pack them here from v (row stride vs).
  MHA_AMX_TARGET void Output(const bfloat16* v, int64_t vs, int64_t nv, const uint16_t* vt, const float* st,
                             const float* alpha, float* ot) const {
    const size_t nk = static_cast<size_t>(nv + 31) / 32 * 32;
    PackProbabilities(st, static_cast<size_t>(nv), nk);
    if (vt == nullptr) {
      PackValues(v, vs, nv, vt_);
      vt = vt_;
    }
    __mmask16 rescale = 0;  // once every row's maximum has settled, α = 1 and Ot stays
    for (size_t r = 0; r < M_; r += 16) {
      rescale |= _mm512_cmp_ps_mask(_mm512_load_ps(alpha + r), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
    }
    for (size_t c = 0; c < dv_ && rescale != 0; ++c) {
      for (size_t r = 0; r < M_; r += 16) {
        float* o = ot + c * M_ + r;
        _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), _mm512_load_ps(alpha + r)));
      }
    }
    const size_t pb = M_ * sizeof(uint32_t), vb = kKeyBlock * sizeof(uint16_t);
    const size_t col_tiles = dv_ / 16, row_tiles = M_ / 16;
    for (size_t ct = 0; ct < col_tiles; ct += 2) {
      const bool c1 = ct + 1 < col_tiles;
      for (size_t rt = 0; rt < row_tiles; rt += 2) {
        const bool r1 = rt + 1 < row_tiles;
        float* o = ot + ct * 16 * M_ + rt * 16;
        LoadResults(o, M_, c1, r1);
        // Steps of 32 keys: 64 bytes along a row of Vt, 16 key-pair rows down Pp.
        const TileOperands columns{reinterpret_cast<const char*>(vt + ct * 16 * kKeyBlock), vb, 16 * vb, 64, c1};
        const TileOperands rows{reinterpret_cast<const char*>(pp_ + rt * 16), pb, 64, 16 * pb, r1};
        TileProducts(columns, rows, nk / 32);
        StoreResults(o, M_, c1, r1);
      }
    }
  }

 private:
  // Pp[j][r] = P[2j][r] and P[2j + 1][r] rounded to bfloat16 (round to nearest even), keys
  // nv .. nk zero.
  MHA_AMX_TARGET void PackProbabilities(const float* st, size_t nv, size_t nk) const {
    const __m512 zero = _mm512_setzero_ps();
    for (size_t j = 0; j < nk; j += 2) {
      for (size_t r = 0; r < M_; r += 16) {
        const __m512 p0 = j < nv ? _mm512_load_ps(st + j * M_ + r) : zero;
        const __m512 p1 = j + 1 < nv ? _mm512_load_ps(st + (j + 1) * M_ + r) : zero;
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));
        _mm512_store_si512(pp_ + j / 2 * M_ + r, InterleaveHalves(both));
      }
    }
  }

  const AttentionParams& p_;
  const TaskRows& t_;
  size_t M_, depth_, dv_;
  uint32_t* qp_;      // (D / 2) × M
  uint32_t* pp_;      // (kKeyBlock / 2) × M
  uint16_t* vt_;      // Dv × kKeyBlock: a block's values packed by this task
  uint16_t* kstage_;  // kKeyBlock × D: a block's key rows where its last tile would read past the end
};

// A thread's value blocks of one kv head in tile layout (PackValues: Dv × kKeyBlock words a
// block), kept across its tasks of that head in one call, so that it packs a block once rather
// than once per query block of the head: that saved 8-13% of the forward's time from T = 512 on
// (docs/benchmarks.md). Tasks are handed out head by head (flash_plan.h), so a thread
// does not come back to a head it left and keeps one head's blocks (in its workspace); were it
// to, it would pack them again. A block the task sees only in part (a window's or a length's
// edge, the causal diagonal) is packed into the task's scratch, as is every block where one
// head's blocks take more than forward_value_keep_limit(). Not shared between threads: one thread's blocks read
// by another core measured slower than packing them again for T <= 256 and gained less
// elsewhere. A block's words are the same whoever packs them: the results do not depend on any
// of this.
class ThreadValues {
 public:
  // For a task of kv head `head` (b · kv_heads + hk) of forward call `call`.
  ThreadValues(const AttentionParams& p, uint64_t call, int64_t head, Workspace& ws)
      : per_head_(p.kv_len / kKeyBlock + (p.kv_len % kKeyBlock != 0)),  // no kv_len + 63 to overflow
        block_words_(static_cast<size_t>(p.head_dim_v) * kKeyBlock) {
    const size_t block_bytes = block_words_ * sizeof(uint16_t);
    if (per_head_ == 0 || static_cast<size_t>(per_head_) > forward_value_keep_limit() / block_bytes) return;
    words_ = ws.get<uint16_t>(Workspace::kAmxThreadValues, static_cast<size_t>(per_head_) * block_words_);
    ready_ = ws.get<uint8_t>(Workspace::kAmxThreadReady, static_cast<size_t>(per_head_));
    Tag& tag = ThreadTag();
    if (tag.call != call || tag.head != head) {
      std::fill(ready_, ready_ + per_head_, uint8_t{0});
      tag = {call, head};
    }
  }

  // Block x of the head (a block the task sees whole), packed by pack(words) if this thread has
  // not packed it yet; null where nothing is kept.
  template <class Pack>
  const uint16_t* Block(int64_t x, const Pack& pack) {
    if (words_ == nullptr) return nullptr;
    uint16_t* words = words_ + static_cast<size_t>(x) * block_words_;
    if (!ready_[x]) {
      pack(words);
      ready_[x] = 1;
    }
    return words;
  }

  // A number for each forward call, so that a thread's blocks from an earlier call, of the same
  // head and memory perhaps rewritten since, are not taken for this call's.
  static uint64_t NextCall() {
    static std::atomic<uint64_t> calls{0};
    return calls.fetch_add(1, std::memory_order_relaxed) + 1;
  }

 private:
  struct Tag {
    uint64_t call = 0;  // 0: none yet
    int64_t head = -1;
  };
  static Tag& ThreadTag() {
    thread_local Tag tag;
    return tag;
  }

  int64_t per_head_;    // blocks of a head: ⌈kv_len / kKeyBlock⌉
  size_t block_words_;  // Dv × kKeyBlock
  uint16_t* words_ = nullptr;  // per_head blocks; null: nothing kept
  uint8_t* ready_ = nullptr;   // per block: packed by this thread in this call for this head
};

#undef MHA_AMX_TARGET

#else

// Other targets have no tile products: Applies is false, and nothing else is called.
constexpr int64_t kAmxRows = kTargetRows;
class AmxBlocks {
 public:
  static bool Applies(const AttentionParams&) { return false; }
  AmxBlocks(const AttentionParams&, const TaskRows&, Workspace&) {}
  void Scores(const bfloat16*, int64_t, int64_t, int64_t, int64_t, float, float*) const {}
  void PackValues(const bfloat16*, int64_t, int64_t, uint16_t*) const {}
  void Output(const bfloat16*, int64_t, int64_t, const uint16_t*, const float*, const float*, float*) const {}
};
class ThreadValues {
 public:
  ThreadValues(const AttentionParams&, uint64_t, int64_t, Workspace&) {}
  template <class Pack>
  const uint16_t* Block(int64_t, const Pack&) {
    return nullptr;
  }
  static uint64_t NextCall() { return 0; }
};

#endif

}  // namespace flash
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_FLASH_AMX_INL_H_
