// libFuzzer target: recognising attention weights by name in an arbitrary state_dict.
// The fuzzer picks names from the recognised spellings (with prefixes and strays), shapes,
// dtypes and num_heads. Invariants: no crash or UB; bad input is an mha::Error; a module that
// loads runs forward, and its state_dict() loads back to the same outputs bit for bit.
#include <cstring>
#include <string>

#include "fuzz/fuzz_input.h"
#include "mha/multi_head_attention.h"

namespace {

const char* const kNames[] = {
    "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
    "v_proj.bias", "o_proj.weight", "q_linear.weight", "k_linear.weight", "v_linear.weight", "out_linear.weight",
    "out_linear.bias", "linear_q.weight", "linear_k.weight", "linear_v.weight", "wq.weight", "wk.weight",
    "wv.weight", "wo.weight", "query.weight", "key.weight", "value.weight", "bias_k", "mask", "norm.weight"};
const char* const kPrefixes[] = {"", "", "attn.", "layers.0.self_attn.", "x."};
const mha::DType kDtypes[] = {mha::DType::kF32, mha::DType::kF32, mha::DType::kF32, mha::DType::kF16,
                              mha::DType::kBF16, mha::DType::kF64, mha::DType::kI64, mha::DType::kBool};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha::fuzz::Input in(data, size);
  mha::StateDict sd;
  const int64_t n = in.range(1, 8);
  for (int64_t t = 0; t < n; ++t) {
    const std::string name = std::string(kPrefixes[in.range(0, 4)]) + kNames[in.range(0, 31)];
    std::vector<int64_t> shape(in.range(0, 3));
    for (auto& d : shape) d = in.range(0, 12);
    mha::Tensor tensor(kDtypes[in.range(0, 7)], shape);
    auto* bytes = static_cast<uint8_t*>(tensor.raw());
    for (size_t i = 0; i < tensor.nbytes(); ++i) bytes[i] = in.byte() % 7;  // small finite values
    sd.emplace(name, std::move(tensor));
  }
  mha::MultiHeadAttentionConfig base;
  base.num_heads = in.range(1, 4);
  try {
    mha::MultiHeadAttention m = mha::MultiHeadAttention::from_state_dict(sd, base);
    mha::Tensor x = mha::Tensor::zeros({1, 3, m.config().embed_dim});
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = 0.25f * static_cast<float>(i % 5);
    mha::MhaInputs mi;
    mi.query = x.view<float>();
    mha::Tensor kx, vx;
    if (m.config().kdim != m.config().embed_dim || m.config().vdim != m.config().embed_dim) {
      kx = mha::Tensor::zeros({1, 2, m.config().kdim});
      vx = mha::Tensor::zeros({1, 2, m.config().vdim});
      mi.key = kx.view<float>();
      mi.value = vx.view<float>();
    }
    mha::MhaCallOptions one_thread;
    one_thread.num_threads = 1;
    const mha::Tensor y = m.forward(mi, one_thread).output;
    mha::MultiHeadAttention back = mha::MultiHeadAttention::from_state_dict(m.state_dict(), base);
    const mha::Tensor z = back.forward(mi, one_thread).output;
    if (y.shape() != z.shape() || std::memcmp(y.raw(), z.raw(), y.nbytes()) != 0) __builtin_trap();
  } catch (const mha::Error&) {
  }
  return 0;
}
