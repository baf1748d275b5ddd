// mha::Error: the one exception type the library throws for bad input.
//
// Every message names the argument at fault and the shapes involved, e.g.
//   "attention: key has 3 heads, which does not divide query's 8 heads
//    (query (2, 8, 16, 64), key (2, 3, 16, 64))".
// Library code never aborts on user input. Messages quote text from files and arguments
// (tensor names, paths); every message is made printable when the Error is built, so no such
// text reaches a terminal raw: control characters and invalid UTF-8 are escaped (\x1b, \xff);
// valid UTF-8 stays as it is. Escaping is idempotent: a message quoted in another is not
// escaped twice.
#ifndef MHA_ERROR_H_
#define MHA_ERROR_H_

#include <stdexcept>
#include <string>
#include <string_view>

namespace mha {

// `text` safe to print: bytes below 0x20 and 0x7f, C1 controls and bytes that are not valid
// UTF-8 become \xNN; everything else is kept.
std::string printable(std::string_view text);

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(printable(message)) {}
};

}  // namespace mha

#endif  // MHA_ERROR_H_
