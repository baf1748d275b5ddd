// `mha train`: TinyGpt learns to reverse digit sequences (examples/tiny_gpt/reverse_task.h).
#include <fmt/format.h>

#include "tiny_gpt/reverse_task.h"
#include "tools/commands.h"

namespace mha::tools {

int run_train(const TrainArgs& args) {
  examples::ReverseTaskOptions o;
  o.length = args.length;
  o.max_steps = args.steps;
  o.lr = args.lr;
  o.seed = args.seed;
  o.num_threads = args.threads;
  const examples::TinyGptConfig m = examples::reverse_task_model(o);
  fmt::print("TinyGpt ({} layers, dim {}, {} heads) learns to reverse {} digits: Adam lr {}, batch {}, seed {}\n",
             m.layers, m.dim, m.heads, o.length, o.lr, o.batch, o.seed);
  fmt::print("{:>6} {:>9} {:>8} {:>15} {:>18}\n", "step", "seconds", "loss", "token accuracy", "sequences reversed");
  const examples::ReverseTaskReport r = examples::train_reverse_task(o, [](const examples::ReverseTaskReport& p) {
    fmt::print("{:>6} {:>9.2f} {:>8.4f} {:>14.2f}% {:>17.1f}%\n", p.steps, p.seconds, p.last_loss,
               100 * p.token_accuracy, 100 * p.sequence_accuracy);
  });
  const bool reached = r.token_accuracy >= o.target_accuracy;
  fmt::print("{} {:.2f}% token accuracy after {} steps, {:.1f} s of training ({} parameters)\n",
             reached ? "reached" : "did not reach 99%:", 100 * r.token_accuracy, r.steps, r.seconds, r.parameters);
  return reached ? 0 : 1;
}

}  // namespace mha::tools
