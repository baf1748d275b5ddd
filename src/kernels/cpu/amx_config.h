// AMX's tile configuration (palette 1), shared by the kernels that use tile products
// (decode_amx-inl.h, flash_amx-inl.h): each tile's rows and bytes per row, loaded with ldtilecfg.
#ifndef MHA_KERNELS_CPU_AMX_CONFIG_H_
#define MHA_KERNELS_CPU_AMX_CONFIG_H_

#include <cstdint>

namespace mha::kernels {

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_AMX_CONFIG_H_
