// safetensors: round trips, and untrusted files that lie about themselves.
#include "mha/safetensors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "test_util.h"

namespace mha::test {
namespace {

// A file made of an 8-byte length, the given header text and `data_bytes` bytes of data.
std::string craft(const std::string& header, size_t data_bytes, int64_t claimed_length = -1) {
  std::string s(8, '\0');
  const uint64_t n = claimed_length >= 0 ? static_cast<uint64_t>(claimed_length) : header.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s + header + std::string(data_bytes, '\x01');
}

void expect_corrupt(const std::string& bytes, const std::string& words) {
  try {
    parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "accepted a corrupt file; expected an error about: " << words;
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  StateDict sd;
  Rng rng(7);
  sd.emplace("w", random_tensor(rng, {3, 5}));
  sd.emplace("empty", Tensor(DType::kF32, {0, 4}));
  for (DType d : {DType::kF64, DType::kF16, DType::kBF16, DType::kBool, DType::kU8, DType::kI8, DType::kI16,
                  DType::kI32, DType::kI64}) {
    Tensor t(d, {2, 3});
    auto* p = static_cast<uint8_t*>(t.raw());
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng.next());
    sd.emplace(std::string("t_") + dtype_name(d), std::move(t));
  }
  const std::string bytes = serialize_safetensors(sd, {{"format", "pt"}});
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u);  // the data region starts 8-byte aligned
  const SafetensorsFile f = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  EXPECT_EQ(f.metadata.at("format"), "pt");
  ASSERT_EQ(f.tensors.size(), sd.size());
  for (const auto& [name, t] : sd) {
    const Tensor& g = f.tensors.at(name);
    EXPECT_EQ(g.dtype(), t.dtype()) << name;
    EXPECT_TRUE(bitwise_equal(g, t)) << name;
  }
}

TEST(Safetensors, ReadsFilesWrittenByPyTorch) {
  const SafetensorsFile f = read_safetensors(std::string(MHA_TEST_DATA) + "/parity/torch_mha_self/weights.safetensors");
  ASSERT_TRUE(f.tensors.count("in_proj_weight"));
  EXPECT_EQ(f.tensors.at("in_proj_weight").shape(), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(f.tensors.at("in_proj_weight").dtype(), DType::kF32);
}

TEST(Safetensors, Float16AndBFloat16ConvertExactly) {
  Tensor h(DType::kF16, {6}), b(DType::kBF16, {2});
  const uint16_t halves[6] = {0x3C00, 0xC000, 0x0001, 0x7C00, 0x3555, 0x0400};  // 1, -2, 2^-24, inf, ~1/3, 2^-14
  std::memcpy(h.raw(), halves, sizeof halves);
  const uint16_t bf[2] = {0x3F80, 0xC0A0};  // 1, -5
  std::memcpy(b.raw(), bf, sizeof bf);
  const Tensor hf = h.to_f32(), bff = b.to_f32();
  EXPECT_EQ(hf.data<float>()[0], 1.0f);
  EXPECT_EQ(hf.data<float>()[1], -2.0f);
  EXPECT_EQ(hf.data<float>()[2], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(hf.data<float>()[3]));
  EXPECT_EQ(hf.data<float>()[4], 0.333251953125f);
  EXPECT_EQ(hf.data<float>()[5], std::ldexp(1.0f, -14));
  EXPECT_EQ(bff.data<float>()[0], 1.0f);
  EXPECT_EQ(bff.data<float>()[1], -5.0f);
}

TEST(Safetensors, RejectsCorruptFiles) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expect_corrupt("", "too short");
  expect_corrupt("abc", "too short");
  expect_corrupt(craft(ok, 8, 1000), "runs past the end");
  expect_corrupt(craft(ok, 8, int64_t{1} << 40), "exceeds the format's limit");
  expect_corrupt(craft("[1,2,3]", 0), "does not start with a JSON object");
  expect_corrupt(craft("{\"a\":", 0), "not valid JSON");
  expect_corrupt(craft(ok.substr(0, ok.size() - 2) + "}", 8), "not valid JSON");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "needs 8 bytes");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8), "run past the data region");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "reversed");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       12),
                 "overlap");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "belong to no tensor");
  expect_corrupt(craft(ok, 12), "belong to no tensor");
  expect_corrupt(craft(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8), "unsupported dtype");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative integer");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "non-negative integer");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "no 'data_offsets'");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                       8),
                 "twice");
  expect_corrupt(craft(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                 "too large");
  expect_corrupt(craft(R"({"__metadata__":{"k":1}})", 0), "must be a string");
}

TEST(Safetensors, MissingFileIsAnError) {
  EXPECT_THROW(read_safetensors("/nonexistent/file.safetensors"), Error);
}

}  // namespace
}  // namespace mha::test
