// The fast (tiled, SIMD) attention kernels. Each entry point chooses the best SIMD target of
// this CPU once per call (Highway dynamic dispatch) and splits its tasks over the threads.
#ifndef MHA_KERNELS_CPU_FLASH_H_
#define MHA_KERNELS_CPU_FLASH_H_

#include <string>
#include <vector>

#include "kernels/attention_params.h"

namespace mha::kernels {

// out (and lse) of p. lse2, if not null: (B, Hq, Tq) contiguous, receives the LSE in log2
// units for the weights pass. Ignores p.weights.
void flash_forward(const AttentionParams& p, float* lse2, int num_threads);

// Writes p.weights (per head or averaged) from lse2 of flash_forward.
void flash_weights(const AttentionParams& p, const float* lse2, int num_threads);

// "flash_fwd_f32_AVX3_r48_k64": the variant that runs on this CPU.
std::string flash_forward_name();

// SIMD targets compiled in and supported here, best first ("AVX3", "AVX2", "EMU128"), and a
// way to restrict dispatch to one of them (tests, benchmarks); "" restores the default.
std::vector<std::string> simd_targets();
void force_simd_target(const std::string& name);

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_FLASH_H_
