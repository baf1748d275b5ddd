// The mha command's subcommands.
#ifndef MHA_TOOLS_COMMANDS_H_
#define MHA_TOOLS_COMMANDS_H_

#include <string>

namespace mha::tools {

struct ForwardArgs {
  std::string weights, input, output, prefix;
  int heads = 0;
  int kv_heads = 0;  // 0: inferred from the weights
  bool causal = false;
  std::string causal_align = "top-left";
  bool need_weights = false;
  bool average_weights = false;
  bool seq_first = false;
  bool reference = false;
  int threads = 0;
};

struct BenchArgs {
  int threads = 2;
  double seconds = 0.5;
  bool sweep = false;
  bool memory = false;
  bool decode = false;
  bool train = false;
  bool peak = false;
  bool dtypes = false;
  bool varlen = false;
  bool variants = false;
  std::string csv, json;
};

struct TrainArgs {
  int threads = 0;
  int length = 8;
  int steps = 3000;
  float lr = 3e-3f;
  unsigned seed = 1;
};

int run_demo(int threads);
int run_train(const TrainArgs& args);
int run_forward(const ForwardArgs& args);
int run_info();
int run_bench(const BenchArgs& args);

}  // namespace mha::tools

#endif  // MHA_TOOLS_COMMANDS_H_
