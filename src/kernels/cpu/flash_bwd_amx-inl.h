// The bfloat16 backward's five block products with AMX tiles (TDPBF16PS), in place of widening
// Q, K, V and dO to float32 for flash_bwd.cc's FMA tiles: AVX3 target, where the CPU has AMX-BF16
// and the OS grants the tile state (backward_amx_bf16()), for head dims D % 32 == 0 and
// Dv % 32 == 0 and unit-stride K and V rows laid forward (AmxGrads::Applies). flash_bwd.cc's
// block layout stays (St, dPt and dSt: keys × rows, query rows in the columns), so its masks,
// softcap, dropout and dS are unchanged:
//
//   St  (keys × rows)  = K_blk rows · Qp  (Q's channel pairs, once per query block), × scale
//   dPt (keys × rows)  = V_blk rows · dOp (dO's channel pairs)
//   dV  (keys × Dv)   += Pb  (P_d rounded to bfloat16, keys × rows) · dOi (dO's rows in pairs)
//   dK  (keys × D)    += dSb (dS rounded to bfloat16, keys × rows)  · Qi  (Q's rows in pairs)
//   dQᵀ (D × rows)    += Kt  (the key block transposed, once per key block) · dSp (dSb in key pairs)
//
// Numerics (docs/numerics.md): St is the forward tile path's scores (flash_amx-inl.h, the same
// sums in the same order), so P is exp(S − lse) of the forward's own S. P_d and dS are rounded
// to bfloat16 for the last three products, as FlashAttention on GPUs and PyTorch's CPU flash
// backward for bfloat16 do; each product of two bfloat16 is exact and summed in float32.
// dQ is kept transposed per query block (D × rows) and written out at the end of the task.
#if defined(MHA_KERNELS_CPU_FLASH_BWD_AMX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_FLASH_BWD_AMX_INL_H_
#undef MHA_KERNELS_CPU_FLASH_BWD_AMX_INL_H_
#else
#define MHA_KERNELS_CPU_FLASH_BWD_AMX_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "kernels/attention_params.h"
#include "kernels/cpu/flash.h"
#include "kernels/cpu/flash_amx-inl.h"
#include "kernels/cpu/flash_blocks-inl.h"
#include "kernels/ref/attention_bwd_ref.h"
#include "kernels/workspace.h"
#include "mha/half.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace flash {

#if HWY_TARGET == HWY_AVX3

#define MHA_AMX_TARGET __attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16,amx-tile,amx-bf16")))

// Holds the tile state for one backward task (a batch and kv head) of bfloat16 arguments, and
// its key block's transposed rows and a block pair's rounded P_d and dS.
class AmxGrads {
 public:
  static bool Applies(const AttentionParams& p) {
    return p.dtype == DType::kBF16 && p.head_dim_qk % 32 == 0 && p.head_dim_qk > 0 && p.head_dim_v % 32 == 0 &&
           p.head_dim_v > 0 && p.k_stride[3] == 1 && p.v_stride[3] == 1 && p.k_stride[2] >= 0 && p.v_stride[2] >= 0 &&
           backward_amx_bf16();
  }

  // Dwords of one query block's packing (Pack) for up to m rows: Qp, dOp, Qi and dOi.
  static size_t PackedWords(const AttentionParams& p, size_t m) {
    const size_t depth = static_cast<size_t>(p.head_dim_qk), dv = static_cast<size_t>(p.head_dim_v);
    return (depth + dv) / 2 * m + Pad32(m) / 2 * (depth + dv);
  }

  // Whether task (b, hk)'s Q and dO (of its query heads), K and V hold only finite values. A call
  // with an infinite or NaN argument takes the float32 tiles (flash_bwd.cc): they touch only the
  // keys and rows a block pair sees, while a tile product also adds 0 · x for the keys and rows
  // around them, and 0 · Inf is NaN; so Inf and NaN land where the float path puts them.
  MHA_AMX_TARGET static bool Finite(const AttentionParams& p, const AttentionGradParams& g, int64_t b, int64_t hk) {
    const int64_t G = p.group();
    const auto* q = static_cast<const bfloat16*>(p.q) + b * p.q_stride[0];
    const auto* dout = static_cast<const bfloat16*>(g.grad_out) + b * g.grad_out_stride[0];
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
      if (!RowsFinite(q + h * p.q_stride[1], p.q_stride[2], p.q_len, p.q_stride[3], p.head_dim_qk) ||
          !RowsFinite(dout + h * g.grad_out_stride[1], g.grad_out_stride[2], p.q_len, g.grad_out_stride[3],
                      p.head_dim_v)) {
        return false;
      }
    }
    const auto* k = static_cast<const bfloat16*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
    const auto* v = static_cast<const bfloat16*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
    return RowsFinite(k, p.k_stride[2], p.kv_len, 1, p.head_dim_qk) &&
           RowsFinite(v, p.v_stride[2], p.kv_len, 1, p.head_dim_v);
  }

  // mmax: the most rows of a query block (a multiple of 16). Loads the tile configuration.
  MHA_AMX_TARGET AmxGrads(const AttentionParams& p, const AttentionGradParams& g, size_t mmax, Workspace& ws)
      : p_(p),
        g_(g),
        depth_(static_cast<size_t>(p.head_dim_qk)),
        dv_(static_cast<size_t>(p.head_dim_v)),
        kt_(ws.get<uint16_t>(Workspace::kAmxBwdKeysT, depth_ * kKeyBlock)),
        pb_(ws.get<uint16_t>(Workspace::kAmxBwdProbs, kKeyBlock * Pad32(mmax))),
        dsb_(ws.get<uint16_t>(Workspace::kAmxBwdGrads, kKeyBlock * Pad32(mmax))),
        dsp_(ws.get<uint32_t>(Workspace::kAmxBwdGradPairs, kKeyBlock / 2 * mmax)),
        stage_(ws.get<uint16_t>(Workspace::kAmxKeyStage, kKeyBlock * std::max(depth_, dv_))) {
    LoadTileConfig();
  }
  MHA_AMX_TARGET ~AmxGrads() { _tile_release(); }
  AmxGrads(const AmxGrads&) = delete;
  AmxGrads& operator=(const AmxGrads&) = delete;

  // Kt[c][j] = K[j][c] for the key block's nk rows at keys (row stride ks); keys nk .. 64 zero.
  MHA_AMX_TARGET void PackKeys(const bfloat16* keys, int64_t ks, size_t nk) const {
    TransposeWords(keys, ks, nk, kKeyBlock, depth_, kKeyBlock, kt_);
  }

  // The query block's operands into words (PackedWords(p, t.mpad) of them): Q's and dO's channel
  // pairs (the right operands of St and dPt) and their rows interleaved in pairs (of dK and dV).
  // Invalid rows and rows from t.mpad to a multiple of 32 are zero.
  MHA_AMX_TARGET void Pack(const TaskRows& t, uint32_t* words) const {
    const Packed w = Layout(t, words);
    const size_t m = t.mpad;
    auto q = [&](size_t r) { return r < m ? QueryRow(p_, t, r) : nullptr; };
    auto dout = [&](size_t r) -> const bfloat16* {
      if (r >= m || !t.valid[r]) return nullptr;
      const Strides4& s = g_.grad_out_stride;
      return static_cast<const bfloat16*>(g_.grad_out) + t.b * s[0] + t.head[r] * s[1] + t.query[r] * s[2];
    };
    PackChannelPairs(q, p_.q_stride[3], depth_, m, w.qp);
    PackChannelPairs(dout, g_.grad_out_stride[3], dv_, m, w.dop);
    InterleaveRows(q, p_.q_stride[3], depth_, Pad32(m), w.qi);
    InterleaveRows(dout, g_.grad_out_stride[3], dv_, Pad32(m), w.doi);
  }

  // St rows 0 .. n (keys a .. a + n of the head's rows kbase, stride ks; rows past last repeat
  // it): the forward tile path's scores (TileScores).
  MHA_AMX_TARGET void Scores(const TaskRows& t, const uint32_t* words, const bfloat16* kbase, int64_t ks, int64_t a,
                             int64_t n, int64_t last, float* st) const {
    TileScores(p_, t, Layout(t, words).qp, stage_, kbase, ks, a, n, last, p_.scale, st);
  }

  // dPt rows 0 .. n: V rows a .. a + n (of vbase, stride vs; rows past last repeat it) · dOᵀ.
  MHA_AMX_TARGET void GradP(const TaskRows& t, const uint32_t* words, const bfloat16* vbase, int64_t vs, int64_t a,
                            int64_t n, int64_t last, float* dpt) const {
    TileSums(vbase, vs, a, n, last, dv_, Layout(t, words).dop, t.mpad, stage_, dpt);
  }

  // For block rows 0 .. nv of pd (P with dropout) and ds (dS), keys koff .. koff + nv of the key
  // block: dv (64 × Dv) += P_dᵀ · dO, dk (64 × D) += dSᵀ · Q (unscaled), dqt (D × rows, this query
  // block's dQᵀ) += Kᵀ · dS, with P_d and dS rounded to bfloat16.
  MHA_AMX_TARGET void Products(const TaskRows& t, const uint32_t* words, const float* pd, const float* ds, size_t koff,
                               size_t nv, float* dv, float* dk, float* dqt) const {
    const Packed w = Layout(t, words);
    const size_t m = t.mpad, m2 = Pad32(m);
    const size_t lo = koff / 32 * 32, hi = Pad32(koff + nv);  // keys of whole 32-key steps
    RoundRows(pd, koff, nv, lo, hi, m, pb_);
    RoundRows(ds, koff, nv, lo, hi, m, dsb_);
    KeyProducts(pb_, m2, lo, hi, w.doi, dv_, dv);
    KeyProducts(dsb_, m2, lo, hi, w.qi, depth_, dk);
    // dSp[x][r]: dS of keys 2x and 2x + 1 for row r in one dword.
    for (size_t x = lo / 2; x < hi / 2; ++x) {
      for (size_t r = 0; r < m; r += 16) {
        const __m256i k0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(dsb_ + 2 * x * m2 + r));
        const __m256i k1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(dsb_ + (2 * x + 1) * m2 + r));
        _mm512_store_si512(dsp_ + x * m + r, InterleaveHalves(_mm512_inserti64x4(_mm512_castsi256_si512(k0), k1, 1)));
      }
    }
    // dQᵀ: channel tiles of Kt (pairs: D % 32 == 0) × row tiles of dSp, steps of 32 keys.
    const size_t row_tiles = m / 16, kb = kKeyBlock * sizeof(uint16_t), pb = m * sizeof(uint32_t);
    for (size_t ct = 0; ct < depth_ / 16; ct += 2) {
      for (size_t rt = 0; rt < row_tiles; rt += 2) {
        const bool r1 = rt + 1 < row_tiles;
        float* o = dqt + ct * 16 * m + rt * 16;
        LoadResults(o, m, true, r1);
        const TileOperands channels{reinterpret_cast<const char*>(kt_ + ct * 16 * kKeyBlock + lo), kb, 16 * kb, 64,
                                    true};
        const TileOperands rows{reinterpret_cast<const char*>(dsp_ + lo / 2 * m + rt * 16), pb, 64, 16 * pb, r1};
        TileProducts(channels, rows, (hi - lo) / 32);
        StoreResults(o, m, true, r1);
      }
    }
  }

 private:
  struct Packed {
    uint32_t *qp, *dop, *qi, *doi;
  };

  static size_t Pad32(size_t x) { return (x + 31) / 32 * 32; }

  // Whether `rows` rows at base (row stride rs) of `width` elements cs apart (width % 32 == 0) are
  // finite: a bfloat16 is not where its exponent bits are all ones.
  MHA_AMX_TARGET static bool RowsFinite(const bfloat16* base, int64_t rs, int64_t rows, int64_t cs, int64_t width) {
    constexpr uint16_t kExponent = 0x7F80;
    const __m512i exponent = _mm512_set1_epi16(static_cast<short>(kExponent));
    for (int64_t i = 0; i < rows; ++i) {
      const bfloat16* row = base + i * rs;
      if (cs != 1) {
        for (int64_t c = 0; c < width; ++c) {
          if ((row[c * cs].bits & kExponent) == kExponent) return false;
        }
        continue;
      }
      for (int64_t c = 0; c < width; c += 32) {
        const __m512i x = _mm512_and_si512(_mm512_loadu_si512(row + c), exponent);
        if (_mm512_cmpeq_epi16_mask(x, exponent) != 0) return false;
      }
    }
    return true;
  }

  Packed Layout(const TaskRows& t, const uint32_t* words) const {
    uint32_t* qp = const_cast<uint32_t*>(words);
    const size_t m = t.mpad;
    uint32_t* dop = qp + depth_ / 2 * m;
    uint32_t* qi = dop + dv_ / 2 * m;
    return {qp, dop, qi, qi + Pad32(m) / 2 * depth_};
  }

  // out[x][c] (rows of `width` dwords) holds channel c of rows 2x and 2x + 1 for x < m2 / 2: the
  // rows interleaved in pairs (zero where row(r) is null). row(r): the row's first element, its
  // channels cs elements apart.
  template <class Row>
  MHA_AMX_TARGET static void InterleaveRows(const Row& row, int64_t cs, size_t width, size_t m2, uint32_t* out) {
    const __m256i zero = _mm256_setzero_si256();
    for (size_t x = 0; x < m2 / 2; ++x) {
      const bfloat16 *r0 = row(2 * x), *r1 = row(2 * x + 1);
      uint32_t* o = out + x * width;
      if (cs != 1) {
        for (size_t c = 0; c < width; ++c) {
          const int64_t at = static_cast<int64_t>(c) * cs;
          o[c] = (r0 ? uint32_t{r0[at].bits} : 0) | (r1 ? uint32_t{r1[at].bits} : 0) << 16;
        }
        continue;
      }
      for (size_t c = 0; c < width; c += 16) {
        const __m256i a = r0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + c)) : zero;
        const __m256i b = r1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + c)) : zero;
        _mm512_storeu_si512(o + c, InterleaveHalves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
      }
    }
  }

  // out rows lo .. hi (of Pad32(m) words): row koff + j = src row j (m floats) rounded to bfloat16
  // (round to nearest even) for j < nv, columns m .. Pad32(m) zero; the other rows zero.
  MHA_AMX_TARGET static void RoundRows(const float* src, size_t koff, size_t nv, size_t lo, size_t hi, size_t m,
                                       uint16_t* out) {
    const size_t m2 = Pad32(m);
    const __m512 zero = _mm512_setzero_ps();
    for (size_t j = lo; j < hi; ++j) {
      uint16_t* o = out + j * m2;
      if (j < koff || j >= koff + nv) {
        std::memset(o, 0, m2 * sizeof(uint16_t));
        continue;
      }
      const float* s = src + (j - koff) * m;
      for (size_t r = 0; r < m; r += 32) {
        const __m512 p0 = _mm512_load_ps(s + r), p1 = r + 16 < m ? _mm512_load_ps(s + r + 16) : zero;
        _mm512_store_si512(o + r, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));  // p0's words first
      }
    }
  }

  // c (64 keys × width floats) += a (keys × rows words, rows of m2) · b (rows in pairs, `width`
  // dwords a pair) for keys lo .. hi: key tiles in pairs (hi − lo is a multiple of 32), channel
  // tiles in pairs (width % 32 == 0), steps of 32 rows.
  MHA_AMX_TARGET static void KeyProducts(const uint16_t* a, size_t m2, size_t lo, size_t hi, const uint32_t* b,
                                         size_t width, float* c) {
    const size_t ab = m2 * sizeof(uint16_t), bb = width * sizeof(uint32_t);
    for (size_t k = lo; k < hi; k += 32) {
      for (size_t ch = 0; ch < width; ch += 32) {
        float* o = c + k * width + ch;
        LoadResults(o, width, true, true);
        const TileOperands keys{reinterpret_cast<const char*>(a + k * m2), ab, 16 * ab, 64, true};
        const TileOperands channels{reinterpret_cast<const char*>(b + ch), bb, 64, 16 * bb, true};
        TileProducts(keys, channels, m2 / 32);
        StoreResults(o, width, true, true);
      }
    }
  }

  const AttentionParams& p_;
  const AttentionGradParams& g_;
  size_t depth_, dv_;
  uint16_t* kt_;     // D × kKeyBlock: the key block transposed
  uint16_t* pb_;     // kKeyBlock × Pad32(rows): P_d rounded
  uint16_t* dsb_;    // kKeyBlock × Pad32(rows): dS rounded
  uint32_t* dsp_;    // (kKeyBlock / 2) × rows: dS in key pairs
  uint16_t* stage_;  // kKeyBlock × max(D, Dv): key or value rows where a tile would read past the last
};

#undef MHA_AMX_TARGET

#else

// Other targets have no tile products: Applies is false, and nothing else is called.
class AmxGrads {
 public:
  static bool Applies(const AttentionParams&) { return false; }
  static size_t PackedWords(const AttentionParams&, size_t) { return 0; }
  static bool Finite(const AttentionParams&, const AttentionGradParams&, int64_t, int64_t) { return false; }
  AmxGrads(const AttentionParams&, const AttentionGradParams&, size_t, Workspace&) {}
  void PackKeys(const bfloat16*, int64_t, size_t) const {}
  void Pack(const TaskRows&, uint32_t*) const {}
  void Scores(const TaskRows&, const uint32_t*, const bfloat16*, int64_t, int64_t, int64_t, int64_t, float*) const {}
  void GradP(const TaskRows&, const uint32_t*, const bfloat16*, int64_t, int64_t, int64_t, int64_t, float*) const {}
  void Products(const TaskRows&, const uint32_t*, const float*, const float*, size_t, size_t, float*, float*,
                float*) const {}
};

#endif

}  // namespace flash
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_FLASH_BWD_AMX_INL_H_
