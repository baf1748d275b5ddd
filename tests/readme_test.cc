// The README shows examples/usage.cc verbatim (the example itself is built and run by CTest).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

namespace {

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Readme, ShowsTheExampleThatTheTestsBuild) {
  const std::string readme = read(std::string(MHA_SOURCE_DIR) + "/README.md");
  const std::string example = read(std::string(MHA_SOURCE_DIR) + "/examples/usage.cc");
  ASSERT_FALSE(example.empty());
  EXPECT_NE(readme.find(example), std::string::npos) << "README.md must contain examples/usage.cc verbatim";
}

}  // namespace
