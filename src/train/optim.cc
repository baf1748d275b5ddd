// SGD and Adam with torch.optim's update rules (single-tensor form).
#include "mha/optim.h"

#include <cmath>

#include "util/check.h"
#include "util/parallel.h"

namespace mha {
namespace {

void check_params(const std::vector<Parameter>& params, const char* who) {
  for (const Parameter& p : params) {
    MHA_CHECK(p.value.given() && p.grad.given() && p.value.shape == p.grad.shape && p.value.rank == p.grad.rank,
              "{}: parameter '{}' has value {} and grad {}; they must have one shape", who, p.name,
              shape_string(p.value), shape_string(p.grad));
    MHA_CHECK(p.value.is_contiguous() && p.grad.is_contiguous(), "{}: parameter '{}' must be contiguous", who, p.name);
    MHA_CHECK(p.value.numel() == 0 || (p.value.data && p.grad.data), "{}: parameter '{}' has a null data pointer", who,
              p.name);
  }
}

// Options must be finite (an infinite rate or decay makes every weight inf or NaN at once) and
// in torch.optim's ranges, except that Adam's eps must be > 0: with 0, an element whose gradient
// has always been 0 divides 0 by 0 (torch allows it and writes NaN).
void check_options(const SgdOptions& o) {
  MHA_CHECK(std::isfinite(o.lr) && o.lr >= 0 && std::isfinite(o.momentum) && o.momentum >= 0 &&
                std::isfinite(o.weight_decay) && o.weight_decay >= 0,
            "Sgd: lr ({}), momentum ({}) and weight_decay ({}) must be finite and >= 0", o.lr, o.momentum,
            o.weight_decay);
}

void check_options(const AdamOptions& o) {
  MHA_CHECK(std::isfinite(o.lr) && o.lr >= 0 && std::isfinite(o.weight_decay) && o.weight_decay >= 0,
            "Adam: lr ({}) and weight_decay ({}) must be finite and >= 0", o.lr, o.weight_decay);
  MHA_CHECK(std::isfinite(o.eps) && o.eps > 0,
            "Adam: eps must be finite and > 0 (0 divides 0 by 0 where the gradients have been 0); got {}", o.eps);
  MHA_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, "Adam: betas must be in [0, 1); got ({}, {})",
            o.beta1, o.beta2);
}

// Runs f(i) for every element of a parameter, split into fixed chunks.
template <typename F>
void for_each_element(int64_t n, F&& f) {
  constexpr int64_t kChunk = 1 << 14;
  parallel_for((n + kChunk - 1) / kChunk, 0, [&](int64_t c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) f(i);
  });
}

}  // namespace

void zero_grad(const std::vector<Parameter>& params) {
  for (const Parameter& p : params) std::fill(p.grad.data, p.grad.data + p.grad.numel(), 0.0f);
}

Sgd::Sgd(std::vector<Parameter> params, const SgdOptions& options) : params_(std::move(params)), options_(options) {
  check_params(params_, "Sgd");
  check_options(options);
  if (options.momentum > 0) {
    for (const Parameter& p : params_) momentum_.emplace_back(static_cast<size_t>(p.value.numel()), 0.0f);
  }
}

void Sgd::step() {
  const SgdOptions& o = options_;
  for (size_t k = 0; k < params_.size(); ++k) {
    float* w = params_[k].value.data;
    const float* g = params_[k].grad.data;
    float* buf = o.momentum > 0 ? momentum_[k].data() : nullptr;
    const bool first = steps_ == 0;
    for_each_element(params_[k].value.numel(), [&](int64_t i) {
      float d = g[i] + o.weight_decay * w[i];
      if (buf) {
        buf[i] = first ? d : o.momentum * buf[i] + d;  // torch: the first step copies the grad
        d = buf[i];
      }
      w[i] -= o.lr * d;
    });
  }
  ++steps_;
}

Adam::Adam(std::vector<Parameter> params, const AdamOptions& options) : params_(std::move(params)), options_(options) {
  check_params(params_, "Adam");
  check_options(options);
  for (const Parameter& p : params_) {
    m_.emplace_back(static_cast<size_t>(p.value.numel()), 0.0f);
    v_.emplace_back(static_cast<size_t>(p.value.numel()), 0.0f);
  }
}

void Adam::step() {
  const AdamOptions& o = options_;
  check_options(o);  // options() may have changed them; a refused step changes nothing
  ++steps_;
  const double t = static_cast<double>(steps_);
  const float step_size = static_cast<float>(o.lr / (1.0 - std::pow(static_cast<double>(o.beta1), t)));
  const float correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(o.beta2), t)));
  for (size_t k = 0; k < params_.size(); ++k) {
    float* w = params_[k].value.data;
    const float* g = params_[k].grad.data;
    float* m = m_[k].data();
    float* v = v_[k].data();
    for_each_element(params_[k].value.numel(), [&](int64_t i) {
      float grad = g[i];
      if (o.weight_decay > 0) {
        if (o.decoupled_weight_decay) {
          w[i] *= 1.0f - o.lr * o.weight_decay;
        } else {
          grad += o.weight_decay * w[i];
        }
      }
      m[i] += (1.0f - o.beta1) * (grad - m[i]);
      v[i] = o.beta2 * v[i] + (1.0f - o.beta2) * grad * grad;
      const float denom = std::sqrt(v[i]) / correction2_sqrt + o.eps;
      w[i] -= step_size * (m[i] / denom);
    });
  }
}

}  // namespace mha
