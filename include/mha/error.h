// mha::Error: the one exception type the library throws for bad input.
//
// Every message names the argument at fault and the shapes involved, e.g.
//   "attention: key has 3 heads, which does not divide query's 8 heads
//    (query (2, 8, 16, 64), key (2, 3, 16, 64))".
// Library code never aborts on user input.
#ifndef MHA_ERROR_H_
#define MHA_ERROR_H_

#include <stdexcept>
#include <string>

namespace mha {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace mha

#endif  // MHA_ERROR_H_
