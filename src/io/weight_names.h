// Finding an attention module's weights in a state_dict by name: PyTorch's
// nn.MultiheadAttention names and the common spellings of separate q/k/v/out Linear layers.
// The table of spellings is in weight_names.cc and docs/weights.md.
#ifndef MHA_IO_WEIGHT_NAMES_H_
#define MHA_IO_WEIGHT_NAMES_H_

#include <string>
#include <vector>

#include "mha/safetensors.h"

namespace mha::io {

struct FoundTensor {
  const Tensor* tensor = nullptr;  // null: absent
  std::string name;                // full name in the state_dict
};

struct FoundWeights {
  std::string layout;      // human-readable description of the layout found
  std::string prefix;      // e.g. "layers.0.attn." ("" for none)
  // nn.MultiheadAttention's packed in_proj_weight (3E, E): q, k, v are its three row blocks.
  FoundTensor in_proj_weight;
  FoundTensor in_proj_bias;  // packed (Rq + Rk + Rv) bias; with separate or packed weights
  FoundTensor weight[4];     // q, k, v, out (out absent: no output projection)
  FoundTensor bias[4];
  std::vector<std::string> ignored;  // names under the prefix that are not weights
};

// Finds the weights under `prefix`, or under the one prefix that holds a recognised layout when
// `prefix` is empty. Throws mha::Error when none or several layouts are found, when q/k/v are
// incomplete, or for names that change semantics we do not support (bias_k, bias_v).
FoundWeights find_weights(const StateDict& sd, const std::string& prefix);

}  // namespace mha::io

#endif  // MHA_IO_WEIGHT_NAMES_H_
