// libFuzzer target: the safetensors reader on untrusted bytes. Invariants: no crash, leak or
// undefined behaviour (ASan/UBSan); bad input is an mha::Error; a file that parses writes
// back to bytes that parse to the same tensors.
#include <cstdint>
#include <cstring>

#include "mha/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha::SafetensorsFile file;
  try {
    file = mha::parse_safetensors(data, size);
  } catch (const mha::Error&) {
    return 0;
  }
  const std::string bytes = mha::serialize_safetensors(file.tensors, file.metadata);
  const mha::SafetensorsFile again =
      mha::parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  if (again.tensors.size() != file.tensors.size() || again.metadata != file.metadata) __builtin_trap();
  for (const auto& [name, t] : file.tensors) {
    const mha::Tensor& u = again.tensors.at(name);
    if (u.dtype() != t.dtype() || u.shape() != t.shape() || std::memcmp(u.raw(), t.raw(), t.nbytes()) != 0)
      __builtin_trap();
  }
  return 0;
}
