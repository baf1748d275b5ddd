// Plain optimizers over named parameters: SGD (with momentum) and Adam/AdamW, with PyTorch's
// update rules (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW), so that a loop written
// against torch moves the same way here.
//
// A Parameter is a view of a trainable tensor and of its gradient buffer, both contiguous and
// of one shape. Backward passes accumulate into the gradient buffers; zero_grad() clears them.
// Updates are elementwise, so the result has the same bits for any thread count.
#ifndef MHA_OPTIM_H_
#define MHA_OPTIM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha {

struct Parameter {
  std::string name;
  View<float> value;
  View<float> grad;
};

// Sets every parameter's gradient to zero.
void zero_grad(const std::vector<Parameter>& params);

struct SgdOptions {
  float lr = 1e-2f;
  float momentum = 0.0f;      // torch's: buf = momentum·buf + g; step along buf
  float weight_decay = 0.0f;  // L2: g += weight_decay·p
};

class Sgd {
 public:
  // Throws mha::Error naming the parameter if a value and its grad differ in shape or are not
  // contiguous, or if the options are out of range (negative, NaN or infinite).
  Sgd(std::vector<Parameter> params, const SgdOptions& options);
  void step();
  void zero_grad() { mha::zero_grad(params_); }
  const std::vector<Parameter>& params() const { return params_; }

 private:
  std::vector<Parameter> params_;
  SgdOptions options_;
  std::vector<std::vector<float>> momentum_;
  int64_t steps_ = 0;
};

struct AdamOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;  // false: Adam (g += wd·p); true: AdamW (p -= lr·wd·p)
};

class Adam {
 public:
  // Throws mha::Error as Sgd's does; the options must be finite, betas in [0, 1) and eps > 0.
  Adam(std::vector<Parameter> params, const AdamOptions& options);
  // Throws mha::Error, changing nothing, if options() was set out of range since the last step.
  void step();
  void zero_grad() { mha::zero_grad(params_); }
  const std::vector<Parameter>& params() const { return params_; }
  AdamOptions& options() { return options_; }  // e.g. to change lr between steps; checked by step()
  int64_t steps() const { return steps_; }

 private:
  std::vector<Parameter> params_;
  AdamOptions options_;
  std::vector<std::vector<float>> m_, v_;
  int64_t steps_ = 0;
};

}  // namespace mha

#endif  // MHA_OPTIM_H_
