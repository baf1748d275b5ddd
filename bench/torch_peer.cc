// PyTorch as the benchmark's peer, through libtorch (the PyPI wheel ships it): CPU
// at::scaled_dot_product_attention and the fused inference op behind nn.MultiheadAttention
// (at::_native_multi_head_attention), on the same shapes and threads, in the same process.
// Training: SDPA's backward through autograd, and the ops nn.MultiheadAttention runs in
// training mode with need_weights=False (F.multi_head_attention_forward: packed in-projection,
// SDPA, out-projection), forward and backward.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

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
  p.attention_backward = [](const AttentionCase& c, int threads, double seconds) {
    at::set_num_threads(threads);
    const auto q = at::rand({c.B, c.H, c.Tq, c.D}).requires_grad_(), k = at::rand({c.B, c.Hkv, c.Tk, c.D}).requires_grad_();
    const auto v = at::rand({c.B, c.Hkv, c.Tk, c.Dv}).requires_grad_();
    const auto dout = at::rand({c.B, c.H, c.Tq, c.Dv});
    const auto out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal, std::nullopt, c.Hkv != c.H);
    return time_calls([&] { torch::autograd::grad({out}, {q, k, v}, {dout}, /*retain_graph=*/true); }, seconds);
  };
  p.attention_fwd_bwd = [](const AttentionCase& c, int threads, double seconds) {
    at::set_num_threads(threads);
    const auto q = at::rand({c.B, c.H, c.Tq, c.D}).requires_grad_(), k = at::rand({c.B, c.Hkv, c.Tk, c.D}).requires_grad_();
    const auto v = at::rand({c.B, c.Hkv, c.Tk, c.Dv}).requires_grad_();
    const auto dout = at::rand({c.B, c.H, c.Tq, c.Dv});
    return time_calls(
        [&] {
          const auto out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal, std::nullopt, c.Hkv != c.H);
          torch::autograd::grad({out}, {q, k, v}, {dout});
        },
        seconds);
  };
  p.module_train = [](const ModuleCase& c, int threads, double seconds) {
    at::set_num_threads(threads);
    const int64_t hd = c.E / c.H;
    const auto x = at::rand({c.B, c.T, c.E}).requires_grad_(), r = at::rand({c.B, c.T, c.E});
    const auto w = (at::rand({3 * c.E, c.E}) * 0.05).requires_grad_(), b = at::rand({3 * c.E}).requires_grad_();
    const auto pw = (at::rand({c.E, c.E}) * 0.05).requires_grad_(), pb = at::rand({c.E}).requires_grad_();
    return time_calls(
        [&] {
          // F.multi_head_attention_forward, batch_first, self-attention, need_weights=False.
          const auto xt = x.transpose(0, 1);  // (T, B, E)
          const auto qkv = at::linear(xt, w, b).unflatten(-1, {3, c.E}).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous();
          auto heads = [&](const at::Tensor& t) { return t.view({c.T, c.B * c.H, hd}).transpose(0, 1).view({c.B, c.H, c.T, hd}); };
          const auto a = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]));
          const auto merged = a.permute({2, 0, 1, 3}).contiguous().view({c.B * c.T, c.E});
          const auto y = at::linear(merged, pw, pb).view({c.T, c.B, c.E}).transpose(1, 0);
          torch::autograd::grad({y}, {x, w, b, pw, pb}, {r});
        },
        seconds);
  };
  return p;
}

}  // namespace mha::bench
