// Reading and writing safetensors files (https://github.com/huggingface/safetensors), the
// format of a PyTorch state_dict saved with safetensors.torch.save_file.
//
//   8 bytes   little-endian u64 N
//   N bytes   JSON header: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
//             "__metadata__": {"key": "value", ...}}
//   the rest  tensor bytes, little-endian, row-major; offsets relative to this region
//
// Files are untrusted: every header field is checked (dtype known, shape non-negative and
// not overflowing, byte size equal to shape x dtype size, offsets inside the file, no
// overlaps and no holes, no duplicate names) and any violation is an mha::Error naming the
// tensor and the numbers.
#ifndef MHA_SAFETENSORS_H_
#define MHA_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "mha/tensor.h"

namespace mha {

using StateDict = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

struct SafetensorsFile {
  StateDict tensors;
  Metadata metadata;
};

SafetensorsFile read_safetensors(const std::string& path);
SafetensorsFile parse_safetensors(const uint8_t* bytes, size_t size);

void write_safetensors(const std::string& path, const StateDict& tensors, const Metadata& metadata = {});
std::string serialize_safetensors(const StateDict& tensors, const Metadata& metadata = {});

}  // namespace mha

#endif  // MHA_SAFETENSORS_H_
