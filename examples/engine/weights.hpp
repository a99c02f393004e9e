// SPDX-License-Identifier: Apache-2.0
// Weight loading for the engine example: config.json + model.safetensors of the
// kvp-tiny model (tools/model/model.py documents the tensor names and layouts).
//
// The file is read and validated by the library's safetensors reader
// (kvpolicy/io/safetensors.hpp: header bounds, offsets, sizes, overlaps); this
// layer adds what the engine needs on top: dtype F32, and (model.hpp) the
// expected shape of every tensor. Defined in model.cpp (kvp_engine_lib).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvp_engine {

/// One fp32 tensor, row-major.
struct WeightTensor {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

/// The whole file as bytes; throws std::runtime_error when it cannot be opened.
std::string read_text_file(const std::string& path);

/// Reads every tensor of a safetensors file; throws std::runtime_error naming
/// the file and tensor on any inconsistency. Only F32 tensors are accepted.
std::map<std::string, WeightTensor> load_safetensors_f32(const std::string& path);

}  // namespace kvp_engine
