// What `mha` (tools/main.cc) and mha_bench (bench/main.cc) share on the command line: numbers
// checked as they are parsed, one table per benchmark run, and one way to fail. A usage error or
// an mha::Error is one line on stderr and exit status 1 (CLI11's own codes are 100 and up);
// --help prints and exits with 0. Never an uncaught exception.
#ifndef MHA_TOOLS_CLI_H_
#define MHA_TOOLS_CLI_H_

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/attention.h"
#include "mha/error.h"

namespace mha::cli {

// A number option in [lo, hi] (integers) or (lo, hi] (reals). `expected` says what in the
// message, which quotes the value given (CLI11's PositiveNumber prints the whole double range).
// Reals must be finite: CLI11 reads "nan" and "inf" as doubles.
template <typename T>
CLI::Validator NumberIn(T lo, T hi, const std::string& expected, const std::string& name) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        try {
          size_t used = 0;
          if constexpr (std::is_integral_v<T>) {
            const long long v = std::stoll(value, &used);
            if (used == value.size() && v >= lo && v <= hi) return "";
          } else {
            const double v = std::stod(value, &used);
            if (used == value.size() && std::isfinite(v) && v > lo && v <= hi) return "";
          }
        } catch (const std::exception&) {
        }
        return "must be " + expected + "; got '" + value + "'";
      },
      name);
}

inline CLI::Validator Positive() { return NumberIn<long long>(1, 2147483647, "a positive integer", "POSITIVE"); }

inline CLI::Validator Threads() {
  return NumberIn<long long>(0, kMaxThreads, fmt::format("an integer in [0, {}] (0: all available)", kMaxThreads),
                             "THREADS");
}

inline CLI::Validator RealAbove(double lo, double hi, const std::string& name) {
  return NumberIn<double>(lo, hi, fmt::format("a number in ({}, {}]", lo, hi), name);
}

// A benchmark run makes one table: the flags `tables` exclude each other and `--sweep` (which
// extends the default suite); --csv and --json go only with the tables that write them, never
// ignored silently. `app` must have --sweep, --csv and --json.
inline void OneTablePerRun(CLI::App* app, const std::vector<std::string>& tables,
                           const std::vector<std::string>& csv_tables, const std::vector<std::string>& json_tables) {
  auto writes = [](const std::vector<std::string>& list, const std::string& table) {
    return std::find(list.begin(), list.end(), table) != list.end();
  };
  for (size_t i = 0; i < tables.size(); ++i) {
    for (size_t j = i + 1; j < tables.size(); ++j) app->get_option(tables[i])->excludes(tables[j]);
    app->get_option("--sweep")->excludes(tables[i]);
    if (!writes(csv_tables, tables[i])) app->get_option("--csv")->excludes(tables[i]);
    if (!writes(json_tables, tables[i])) app->get_option("--json")->excludes(tables[i]);
  }
}

// Parses the command line and runs `run`, turning every failure into one line and status 1.
// Arguments quoted in messages are made printable.
template <typename Run>
int ParseAndRun(CLI::App& app, int argc, char** argv, const char* program, Run&& run) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: error: %s (see %s --help)\n", program, printable(e.what()).c_str(), program);
    return 1;
  }
  try {
    return run();
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, printable(e.what()).c_str());
  }
  return 1;
}

}  // namespace mha::cli

#endif  // MHA_TOOLS_CLI_H_
