// SPDX-License-Identifier: Apache-2.0
// Validated GGUF reader (llama.cpp's model file format, versions 2 and 3).
//
// Format (ggml/docs/gguf.md), little-endian throughout:
//   "GGUF" magic, u32 version, u64 tensor_count, u64 metadata_kv_count,
//   metadata_kv_count x { string key, u32 value_type, value },
//   tensor_count x { string name, u32 n_dims, u64 ne[n_dims] (ne[0] innermost),
//                    u32 ggml_type, u64 offset (into the data section) },
//   padding to `general.alignment` (default 32), the data section.
// A string is a u64 byte length and the bytes; an array is a u32 element type,
// a u64 count and the elements (arrays of arrays allowed).
//
// Validation (every failure is a Status naming the key or tensor and the
// constraint; nothing is kept from a failed parse):
//   * a file shorter than its header, a bad magic, versions other than 2 and 3;
//   * counts (tensors, keys, array elements, string bytes) larger than the
//     bytes left could hold, any read past the end;
//   * an unknown metadata value type, duplicate keys, arrays nested deeper than
//     8, `general.alignment` that is not a power of two in [1, 2^16];
//   * duplicate tensor names, 0 or more than 4 dimensions, an extent < 1, an
//     element count that overflows, an unknown ggml type, ne[0] not a multiple
//     of the type's block, an offset not aligned, data past the end of the
//     file or overlapping another tensor.
// Dequantization to fp32 covers F32, F16, BF16 and the block formats of
// quant/ggml.hpp (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), bit-exact with
// gguf-py 0.19 (`gguf.quants.dequantize`, tests/io/test_gguf.cpp on the
// SmolLM2 file). K-quants and the other types are parsed and sized; asking to
// dequantize them is an error naming the type.
//
// The whole file is read into memory (`open`), or parsed from caller bytes
// (`from_bytes`). Thread-safety: immutable after parsing.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/quant/ggml.hpp"

static_assert(std::endian::native == std::endian::little, "kvpolicy io: GGUF reading assumes a little-endian host");

KVP_NAMESPACE_BEGIN
namespace io {

enum class GgufValueType : std::uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

inline const char* gguf_value_type_name(GgufValueType t) noexcept {
  static constexpr const char* kNames[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < 13 ? kNames[i] : "unknown";
}

/// One metadata value. Scalars: `i` (signed and bool), `u` (unsigned), `f`
/// (floats), `s` (strings); arrays: `elem` and `items`.
struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  std::int64_t i = 0;
  std::uint64_t u = 0;
  double f = 0.0;
  std::string s;
  GgufValueType elem = GgufValueType::kU8;
  std::vector<GgufValue> items;

  bool is_integer() const noexcept {
    switch (type) {
      case GgufValueType::kU8:
      case GgufValueType::kI8:
      case GgufValueType::kU16:
      case GgufValueType::kI16:
      case GgufValueType::kU32:
      case GgufValueType::kI32:
      case GgufValueType::kU64:
      case GgufValueType::kI64: return true;
      default: return false;
    }
  }
  bool is_unsigned() const noexcept {
    return type == GgufValueType::kU8 || type == GgufValueType::kU16 || type == GgufValueType::kU32 || type == GgufValueType::kU64;
  }
};

/// A ggml tensor type: its name, values per block and bytes per block.
struct GgufTensorType {
  std::uint32_t id;
  const char* name;
  std::int32_t block;
  std::int32_t bytes;
};

/// The ggml types (ggml.h `enum ggml_type`) a GGUF may name; nullptr for an unknown id.
inline const GgufTensorType* find_gguf_tensor_type(std::uint32_t id) noexcept {
  static constexpr GgufTensorType kTable[] = {
      {0, "F32", 1, 4},        {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},    {3, "Q4_1", 32, 20},    {6, "Q5_0", 32, 22},
      {7, "Q5_1", 32, 24},     {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},    {10, "Q2_K", 256, 84},  {11, "Q3_K", 256, 110},
      {12, "Q4_K", 256, 144},  {13, "Q5_K", 256, 176},   {14, "Q6_K", 256, 210}, {15, "Q8_K", 256, 292}, {16, "IQ2_XXS", 256, 66},
      {17, "IQ2_XS", 256, 74}, {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50}, {20, "IQ4_NL", 32, 18}, {21, "IQ3_S", 256, 110},
      {22, "IQ2_S", 256, 82},  {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},       {25, "I16", 1, 2},      {26, "I32", 1, 4},
      {27, "I64", 1, 8},       {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56}, {30, "BF16", 1, 2},
  };
  for (const auto& t : kTable)
    if (t.id == id) return &t;
  return nullptr;
}

struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> ne;  ///< extents, ne[0] innermost (a (rows, cols) matrix has ne = {cols, rows})
  const GgufTensorType* type = nullptr;
  std::uint64_t offset = 0;  ///< into the data section
  std::uint64_t bytes = 0;
  std::int64_t elements = 0;
  std::int64_t rows() const noexcept { return ne.empty() ? 0 : elements / ne[0]; }
};

class GgufFile {
 public:
  static constexpr std::uint64_t kDefaultAlignment = 32;

  /// Reads and validates the whole file.
  static Status open(const std::string& path, GgufFile* out) noexcept {
    try {
      std::ifstream f(path, std::ios::binary | std::ios::ate);
      if (!f) return KVP_INVALID("gguf: cannot open '%s'", path.c_str());
      const std::streamoff size = f.tellg();
      if (size < 0) return KVP_INVALID("gguf: cannot size '%s'", path.c_str());
      std::vector<std::byte> bytes(static_cast<std::size_t>(size));
      f.seekg(0);
      if (size > 0 && !f.read(reinterpret_cast<char*>(bytes.data()), size)) return KVP_INVALID("gguf: short read on '%s'", path.c_str());
      return from_bytes(std::move(bytes), out);
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("gguf: out of memory reading '%s'", path.c_str());
    }
  }

  /// Parses and validates `bytes` (kept by the file).
  static Status from_bytes(std::vector<std::byte> bytes, GgufFile* out) noexcept {
    if (out == nullptr) return KVP_INVALID("gguf: output file is null");
    const std::size_t size = bytes.size();
    try {
      GgufFile g;
      g.bytes_ = std::move(bytes);
      KVP_RETURN_IF_ERROR(g.parse());
      *out = std::move(g);
      return Status::ok();
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("gguf: out of memory parsing %zu bytes", size);
    }
  }

  std::uint32_t version() const noexcept { return version_; }
  std::uint64_t alignment() const noexcept { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const noexcept { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const noexcept { return tensors_; }

  const GgufValue* find(const std::string& key) const noexcept {
    const auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
  }
  const GgufTensorInfo* find_tensor(const std::string& name) const noexcept {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }

  Status get_string(const std::string& key, std::string* v) const noexcept {
    const GgufValue* x = nullptr;
    KVP_RETURN_IF_ERROR(lookup(key, &x));
    KVP_REQUIRE(x->type == GgufValueType::kString, "gguf: metadata '%s' is %s, expected string", key.c_str(),
                gguf_value_type_name(x->type));
    *v = x->s;
    return Status::ok();
  }
  /// Any integer type holding a value >= 0.
  Status get_uint(const std::string& key, std::uint64_t* v) const noexcept {
    const GgufValue* x = nullptr;
    KVP_RETURN_IF_ERROR(lookup(key, &x));
    KVP_REQUIRE(x->is_integer(), "gguf: metadata '%s' is %s, expected an integer", key.c_str(), gguf_value_type_name(x->type));
    KVP_REQUIRE(x->is_unsigned() || x->i >= 0, "gguf: metadata '%s' is %lld, expected >= 0", key.c_str(), static_cast<long long>(x->i));
    *v = x->is_unsigned() ? x->u : static_cast<std::uint64_t>(x->i);
    return Status::ok();
  }
  /// f32 / f64 (or an integer).
  Status get_float(const std::string& key, double* v) const noexcept {
    const GgufValue* x = nullptr;
    KVP_RETURN_IF_ERROR(lookup(key, &x));
    if (x->type == GgufValueType::kF32 || x->type == GgufValueType::kF64) {
      *v = x->f;
      return Status::ok();
    }
    KVP_REQUIRE(x->is_integer(), "gguf: metadata '%s' is %s, expected a number", key.c_str(), gguf_value_type_name(x->type));
    *v = x->is_unsigned() ? static_cast<double>(x->u) : static_cast<double>(x->i);
    return Status::ok();
  }
  Status get_bool(const std::string& key, bool* v) const noexcept {
    const GgufValue* x = nullptr;
    KVP_RETURN_IF_ERROR(lookup(key, &x));
    KVP_REQUIRE(x->type == GgufValueType::kBool, "gguf: metadata '%s' is %s, expected bool", key.c_str(), gguf_value_type_name(x->type));
    *v = x->i != 0;
    return Status::ok();
  }
  Status get_strings(const std::string& key, std::vector<std::string>* v) const noexcept {
    const GgufValue* x = nullptr;
    KVP_RETURN_IF_ERROR(lookup(key, &x));
    KVP_REQUIRE(x->type == GgufValueType::kArray && x->elem == GgufValueType::kString, "gguf: metadata '%s' is not an array of strings",
                key.c_str());
    try {
      v->clear();
      v->reserve(x->items.size());
      for (const auto& e : x->items) v->push_back(e.s);
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("gguf: out of memory copying '%s'", key.c_str());
    }
    return Status::ok();
  }
  /// An array of any integer type (or bools).
  Status get_ints(const std::string& key, std::vector<std::int64_t>* v) const noexcept {
    const GgufValue* x = nullptr;
    KVP_RETURN_IF_ERROR(lookup(key, &x));
    KVP_REQUIRE(x->type == GgufValueType::kArray, "gguf: metadata '%s' is %s, expected an array", key.c_str(),
                gguf_value_type_name(x->type));
    try {
      v->clear();
      v->reserve(x->items.size());
      for (const auto& e : x->items) {
        KVP_REQUIRE(e.is_integer() || e.type == GgufValueType::kBool, "gguf: metadata '%s' is an array of %s, expected integers",
                    key.c_str(), gguf_value_type_name(e.type));
        KVP_REQUIRE(!e.is_unsigned() || e.u <= static_cast<std::uint64_t>(INT64_MAX), "gguf: metadata '%s' holds %llu, beyond int64",
                    key.c_str(), static_cast<unsigned long long>(e.u));
        v->push_back(e.is_unsigned() ? static_cast<std::int64_t>(e.u) : e.i);
      }
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("gguf: out of memory copying '%s'", key.c_str());
    }
    return Status::ok();
  }

  /// The bytes of a tensor.
  std::span<const std::uint8_t> data(const GgufTensorInfo& t) const noexcept {
    return {reinterpret_cast<const std::uint8_t*>(bytes_.data()) + data_start_ + t.offset, static_cast<std::size_t>(t.bytes)};
  }

  /// Every element of `t` as fp32 (row-major in ne order: ne[0] fastest) into
  /// `out` (exactly t.elements values). Nothing written on error.
  Status dequantize(const GgufTensorInfo& t, std::span<float> out) const noexcept {
    KVP_REQUIRE(t.type != nullptr, "gguf: tensor '%s' has no type", t.name.c_str());
    KVP_REQUIRE(static_cast<std::int64_t>(out.size()) == t.elements, "gguf: tensor '%s' has %lld elements, output holds %zu",
                t.name.c_str(), static_cast<long long>(t.elements), out.size());
    GgmlType block{};
    const std::uint32_t id = t.type->id;
    const bool blocked = ggml_type_of(id, &block);
    KVP_REQUIRE(id == 0 || id == 1 || id == 30 || blocked, "gguf: dequantizing tensor '%s' of type %s is not implemented", t.name.c_str(),
                t.type->name);
    const std::uint8_t* p = data(t).data();
    const auto n = static_cast<std::size_t>(t.elements);
    if (id == 0) {
      std::memcpy(out.data(), p, n * 4);
    } else if (id == 1 || id == 30) {
      for (std::size_t i = 0; i < n; ++i) {
        const auto b = static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
        out[i] = id == 1 ? to_float(half::from_bits(b)) : to_float(bfloat16::from_bits(b));
      }
    } else {
      const std::size_t blocks = n / kGgmlBlock, bb = static_cast<std::size_t>(ggml_block_bytes(block));
      for (std::size_t i = 0; i < blocks; ++i) ggml_dequantize_block(block, p + i * bb, out.data() + i * kGgmlBlock);
    }
    return Status::ok();
  }

  /// The block formats quant/ggml.hpp implements, by ggml type id.
  static bool ggml_type_of(std::uint32_t id, GgmlType* t) noexcept {
    switch (id) {
      case 2: *t = GgmlType::kQ4_0; return true;
      case 3: *t = GgmlType::kQ4_1; return true;
      case 6: *t = GgmlType::kQ5_0; return true;
      case 7: *t = GgmlType::kQ5_1; return true;
      case 8: *t = GgmlType::kQ8_0; return true;
      case 20: *t = GgmlType::kIQ4_NL; return true;
      default: return false;
    }
  }

 private:
  static constexpr int kMaxArrayDepth = 8;

  Status lookup(const std::string& key, const GgufValue** x) const noexcept {
    *x = find(key);
    KVP_REQUIRE(*x != nullptr, "gguf: metadata key '%s' is missing", key.c_str());
    return Status::ok();
  }

  // ---- parsing ----
  struct Cursor {
    const std::uint8_t* p;
    std::size_t size, pos = 0;
    std::size_t left() const noexcept { return size - pos; }
    template <class T>
    bool read(T* v) noexcept {
      if (left() < sizeof(T)) return false;
      std::memcpy(v, p + pos, sizeof(T));
      pos += sizeof(T);
      return true;
    }
  };

  static Status read_string(Cursor& c, std::string* s, const char* what) {
    std::uint64_t n = 0;
    KVP_REQUIRE(c.read(&n), "gguf: file truncated in the length of %s", what);
    KVP_REQUIRE(n <= c.left(), "gguf: %s has length %llu, only %zu bytes remain", what, static_cast<unsigned long long>(n), c.left());
    s->assign(reinterpret_cast<const char*>(c.p + c.pos), static_cast<std::size_t>(n));
    c.pos += static_cast<std::size_t>(n);
    return Status::ok();
  }

  static std::size_t min_value_bytes(GgufValueType t) noexcept {
    switch (t) {
      case GgufValueType::kU8:
      case GgufValueType::kI8:
      case GgufValueType::kBool: return 1;
      case GgufValueType::kU16:
      case GgufValueType::kI16: return 2;
      case GgufValueType::kU32:
      case GgufValueType::kI32:
      case GgufValueType::kF32: return 4;
      case GgufValueType::kString:
      case GgufValueType::kU64:
      case GgufValueType::kI64:
      case GgufValueType::kF64: return 8;
      case GgufValueType::kArray: return 12;
    }
    return 1;
  }

  static Status read_value(Cursor& c, GgufValueType t, GgufValue* v, const std::string& key, int depth) {
    v->type = t;
    auto need = [&](bool ok) -> Status {
      return ok ? Status::ok() : KVP_INVALID("gguf: file truncated in the value of '%s' (%s)", key.c_str(), gguf_value_type_name(t));
    };
    switch (t) {
      case GgufValueType::kU8: {
        std::uint8_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->u = x;
        break;
      }
      case GgufValueType::kI8: {
        std::int8_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->i = x;
        break;
      }
      case GgufValueType::kU16: {
        std::uint16_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->u = x;
        break;
      }
      case GgufValueType::kI16: {
        std::int16_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->i = x;
        break;
      }
      case GgufValueType::kU32: {
        std::uint32_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->u = x;
        break;
      }
      case GgufValueType::kI32: {
        std::int32_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->i = x;
        break;
      }
      case GgufValueType::kU64: {
        std::uint64_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->u = x;
        break;
      }
      case GgufValueType::kI64: {
        std::int64_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->i = x;
        break;
      }
      case GgufValueType::kF32: {
        float x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->f = x;
        break;
      }
      case GgufValueType::kF64: {
        double x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        v->f = x;
        break;
      }
      case GgufValueType::kBool: {
        std::uint8_t x{};
        KVP_RETURN_IF_ERROR(need(c.read(&x)));
        KVP_REQUIRE(x <= 1, "gguf: metadata '%s' is a bool of value %u, must be 0 or 1", key.c_str(), x);
        v->i = x;
        break;
      }
      case GgufValueType::kString: KVP_RETURN_IF_ERROR(read_string(c, &v->s, ("the value of '" + key + "'").c_str())); break;
      case GgufValueType::kArray: {
        KVP_REQUIRE(depth < kMaxArrayDepth, "gguf: metadata '%s' nests arrays deeper than %d", key.c_str(), kMaxArrayDepth);
        std::uint32_t et = 0;
        std::uint64_t n = 0;
        KVP_RETURN_IF_ERROR(need(c.read(&et) && c.read(&n)));
        KVP_REQUIRE(et <= 12, "gguf: metadata '%s' is an array of unknown value type %u", key.c_str(), et);
        v->elem = static_cast<GgufValueType>(et);
        KVP_REQUIRE(n <= c.left() / min_value_bytes(v->elem), "gguf: metadata '%s' claims %llu elements, only %zu bytes remain",
                    key.c_str(), static_cast<unsigned long long>(n), c.left());
        v->items.resize(static_cast<std::size_t>(n));
        for (auto& e : v->items) KVP_RETURN_IF_ERROR(read_value(c, v->elem, &e, key, depth + 1));
        break;
      }
      default: return KVP_INVALID("gguf: metadata '%s' has unknown value type %u", key.c_str(), static_cast<unsigned>(t));
    }
    return Status::ok();
  }

  Status parse() {
    Cursor c{reinterpret_cast<const std::uint8_t*>(bytes_.data()), bytes_.size()};
    char magic[4];
    KVP_REQUIRE(c.read(&magic) && std::memcmp(magic, "GGUF", 4) == 0, "gguf: not a GGUF file (magic is not 'GGUF')");
    KVP_REQUIRE(c.read(&version_), "gguf: file truncated in the version");
    KVP_REQUIRE(version_ == 2 || version_ == 3, "gguf: version %u is not supported (2 or 3)", version_);
    std::uint64_t n_tensors = 0, n_kv = 0;
    KVP_REQUIRE(c.read(&n_tensors) && c.read(&n_kv), "gguf: file truncated in the header counts");
    KVP_REQUIRE(n_kv <= c.left() / 12, "gguf: header claims %llu metadata keys, only %zu bytes remain",
                static_cast<unsigned long long>(n_kv), c.left());
    for (std::uint64_t k = 0; k < n_kv; ++k) {
      std::string key;
      KVP_RETURN_IF_ERROR(read_string(c, &key, "a metadata key"));
      std::uint32_t t = 0;
      KVP_REQUIRE(c.read(&t), "gguf: file truncated in the type of '%s'", key.c_str());
      KVP_REQUIRE(t <= 12, "gguf: metadata '%s' has unknown value type %u", key.c_str(), t);
      GgufValue v;
      KVP_RETURN_IF_ERROR(read_value(c, static_cast<GgufValueType>(t), &v, key, 0));
      KVP_REQUIRE(kv_.emplace(key, std::move(v)).second, "gguf: metadata key '%s' appears twice", key.c_str());
    }
    if (const GgufValue* a = find("general.alignment")) {
      KVP_REQUIRE(a->is_integer() && a->is_unsigned() && a->u >= 1 && a->u <= 65536 && (a->u & (a->u - 1)) == 0,
                  "gguf: general.alignment must be a power of two in [1, 65536]");
      alignment_ = a->u;
    }
    KVP_REQUIRE(n_tensors <= c.left() / 24, "gguf: header claims %llu tensors, only %zu bytes remain",
                static_cast<unsigned long long>(n_tensors), c.left());
    tensors_.resize(static_cast<std::size_t>(n_tensors));
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      GgufTensorInfo& t = tensors_[i];
      KVP_RETURN_IF_ERROR(read_string(c, &t.name, "a tensor name"));
      std::uint32_t nd = 0;
      KVP_REQUIRE(c.read(&nd), "gguf: file truncated in tensor '%s'", t.name.c_str());
      KVP_REQUIRE(nd >= 1 && nd <= 4, "gguf: tensor '%s' has %u dimensions, must be 1..4", t.name.c_str(), nd);
      t.ne.resize(nd);
      std::int64_t elems = 1;
      for (std::uint32_t d = 0; d < nd; ++d) {
        std::uint64_t e = 0;
        KVP_REQUIRE(c.read(&e), "gguf: file truncated in tensor '%s'", t.name.c_str());
        KVP_REQUIRE(e >= 1 && e <= static_cast<std::uint64_t>(INT64_MAX), "gguf: tensor '%s' has extent %llu in dimension %u, must be >= 1",
                    t.name.c_str(), static_cast<unsigned long long>(e), d);
        t.ne[d] = static_cast<std::int64_t>(e);
        KVP_REQUIRE(checked_mul(elems, t.ne[d], &elems) && elems <= (std::int64_t{1} << 50), "gguf: tensor '%s' has too many elements",
                    t.name.c_str());
      }
      t.elements = elems;
      std::uint32_t type = 0;
      KVP_REQUIRE(c.read(&type) && c.read(&t.offset), "gguf: file truncated in tensor '%s'", t.name.c_str());
      t.type = find_gguf_tensor_type(type);
      KVP_REQUIRE(t.type != nullptr, "gguf: tensor '%s' has unknown ggml type %u", t.name.c_str(), type);
      KVP_REQUIRE(t.ne[0] % t.type->block == 0, "gguf: tensor '%s' has ne[0] = %lld, not a multiple of the %s block of %d", t.name.c_str(),
                  static_cast<long long>(t.ne[0]), t.type->name, t.type->block);
      t.bytes = static_cast<std::uint64_t>(t.elements / t.type->block) * static_cast<std::uint64_t>(t.type->bytes);
      KVP_REQUIRE(t.offset % alignment_ == 0, "gguf: tensor '%s' offset %llu is not a multiple of the alignment %llu", t.name.c_str(),
                  static_cast<unsigned long long>(t.offset), static_cast<unsigned long long>(alignment_));
      KVP_REQUIRE(tensor_index_.emplace(t.name, i).second, "gguf: tensor '%s' appears twice", t.name.c_str());
    }
    const std::size_t header_end = c.pos;
    data_start_ = (header_end + alignment_ - 1) / alignment_ * alignment_;
    KVP_REQUIRE(data_start_ <= bytes_.size() || tensors_.empty(), "gguf: the data section starts at %zu, past the end of the %zu-byte file",
                data_start_, bytes_.size());
    const std::uint64_t data_size = data_start_ <= bytes_.size() ? bytes_.size() - data_start_ : 0;
    std::vector<std::pair<std::uint64_t, std::size_t>> spans;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const GgufTensorInfo& t = tensors_[i];
      KVP_REQUIRE(t.offset <= data_size && t.bytes <= data_size - t.offset,
                  "gguf: tensor '%s' data [%llu, +%llu) lies past the end of the %llu-byte data section", t.name.c_str(),
                  static_cast<unsigned long long>(t.offset), static_cast<unsigned long long>(t.bytes),
                  static_cast<unsigned long long>(data_size));
      spans.emplace_back(t.offset, i);
    }
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i) {
      const GgufTensorInfo& a = tensors_[spans[i - 1].second];
      const GgufTensorInfo& b = tensors_[spans[i].second];
      KVP_REQUIRE(a.offset + a.bytes <= b.offset, "gguf: tensors '%s' and '%s' overlap", a.name.c_str(), b.name.c_str());
    }
    return Status::ok();
  }

  std::vector<std::byte> bytes_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = kDefaultAlignment;
  std::size_t data_start_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
};

}  // namespace io
KVP_NAMESPACE_END
