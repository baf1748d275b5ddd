// The README shows the examples verbatim (the examples themselves are built and run by CTest).
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

TEST(Readme, ShowsTheExamplesThatTheTestsBuild) {
  const std::string readme = read(std::string(MHA_SOURCE_DIR) + "/README.md");
  for (const char* name : {"usage.cc", "decode_usage.cc", "train_usage.cc"}) {
    const std::string example = read(std::string(MHA_SOURCE_DIR) + "/examples/" + name);
    ASSERT_FALSE(example.empty()) << name;
    EXPECT_NE(readme.find(example), std::string::npos) << "README.md must contain examples/" << name << " verbatim";
  }
}

}  // namespace
