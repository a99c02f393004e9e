// SPDX-License-Identifier: Apache-2.0
// Weight loading for the engine example: config.json + model.safetensors of the
// kvp-tiny model (tools/model/model.py documents the tensor names and layouts).
//
// Decision: the engine needs only F32 tensors of a file written by the
// `safetensors` Python package, so this is a deliberately small private reader
// (8-byte little-endian header length, JSON header, data section) with the
// checks that protect the engine from a wrong or truncated file: dtype F32,
// offsets inside the data section, byte size == prod(shape) * 4, expected
// shape per tensor. The library's validated reader (kvpolicy/io/safetensors.hpp)
// is the general tool; it was not yet in the tree when this was written.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvp_engine {

/// One fp32 tensor, row-major.
struct WeightTensor {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

inline std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

/// Reads every tensor of a safetensors file; throws std::runtime_error naming
/// the file and tensor on any inconsistency. Only F32 tensors are accepted.
inline std::map<std::string, WeightTensor> load_safetensors_f32(const std::string& path) {
  const std::string bytes = read_text_file(path);
  auto fail = [&](const std::string& what) { throw std::runtime_error("safetensors '" + path + "': " + what); };
  if (bytes.size() < 8) fail("shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  if (n > bytes.size() - 8) fail("header length " + std::to_string(n) + " runs past the end of the file");
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  if (!header.is_object()) fail("header is not a JSON object");
  const std::size_t data_start = 8 + n, data_size = bytes.size() - data_start;
  std::map<std::string, WeightTensor> out;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    if (e.value("dtype", "") != "F32") fail("tensor '" + name + "' has dtype " + e.value("dtype", "?") + ", expected F32");
    WeightTensor t;
    std::int64_t numel = 1;
    for (const auto& d : e.at("shape")) {
      const auto v = d.get<std::int64_t>();
      if (v < 0) fail("tensor '" + name + "' has a negative extent");
      t.shape.push_back(v);
      numel *= v;
    }
    const auto begin = e.at("data_offsets").at(0).get<std::uint64_t>();
    const auto end = e.at("data_offsets").at(1).get<std::uint64_t>();
    if (begin > end || end > data_size) fail("tensor '" + name + "' has data_offsets outside the data section");
    if (end - begin != static_cast<std::uint64_t>(numel) * sizeof(float))
      fail("tensor '" + name + "' has " + std::to_string(end - begin) + " bytes for " + std::to_string(numel) + " floats");
    t.data.resize(static_cast<std::size_t>(numel));
    if (numel > 0) std::memcpy(t.data.data(), bytes.data() + data_start + begin, end - begin);
    out.emplace(name, std::move(t));
  }
  return out;
}

}  // namespace kvp_engine
