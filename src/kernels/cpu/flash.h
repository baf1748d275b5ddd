// The fast (tiled, SIMD) attention kernels. Each entry point chooses the best SIMD target of
// this CPU once per call (Highway dynamic dispatch) and splits its tasks over the threads.
#ifndef MHA_KERNELS_CPU_FLASH_H_
#define MHA_KERNELS_CPU_FLASH_H_

#include <cstddef>
#include <string>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/ref/attention_bwd_ref.h"

namespace mha::kernels {

// out (and lse) of p. row_lse, if not null: (B, Hq, Tq) contiguous, receives every row's LSE
// for the weights pass. Ignores p.weights.
void flash_forward(const AttentionParams& p, float* row_lse, int num_threads);

// Writes p.weights (per head or averaged) from row_lse of flash_forward.
void flash_weights(const AttentionParams& p, const float* row_lse, int num_threads);

// "flash_fwd_f32_AVX3_r48_k64": the variant that runs on this CPU.
std::string flash_forward_name();

// The backward (p as in the forward, with p.out and p.lse the forward's results), for every
// dtype: 16-bit arguments are widened as they are read, the gradients rounded once.
void flash_backward(const AttentionParams& p, const AttentionGradParams& g, int num_threads);
// The most bytes of packed query blocks (Q and dO, both layouts) the backward keeps per thread
// to pack each block once rather than once per key block (default 8 MiB; 0 packs every time,
// which tests compare bit for bit). The results do not depend on it.
inline constexpr size_t kDefaultBackwardPackLimit = size_t{8} << 20;
size_t backward_pack_limit();
void set_backward_pack_limit(size_t bytes);

// Decoding: at most kMaxDecodeRows query rows per kv head (Tq · Hq/Hkv), no keep mask, bias,
// dropout or weights, unit-stride K/V rows (decode_applies). Writes out and lse.
inline constexpr int64_t kMaxDecodeRows = 16;
bool decode_applies(const AttentionParams& p);
void flash_decode(const AttentionParams& p, int num_threads);
std::string flash_decode_name();

// Whether the decode kernel reads int8/int4 key tiles with integer dot products (its AVX3 and AVX2
// targets: AVX-512 VNNI, else AVX2's vpmaddubsw / vpmaddwd; decode_avx512_vnni() says which), and
// an int4 cache's values with bfloat16 dot products (AVX3 target, AVX-512 BF16, where it has
// no VNNI and VBMI for decode_vnni_byte_values()): where the CPU has them, unless turned off
// (tests reach the targets' float paths so, and with allow_decode_avx512_vnni(false) the AVX3
// target's AVX2 integer path, which it takes on CPUs without VNNI).
bool decode_int8_dots();
bool decode_avx512_vnni();
bool decode_bf16_dots();
void allow_decode_dot_products(bool allow);
void allow_decode_avx512_vnni(bool allow);
// Whether the AVX3 target scores bfloat16 keys with AMX's tile products (AmxBf16Scores, in place
// of Bf16Scores' vdpbf16ps, for head dims of 32, 64, 96 and 128): where the CPU has AMX-BF16, the
// OS grants the tile state, and bfloat16 dot products are allowed, unless turned off (tests check
// both paths so).
bool decode_amx_bf16();
void allow_decode_amx(bool allow);
// Whether, with those key tiles, the bfloat16 values take AMX's tile products too (AmxBf16Values,
// in place of widening each value for float32 FMAs; up to 8 query rows per kv head, Dv % 32 == 0;
// the attention weights rounded to bfloat16): as decode_amx_bf16(), turned off on its own.
bool decode_amx_bf16_values();
void allow_decode_amx_values(bool allow);
// Whether the AVX3 target takes a bfloat16 cache's values with bfloat16 dot products on the
// attention weights rounded to bfloat16 (Bf16Output, in place of widening each value for float32
// FMAs; value passes of 64 or 32 columns), where AMX does not take them: where the CPU has AVX-512 BF16
// and runs vdpbf16ps at the FMAs' instruction rate (AMD's Zen 4 and Zen 5, with two products a
// lane; the Intel Xeons measured run it at a quarter of that rate, where the float pass is
// faster: docs/benchmarks.md) and bfloat16 dot products are allowed, unless turned off. Tests
// force it on for other CPUs with AVX-512 BF16, to check it wherever it can run.
bool decode_bf16_values();
void allow_decode_bf16_values(bool allow);
void force_decode_bf16_values(bool force);
// Whether the AVX3 target's forward takes a bfloat16 block's two products, Q·Kᵀ and P·V, with
// AMX's tile products (flash_amx-inl.h, in place of widening K and V for the float32 FMA tiles;
// head dims D % 32 == 0 and Dv % 16 == 0, unit-stride K and V rows): where the CPU has AMX-BF16
// and AVX-512 BF16, the OS grants the tile state, and bfloat16 dot products are allowed, unless
// turned off (tests check both paths so).
bool forward_amx_bf16();
void allow_forward_amx(bool allow);
// Whether the AVX3 target's backward takes a bfloat16 block's five products (Q·Kᵀ, dO·Vᵀ, Pᵀ·dO,
// dSᵀ·Q, dS·K) with AMX's tile products (flash_bwd_amx-inl.h; head dims D % 32 == 0 and
// Dv % 32 == 0, unit-stride K and V rows laid forward): under the same conditions as the forward,
// and turned off on its own.
bool backward_amx_bf16();
void allow_backward_amx(bool allow);
// The most bytes of value blocks in tile layout such a forward keeps per thread, so that a
// thread interleaves and transposes each block of a kv head once rather than once per query
// block of the head (flash_amx-inl.h, ThreadValues: one head's blocks, kv_len × Dv words; default
// 16 MiB; 0 packs every block in every task, which tests compare bit for bit). The results do not
// depend on it.
inline constexpr size_t kDefaultForwardValueKeepLimit = size_t{16} << 20;
size_t forward_value_keep_limit();
void set_forward_value_keep_limit(size_t bytes);
// Whether the AVX2 target reads an int4 cache's values with 8-bit integer products on weights
// rounded to bytes (Int4Output256), and an int8 cache's with 16-bit products on weights rounded
// to words (Int8Output256), where the CPU has AVX2 and dot products are allowed: tests turn it
// off alone (on both targets) to check the integer key products exactly.
bool decode_byte_values();
// The same on the AVX3 target with AVX-512 VNNI and VBMI (Int4OutputVnni, in place of the
// bfloat16 dot products), unless VNNI or the byte values are turned off.
bool decode_vnni_byte_values();
// Whether the AVX3 target reads an int8 cache's values with AVX-512 VNNI's 16-bit products on
// weights rounded to words (Int8OutputVnni, in place of the float pass), where the CPU has VNNI,
// unless VNNI or the byte values (which turns off every integer value pass) are turned off.
bool decode_vnni_word_values();
void allow_decode_byte_values(bool allow);

// SIMD targets compiled in and supported here, best first ("AVX3", "AVX2", "EMU128"), and a
// way to restrict dispatch to one of them (tests, benchmarks); "" restores the default.
std::vector<std::string> simd_targets();
void force_simd_target(const std::string& name);

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_FLASH_H_
