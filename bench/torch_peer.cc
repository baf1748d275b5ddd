// PyTorch as the benchmark's peer, through libtorch (the PyPI wheel ships it): CPU
// at::scaled_dot_product_attention and the fused inference op behind nn.MultiheadAttention
// (at::_native_multi_head_attention), on the same shapes and threads, in the same process.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "bench/suite.h"

namespace mha::bench {

Peer torch_peer() {
  Peer p;
  p.name = "torch";
  p.attention = [](const AttentionCase& c, int threads, double seconds) {
    at::set_num_threads(threads);
    const auto q = at::rand({c.B, c.H, c.Tq, c.D}), k = at::rand({c.B, c.Hkv, c.Tk, c.D});
    const auto v = at::rand({c.B, c.Hkv, c.Tk, c.Dv});
    const bool gqa = c.Hkv != c.H;
    return time_calls([&] { at::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal, std::nullopt, gqa); },
                      seconds);
  };
  p.module = [](const ModuleCase& c, int threads, double seconds) {
    at::set_num_threads(threads);
    const auto x = at::rand({c.B, c.T, c.E});
    const auto w = at::rand({3 * c.E, c.E}) * 0.05, b = at::rand({3 * c.E}), pw = at::rand({c.E, c.E}) * 0.05;
    const auto pb = at::rand({c.E});
    return time_calls([&] { at::_native_multi_head_attention(x, x, x, c.E, c.H, w, b, pw, pb, {}, false); }, seconds);
  };
  p.decode = [](const DecodeCase& c, int threads, double seconds) {
    at::set_num_threads(threads);
    const auto q = at::rand({c.B, c.Hq, 1, c.D}), k = at::rand({c.B, c.Hkv, c.L, c.D}), v = at::rand({c.B, c.Hkv, c.L, c.D});
    const bool gqa = c.Hkv != c.Hq;
    return time_calls([&] { at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, std::nullopt, gqa); }, seconds);
  };
  return p;
}

}  // namespace mha::bench
