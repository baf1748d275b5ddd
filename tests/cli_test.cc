// The `mha` command: forward round trips on every parity case, and one-line errors.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "mha/safetensors.h"
#include "test_util.h"

namespace mha::test {
namespace {

struct Result {
  int status;
  std::string output;  // stdout and stderr
};

// Runs `program` (the `mha` command unless said) with `args`.
Result run(const std::string& args, const std::string& program = MHA_CLI) {
  const std::string cmd = program + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  if (!pipe) return r;
  std::array<char, 512> buf;
  while (fgets(buf.data(), buf.size(), pipe)) r.output += buf.data();
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string temp_path(const std::string& name) { return std::string(MHA_TEST_TMP) + "/" + name; }

TEST(Cli, ForwardRoundTripsEveryParityCase) {
  const std::string root = std::string(MHA_TEST_DATA) + "/parity";
  std::ifstream f(root + "/manifest.json");
  const auto manifest = nlohmann::json::parse(f);
  for (const auto& c : manifest["cases"]) {
    const std::string name = c["name"], dir = root + "/" + name;
    SCOPED_TRACE(name);
    std::string args = "forward --weights " + dir + "/weights.safetensors --input " + dir +
                       "/inputs.safetensors --output " + temp_path(name + ".out.safetensors") +
                       " --heads " + std::to_string(c["heads"].get<int>());
    if (c.value("causal", "") == "top-left") args += " --causal";
    if (c.value("need_weights", false)) args += " --need-weights";
    if (c.value("average_weights", false)) args += " --average-weights";
    if (c.value("seq_first", false)) args += " --seq-first";
    const Result r = run(args);
    ASSERT_EQ(r.status, 0) << r.output;
    const SafetensorsFile got = read_safetensors(temp_path(name + ".out.safetensors"));
    const SafetensorsFile want = read_safetensors(dir + "/expected.safetensors");
    if (c.contains("fully_masked_batches")) continue;  // NaN in torch; checked in parity_test
    const double err = rel_error(got.tensors.at("output").view<float>(), want.tensors.at("output").view<float>());
    EXPECT_LE(err, 1e-5);
    double werr = -1;
    if (want.tensors.count("attn_weights")) {
      werr = rel_error(got.tensors.at("attn_weights").view<float>(), want.tensors.at("attn_weights").view<float>());
      EXPECT_LE(werr, 1e-5);
    }
    std::printf("cli round trip %-26s output rel err %.2e  weights rel err %.2e\n", name.c_str(), err, werr);
  }
}

// Exit status 1 and a single line "mha: error: ..." (or "mha_bench: error: ...") mentioning `words`.
void expect_cli_error(const std::string& args, const std::string& words, const std::string& program = MHA_CLI) {
  const Result r = run(args, program);
  EXPECT_EQ(r.status, 1) << r.output;
  const std::string name = program.substr(program.rfind('/') + 1);
  EXPECT_EQ(r.output.rfind(name + ": error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(words), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

TEST(Cli, BadInputIsAOneLineError) {
  const std::string dir = std::string(MHA_TEST_DATA) + "/parity/torch_mha_self";
  const std::string w = " --weights " + dir + "/weights.safetensors";
  const std::string in = " --input " + dir + "/inputs.safetensors";
  const std::string out = " --output " + temp_path("err.safetensors");
  expect_cli_error("forward --weights /nonexistent.safetensors" + in + out + " --heads 4", "cannot open");
  expect_cli_error("forward" + w + in + out + " --heads 5", "not divisible by num_heads = 5");
  expect_cli_error("forward --weights " + dir + "/inputs.safetensors" + in + out + " --heads 4",
                   "no attention weights recognised");

  // An input file with an unknown name, and one with a wrong dtype.
  StateDict bad;
  bad.emplace("x", Tensor(DType::kF32, {1, 2, 32}));
  bad.emplace("mask", Tensor(DType::kU8, {2, 2}));
  write_safetensors(temp_path("unknown.safetensors"), bad);
  expect_cli_error("forward" + w + " --input " + temp_path("unknown.safetensors") + out + " --heads 4",
                   "unknown tensor 'mask'");
  StateDict f64;
  f64.emplace("x", Tensor(DType::kF64, {1, 2, 32}));
  write_safetensors(temp_path("f64.safetensors"), f64);
  expect_cli_error("forward" + w + " --input " + temp_path("f64.safetensors") + out + " --heads 4", "dtype F64");

  // An empty file and a truncated one.
  std::ofstream(temp_path("empty.safetensors")).close();
  expect_cli_error("forward" + w + " --input " + temp_path("empty.safetensors") + out + " --heads 4", "too short");
  {
    std::ifstream src(dir + "/inputs.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(src)), std::istreambuf_iterator<char>());
    std::ofstream(temp_path("truncated.safetensors"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  expect_cli_error("forward" + w + " --input " + temp_path("truncated.safetensors") + out + " --heads 4",
                   "safetensors");
}

// Hostile input to the command: option errors, a directory for a file, names with terminal
// escape codes and bytes that are not UTF-8. Every one exits 1 with one printable line.
TEST(Cli, OptionErrorsExitWithOneAndAShortMessage) {
  const std::string dir = std::string(MHA_TEST_DATA) + "/parity/torch_mha_self";
  const std::string files = " --weights " + dir + "/weights.safetensors --input " + dir +
                            "/inputs.safetensors --output " + temp_path("opt.safetensors");
  expect_cli_error("forward" + files + " --heads 0", "must be a positive integer; got '0'");
  expect_cli_error("forward" + files + " --heads abc", "got 'abc'");
  expect_cli_error("forward" + files + " --heads 4 --threads 100000", "[0, 256]");
  expect_cli_error("forward" + files + " --heads 4 --threads -1", "got '-1'");
  expect_cli_error("demo --threads 5000", "5000");
  expect_cli_error("forward" + files, "--heads");  // required
  expect_cli_error("forward" + files + " --heads 4 --no-such-option", "no-such-option");
  expect_cli_error("no-such-command", "subcommand");
  // Numbers CLI11 would take as doubles; tables that would ignore an option; paths found unwritable
  // only after minutes of measuring.
  expect_cli_error("bench --seconds nan", "--seconds: must be a number in (0, 3600]; got 'nan'");
  expect_cli_error("bench --seconds 0", "got '0'");
  expect_cli_error("bench --seconds 1e9", "got '1e9'");
  expect_cli_error("train --lr inf", "--lr: must be a number in (0, 1]; got 'inf'");
  expect_cli_error("train --lr -1", "got '-1'");
  expect_cli_error("bench --decode --train", "--decode excludes --train");
  expect_cli_error("bench --sweep --varlen", "excludes");
  expect_cli_error("bench --peak --csv " + temp_path("peak.csv"), "--peak excludes --csv");
  expect_cli_error("bench --decode --json " + temp_path("decode.json"), "excludes");
  expect_cli_error("bench --train --csv " + temp_path("no-such-dir/train.csv"), "cannot write");
  const Result r = run("forward" + files + " --heads 0");
  EXPECT_LT(r.output.size(), 200u) << r.output;  // not the 309 digits of the double maximum
  EXPECT_EQ(run("--help").status, 0);
  // --threads 0 is all available threads in bench too (its peak loop ran on none and printed 0).
  const Result peak = run("bench --peak --threads 0");
  EXPECT_EQ(peak.status, 0) << peak.output;
  EXPECT_NE(peak.output.find("fp32 FMA peak"), std::string::npos) << peak.output;
  EXPECT_EQ(peak.output.find("on 0 threads"), std::string::npos) << peak.output;
}

// mha_bench (`mha bench` with PyTorch beside it) takes the same checks. An unwritable --csv was an
// uncaught mha::Error there (the process aborted), and its numbers were not checked at all.
TEST(Cli, MhaBenchOptionErrorsExitWithOne) {
  expect_cli_error("--threads -3 --memory", "--threads: must be an integer in [0, 256]", MHA_BENCH);
  expect_cli_error("--threads 9999", "got '9999'", MHA_BENCH);
  expect_cli_error("--seconds nan --decode", "--seconds: must be a number in (0, 3600]; got 'nan'", MHA_BENCH);
  expect_cli_error("--memory --decode", "--memory excludes --decode", MHA_BENCH);
  expect_cli_error("--sweep --train", "--sweep excludes --train", MHA_BENCH);
  expect_cli_error("--decode --json " + temp_path("decode.json"), "excludes", MHA_BENCH);
  expect_cli_error("--decode --csv " + temp_path("no-such-dir/decode.csv"), "cannot write", MHA_BENCH);
  expect_cli_error("--no-such-option", "no-such-option", MHA_BENCH);
  EXPECT_EQ(run("--help", MHA_BENCH).status, 0);
}

TEST(Cli, ADirectoryForAFileIsNamed) {
  const std::string dir = std::string(MHA_TEST_DATA) + "/parity/torch_mha_self";
  expect_cli_error("forward --weights " + dir + " --input " + dir + "/inputs.safetensors --output " +
                       temp_path("dir.safetensors") + " --heads 4",
                   "is not a regular file (it is a directory)");
}

// True when `text` holds no byte a terminal would act on or could not display as UTF-8.
bool printable_bytes(const std::string& text) {
  for (unsigned char c : text)
    if ((c < 0x20 && c != '\n') || c == 0x7f || c == 0xff || c == 0xfe) return false;
  return true;
}

TEST(Cli, NamesFromFilesAreEscaped) {
  const std::string dir = std::string(MHA_TEST_DATA) + "/parity/torch_mha_self";
  const std::string w = " --weights " + dir + "/weights.safetensors";
  const std::string out = " --output " + temp_path("esc.out.safetensors");
  const std::string evil = "\x1b[31mred\x07\x1b]0;title\x07";
  StateDict bad;
  bad.emplace("x", Tensor(DType::kF32, {1, 2, 32}));
  bad.emplace(evil, Tensor(DType::kU8, {2}));
  write_safetensors(temp_path("evil.safetensors"), bad);
  const Result r = run("forward" + w + " --input " + temp_path("evil.safetensors") + out + " --heads 4");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(printable_bytes(r.output)) << r.output;
  EXPECT_NE(r.output.find("unknown tensor '\\x1b[31mred\\x07\\x1b]0;title\\x07'"), std::string::npos) << r.output;

  // An extra name in the weights: the note quoting it is escaped too.
  SafetensorsFile weights = read_safetensors(dir + "/weights.safetensors");
  weights.tensors.emplace(evil, Tensor(DType::kF32, {1}));
  write_safetensors(temp_path("evil_weights.safetensors"), weights.tensors);
  const Result n = run("forward --weights " + temp_path("evil_weights.safetensors") + " --input " + dir +
                       "/inputs.safetensors" + out + " --heads 4");
  EXPECT_EQ(n.status, 0) << n.output;
  EXPECT_TRUE(printable_bytes(n.output)) << n.output;
  EXPECT_NE(n.output.find("ignored '\\x1b[31mred"), std::string::npos) << n.output;

  // A header naming a tensor with bytes that are not UTF-8 (written by hand: JSON writers refuse).
  const std::string header = "{\"x\xff\xfe\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(4, '\0');
  std::ofstream(temp_path("notutf8.safetensors"), std::ios::binary) << file;
  const Result u = run("forward" + w + " --input " + temp_path("notutf8.safetensors") + out + " --heads 4");
  EXPECT_EQ(u.status, 1) << u.output;
  EXPECT_TRUE(printable_bytes(u.output)) << u.output;
  EXPECT_EQ(std::count(u.output.begin(), u.output.end(), '\n'), 1) << u.output;
}

TEST(Cli, DemoRuns) {
  const Result r = run("demo --threads 2");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* shape : {"(10, 10, 768)", "(2, 8, 10, 10)", "(4, 12, 40)", "(4, 12, 96)"})
    EXPECT_NE(r.output.find(shape), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("equal to recomputing the whole sequence each step: yes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("given 3 1 4 1 5 9 2 6 | writes 6 2 9 5 1 4 1 3"), std::string::npos) << r.output;
}

TEST(Cli, TrainReachesTheTargetAccuracy) {
  const Result r = run("train --steps 1000 --threads 2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("reached "), std::string::npos) << r.output;  // status 0: >= 99%
}

}  // namespace
}  // namespace mha::test
