// SPDX-License-Identifier: Apache-2.0
// Weight loading for the engine example: config.json + model.safetensors of the
// kvp-tiny model (tools/model/model.py documents the tensor names and layouts).
//
// The file is read and validated by the library's safetensors reader
// (kvpolicy/io/safetensors.hpp: header bounds, offsets, sizes, overlaps); this
// layer adds what the engine needs on top: dtype F32, and (model.hpp) the
// expected shape of every tensor.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvpolicy/io/safetensors.hpp"

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
  kvpolicy::io::SafetensorsFile file;
  const kvpolicy::Status st = kvpolicy::io::SafetensorsFile::open(path, &file);
  if (!st) throw std::runtime_error("'" + path + "': " + st.message());
  std::map<std::string, WeightTensor> out;
  for (const auto& e : file.tensors()) {
    if (e.dtype_name != "F32")
      throw std::runtime_error("safetensors '" + path + "': tensor '" + e.name + "' has dtype " + e.dtype_name + ", expected F32");
    WeightTensor t;
    t.shape = e.shape;
    t.data.resize(static_cast<std::size_t>(e.numel()));
    if (!t.data.empty()) std::memcpy(t.data.data(), file.bytes(e), t.data.size() * sizeof(float));
    out.emplace(e.name, std::move(t));
  }
  return out;
}

}  // namespace kvp_engine
