#include "mha/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "util/check.h"

namespace mha {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit

bool parse_dtype(const std::string& s, DType* dtype) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::kF32},   {"F64", DType::kF64}, {"F16", DType::kF16}, {"BF16", DType::kBF16},
      {"BOOL", DType::kBool}, {"U8", DType::kU8},   {"I8", DType::kI8},   {"I16", DType::kI16},
      {"I32", DType::kI32},   {"I64", DType::kI64}};
  for (const auto& [name, d] : kNames) {
    if (s == name) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

// A non-negative integer that fits in int64, or an error naming `what`.
int64_t to_index(const json& j, const std::string& what) {
  MHA_CHECK(j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0),
            "safetensors: {} must be a non-negative integer; got {}", what, j.dump());
  const uint64_t u = j.get<uint64_t>();
  MHA_CHECK(u <= static_cast<uint64_t>(INT64_MAX), "safetensors: {} = {} is too large", what, u);
  return static_cast<int64_t>(u);
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  int64_t begin, end;
};

Entry parse_entry(const std::string& name, const json& info) {
  MHA_CHECK(info.is_object(), "safetensors: entry '{}' must be an object; got {}", name, info.dump());
  for (const char* field : {"dtype", "shape", "data_offsets"})
    MHA_CHECK(info.contains(field), "safetensors: tensor '{}' has no '{}'", name, field);
  Entry e;
  e.name = name;
  const json& dtype = info["dtype"];
  MHA_CHECK(dtype.is_string() && parse_dtype(dtype.get<std::string>(), &e.dtype),
            "safetensors: tensor '{}' has an unsupported dtype {} (supported: F32 F64 F16 BF16 BOOL U8 I8 "
            "I16 I32 I64)",
            name, dtype.dump());
  const json& shape = info["shape"];
  MHA_CHECK(shape.is_array() && shape.size() <= 8, "safetensors: tensor '{}' has a bad shape {}", name,
            shape.dump());
  // numel * dtype size must fit comfortably in int64.
  int64_t bytes = static_cast<int64_t>(dtype_size(e.dtype));
  for (const json& d : shape) {
    const int64_t n = to_index(d, "a dimension of '" + name + "'");
    MHA_CHECK(n == 0 || bytes <= (int64_t{1} << 50) / n, "safetensors: tensor '{}' shape {} is too large",
              name, shape.dump());
    bytes *= n;
    e.shape.push_back(n);
  }
  const json& offsets = info["data_offsets"];
  MHA_CHECK(offsets.is_array() && offsets.size() == 2,
            "safetensors: tensor '{}' data_offsets must be [begin, end]; got {}", name, offsets.dump());
  e.begin = to_index(offsets[0], "data_offsets of '" + name + "'");
  e.end = to_index(offsets[1], "data_offsets of '" + name + "'");
  MHA_CHECK(e.begin <= e.end, "safetensors: tensor '{}' data_offsets [{}, {}] are reversed", name, e.begin,
            e.end);
  MHA_CHECK(e.end - e.begin == bytes,
            "safetensors: tensor '{}' ({} {}) needs {} bytes but data_offsets [{}, {}] span {}", name,
            dtype_name(e.dtype), shape.dump(), bytes, e.begin, e.end, e.end - e.begin);
  return e;
}

}  // namespace

SafetensorsFile parse_safetensors(const uint8_t* bytes, size_t size) {
  MHA_CHECK(size >= 8, "safetensors: file is {} bytes, too short for the 8-byte header length", size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  MHA_CHECK(n <= kMaxHeaderBytes, "safetensors: header length {} exceeds the format's limit of {} bytes", n,
            kMaxHeaderBytes);
  MHA_CHECK(n <= size - 8, "safetensors: header length {} runs past the end of the {}-byte file", n, size);
  MHA_CHECK(n >= 2 && bytes[8] == '{', "safetensors: header does not start with a JSON object");

  // Parse, rejecting duplicate names at the top level.
  std::set<std::string> seen;
  json header;
  try {
    header = json::parse(
        bytes + 8, bytes + 8 + n,
        [&seen](int depth, json::parse_event_t event, json& parsed) {
          if (depth == 1 && event == json::parse_event_t::key) {
            const std::string key = parsed.get<std::string>();
            MHA_CHECK(seen.insert(key).second, "safetensors: header names '{}' twice", key);
          }
          return true;
        });
  } catch (const json::exception& e) {
    throw Error(fmt::format("safetensors: header is not valid JSON: {}", e.what()));
  }
  MHA_CHECK(header.is_object(), "safetensors: header must be a JSON object");

  SafetensorsFile file;
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      MHA_CHECK(it->is_object(), "safetensors: __metadata__ must be an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        MHA_CHECK(m->is_string(), "safetensors: __metadata__ value of '{}' must be a string", m.key());
        file.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(it.key(), *it));
  }

  // The data region must be covered exactly: no overlaps, no holes, nothing past the end.
  const int64_t data_size = static_cast<int64_t>(size - 8 - n);
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t covered = 0;
  for (const Entry* e : order) {
    MHA_CHECK(e->begin >= covered,
              "safetensors: tensor '{}' bytes [{}, {}] overlap the previous tensor (which ends at {})",
              e->name, e->begin, e->end, covered);
    MHA_CHECK(e->begin == covered, "safetensors: bytes [{}, {}] before tensor '{}' belong to no tensor",
              covered, e->begin, e->name);
    MHA_CHECK(e->end <= data_size, "safetensors: tensor '{}' bytes [{}, {}] run past the data region ({} bytes)",
              e->name, e->begin, e->end, data_size);
    covered = e->end;
  }
  MHA_CHECK(covered == data_size, "safetensors: the last {} bytes of the data region belong to no tensor",
            data_size - covered);

  const uint8_t* data = bytes + 8 + n;
  for (const Entry& e : entries) {
    Tensor t(e.dtype, e.shape);
    std::memcpy(t.raw(), data + e.begin, static_cast<size_t>(e.end - e.begin));
    file.tensors.emplace(e.name, std::move(t));
  }
  return file;
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  MHA_CHECK(!ec, "safetensors: cannot open '{}': {}", path, ec.message());
  MHA_CHECK(std::filesystem::is_regular_file(status), "safetensors: '{}' is not a regular file{}", path,
            std::filesystem::is_directory(status) ? " (it is a directory)" : "");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  MHA_CHECK(in.good(), "safetensors: cannot open '{}'", path);
  const std::streamoff size = in.tellg();
  MHA_CHECK(size >= 0, "safetensors: cannot read the size of '{}'", path);
  std::vector<uint8_t> bytes;
  try {
    bytes.resize(static_cast<size_t>(size));
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("safetensors: '{}' ({} bytes) does not fit in memory", path, size));
  }
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), size);
  MHA_CHECK(in.good() || size == 0, "safetensors: cannot read '{}'", path);
  try {
    return parse_safetensors(bytes.data(), bytes.size());
  } catch (const Error& e) {
    throw Error(fmt::format("{} (in '{}')", e.what(), path));
  }
}

std::string serialize_safetensors(const StateDict& tensors, const Metadata& metadata) {
  json header = json::object();
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    MHA_CHECK(t.defined(), "safetensors: tensor '{}' is undefined", name);
    MHA_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a valid tensor name");
    const int64_t bytes = static_cast<int64_t>(t.nbytes());
    header[name] = {{"dtype", dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data region to 8 bytes

  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out += text;
  for (const auto& [name, t] : tensors) out.append(static_cast<const char*>(t.raw()), t.nbytes());
  return out;
}

void write_safetensors(const std::string& path, const StateDict& tensors, const Metadata& metadata) {
  const std::string bytes = serialize_safetensors(tensors, metadata);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MHA_CHECK(out.good(), "safetensors: cannot open '{}' for writing", path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  MHA_CHECK(out.good(), "safetensors: cannot write '{}'", path);
}

}  // namespace mha
