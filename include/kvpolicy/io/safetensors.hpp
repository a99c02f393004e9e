// SPDX-License-Identifier: Apache-2.0
// Validated safetensors reader and writer.
//
// Format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length N, N bytes of UTF-8 JSON, then the data section. The JSON is an
// object mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (byte offsets into the data section) plus an optional "__metadata__" object of
// string -> string.
//
// Dependencies: this header (and everything under kvpolicy/io/) needs
// nlohmann-json (Debian `nlohmann-json3-dev`; CMake `find_package(nlohmann_json)`,
// link `nlohmann_json::nlohmann_json`). The rest of kvpolicy does not.
//
// Validation (every failure is a Status naming the tensor and the constraint):
//   * file shorter than 8 bytes, header length > 100 MB or past the end of file;
//   * header not valid JSON, not an object, duplicate names;
//   * an entry that is not an object, lacks dtype/shape/data_offsets, has a
//     negative or non-integer extent, a dtype outside the safetensors spec,
//     or a shape whose row-major strides (or element count) overflow int64,
//     even when another extent is 0 and the tensor holds no bytes;
//   * data_offsets with begin > end, end past the data section, a byte size
//     different from prod(shape) * dtype size, or overlapping another tensor;
//   * "__metadata__" not an object of strings.
// Decisions: gaps between tensors and trailing bytes are tolerated (the
// reference Rust reader rejects them; nothing here depends on contiguity).
// Dtypes the spec knows but kvpolicy's `DType` lacks (F64, I8, I16, BOOL, F8_*,
// ...) are validated and listed, and rejected only when a view is requested.
// Typed views require the tensor's address to be aligned to its element size;
// the owning readers copy the data section to 16-byte aligned storage, so only
// files with unaligned offsets (the official writers never produce them) fail.
//
// Thread-safety: a `SafetensorsFile` is immutable after open; concurrent reads are safe.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpolicy/core/any_tensor_view.hpp"
#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"

static_assert(std::endian::native == std::endian::little, "kvpolicy io: safetensors reading assumes a little-endian host");

KVP_NAMESPACE_BEGIN
namespace io {

/// Largest JSON header accepted (the reference implementation uses the same bound).
inline constexpr std::uint64_t kMaxSafetensorsHeader = 100u * 1000u * 1000u;

/// A safetensors dtype string: its element size, and kvpolicy's DType when one exists.
struct SafetensorsDType {
  const char* name;
  std::size_t size;
  bool supported;  ///< has a kvpolicy DType (`dtype`)
  DType dtype;
};

/// The dtypes of the safetensors spec. `nullptr` for a string the spec does not define.
inline const SafetensorsDType* find_safetensors_dtype(std::string_view s) noexcept {
  static constexpr SafetensorsDType kTable[] = {
      {"F32", 4, true, DType::kF32},   {"F16", 2, true, DType::kF16},      {"BF16", 2, true, DType::kBF16},
      {"I32", 4, true, DType::kI32},   {"I64", 8, true, DType::kI64},      {"U8", 1, true, DType::kU8},
      {"F64", 8, false, DType::kF32},  {"I8", 1, false, DType::kF32},      {"I16", 2, false, DType::kF32},
      {"U16", 2, false, DType::kF32},  {"U32", 4, false, DType::kF32},     {"U64", 8, false, DType::kF32},
      {"BOOL", 1, false, DType::kF32}, {"F8_E4M3", 1, false, DType::kF32}, {"F8_E5M2", 1, false, DType::kF32},
  };
  for (const auto& d : kTable)
    if (s == d.name) return &d;
  return nullptr;
}

/// The safetensors name of a kvpolicy DType.
constexpr const char* safetensors_dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
  }
  return "?";
}

/// One tensor of a safetensors file.
struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;  ///< as written in the file ("F32", "BF16", ...)
  std::size_t element_size = 0;
  bool supported = false;  ///< `dtype` is valid (kvpolicy has this element type)
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;   ///< may be empty (a scalar)
  std::uint64_t begin = 0, end = 0;  ///< byte range in the data section

  /// prod(shape); the reader guarantees it fits int64.
  std::int64_t numel() const noexcept {
    std::int64_t n = 0;
    return checked_extent_product(shape.data(), static_cast<int>(shape.size()), &n) ? n : -1;
  }
};

/// A parsed, validated safetensors file. Either owns its bytes (`open`,
/// `from_bytes`) or refers to caller memory that must outlive it (`from_memory`).
class SafetensorsFile {
 public:
  SafetensorsFile() = default;

  /// Read a file into owned memory and validate it. The header is read and
  /// checked first; the data section then goes straight into aligned storage
  /// (one copy of the tensors in memory, nothing read for a corrupt header).
  static Status open(const std::string& path, SafetensorsFile* out) noexcept {
    try {
      std::ifstream f(path, std::ios::binary | std::ios::ate);
      if (!f) return KVP_INVALID("safetensors: cannot open '%s'", path.c_str());
      const std::streamoff size = f.tellg();
      if (size < 0) return KVP_INVALID("safetensors: cannot determine the size of '%s'", path.c_str());
      f.seekg(0);
      const auto fsize = static_cast<std::uint64_t>(size);
      std::byte len[8] = {};
      if (fsize >= 8 && !f.read(reinterpret_cast<char*>(len), 8)) return KVP_INVALID("safetensors: short read on '%s'", path.c_str());
      std::uint64_t n = 0;
      Status s = check_header_length(len, fsize, &n);
      std::string header;
      if (s) {
        header.resize(static_cast<std::size_t>(n));
        if (!f.read(header.data(), static_cast<std::streamsize>(n))) return KVP_INVALID("safetensors: short read on '%s'", path.c_str());
        SafetensorsFile t;
        s = t.parse_header(header.data(), static_cast<std::size_t>(n), fsize - 8 - n);
        if (s) {
          t.alloc_storage(t.data_size_);
          if (t.data_size_ && !f.read(reinterpret_cast<char*>(t.storage_.get()), static_cast<std::streamsize>(t.data_size_)))
            return KVP_INVALID("safetensors: short read on '%s'", path.c_str());
          t.data_ = reinterpret_cast<const std::byte*>(t.storage_.get());
          *out = std::move(t);
          return s;
        }
      }
      return Status::error(s.code(), "%s (file '%s')", s.message(), path.c_str());
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("safetensors: out of memory reading '%s'", path.c_str());
    } catch (...) {
      return KVP_INVALID("safetensors: I/O error reading '%s'", path.c_str());
    }
  }

  /// Validate a buffer and take ownership of it. The data section is copied to
  /// aligned storage, so typed views work whatever the header length.
  static Status from_bytes(std::vector<std::byte> bytes, SafetensorsFile* out) noexcept {
    try {
      SafetensorsFile f;
      KVP_RETURN_IF_ERROR(f.parse(bytes.data(), bytes.size()));
      const std::size_t n = bytes.size() - f.data_start_;
      f.alloc_storage(n);
      if (n) std::memcpy(f.storage_.get(), bytes.data() + f.data_start_, n);
      f.data_ = reinterpret_cast<const std::byte*>(f.storage_.get());
      *out = std::move(f);
      return Status::ok();
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("safetensors: out of memory");
    }
  }

  /// Validate caller memory without copying; `data` must outlive the result.
  static Status from_memory(const void* data, std::size_t size, SafetensorsFile* out) noexcept {
    if (data == nullptr && size != 0) return KVP_INVALID("safetensors: buffer is null but has %zu bytes", size);
    SafetensorsFile f;
    KVP_RETURN_IF_ERROR(f.parse(static_cast<const std::byte*>(data), size));
    f.data_ = static_cast<const std::byte*>(data) + f.data_start_;
    *out = std::move(f);
    return Status::ok();
  }

  /// Tensors in ascending order of their data offset.
  const std::vector<SafetensorsEntry>& tensors() const noexcept { return entries_; }
  /// The "__metadata__" map (empty when absent).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /// Size of the data section in bytes.
  std::uint64_t data_size() const noexcept { return data_size_; }

  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const noexcept {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &entries_[it->second];
  }

  /// Raw bytes of a tensor.
  const std::byte* bytes(const SafetensorsEntry& e) const noexcept { return data_ + e.begin; }

  /// Type-erased read-only view (row-major) of tensor `name`.
  Status tensor(std::string_view name, AnyTensorView* out) const noexcept {
    const SafetensorsEntry* e = find(name);
    if (e == nullptr) return KVP_INVALID("safetensors: no tensor named '%.*s'", static_cast<int>(name.size()), name.data());
    if (!e->supported)
      return Status::error(StatusCode::kUnsupported,
                           "safetensors: tensor '%s' has dtype %s, which kvpolicy does not support (F32, F16, BF16, I32, I64, U8)",
                           e->name.c_str(), e->dtype_name.c_str());
    if (e->shape.size() > static_cast<std::size_t>(AnyTensorView::kMaxRank))
      return Status::error(StatusCode::kUnsupported, "safetensors: tensor '%s' has rank %zu, more than %d", e->name.c_str(),
                           e->shape.size(), AnyTensorView::kMaxRank);
    const auto addr = reinterpret_cast<std::uintptr_t>(data_ + e->begin);
    if (addr % e->element_size != 0)
      return Status::error(StatusCode::kUnsupported, "safetensors: tensor '%s' (%s) starts at a byte address not aligned to %zu",
                           e->name.c_str(), e->dtype_name.c_str(), e->element_size);
    AnyTensorView v;
    v.data = const_cast<std::byte*>(data_ + e->begin);
    v.dtype = e->dtype;
    v.rank = static_cast<std::int32_t>(e->shape.size());
    for (int i = 0; i < v.rank; ++i) v.extents[i] = e->shape[static_cast<std::size_t>(i)];
    if (!checked_row_major_strides(v.extents, v.rank, v.strides))  // checked at parse time; kept as a guard
      return KVP_INVALID("safetensors: tensor '%s' has a shape whose strides overflow int64", e->name.c_str());
    v.read_only = true;
    *out = v;
    return Status::ok();
  }

  /// Typed read-only view of tensor `name`; fails when the dtype or rank differ.
  template <class T, int Rank>
  Status view(std::string_view name, TensorView<const T, Rank>* out) const noexcept {
    AnyTensorView a;
    KVP_RETURN_IF_ERROR(tensor(name, &a));
    const std::string label = "safetensors tensor '" + std::string(name) + "'";
    return a.as<const T, Rank>(out, label.c_str());
  }

 private:
  static bool is_uint(const nlohmann::json& j) noexcept {
    return j.is_number_unsigned() || (j.is_number_integer() && j.get<std::int64_t>() >= 0);
  }

  void alloc_storage(std::uint64_t n) { storage_.reset(new std::max_align_t[static_cast<std::size_t>(n / sizeof(std::max_align_t)) + 1]); }

  /// The 8-byte header length of a buffer of `size` bytes, checked against the limits.
  static Status check_header_length(const std::byte* p, std::uint64_t size, std::uint64_t* n_out) noexcept {
    if (size < 8)
      return KVP_INVALID("safetensors: file too short (%llu bytes); needs at least 8 for the header length",
                         static_cast<unsigned long long>(size));
    std::uint64_t n = 0;
    std::memcpy(&n, p, 8);
    if (n > kMaxSafetensorsHeader)
      return KVP_INVALID("safetensors: header length %llu exceeds the %llu-byte limit (corrupt or not a safetensors file)",
                         static_cast<unsigned long long>(n), static_cast<unsigned long long>(kMaxSafetensorsHeader));
    if (n > size - 8)
      return KVP_INVALID("safetensors: header length %llu runs past the end of the %llu-byte file (truncated?)",
                         static_cast<unsigned long long>(n), static_cast<unsigned long long>(size));
    if (n < 2) return KVP_INVALID("safetensors: header length %llu is too small for a JSON object", static_cast<unsigned long long>(n));
    *n_out = n;
    return Status::ok();
  }

  /// Whole buffer: length, header, and the data section that follows.
  Status parse(const std::byte* p, std::size_t size) noexcept {
    std::uint64_t n = 0;
    KVP_RETURN_IF_ERROR(check_header_length(p, size, &n));
    return parse_header(reinterpret_cast<const char*>(p + 8), static_cast<std::size_t>(n), size - 8 - n);
  }

  /// The JSON header `h` (n bytes) of a file whose data section has `data_size` bytes.
  Status parse_header(const char* h, std::size_t n, std::uint64_t data_size) noexcept {
    try {
      return parse_impl(h, n, data_size);
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("safetensors: out of memory parsing the header");
    } catch (const std::exception& ex) {
      return KVP_INVALID("safetensors: malformed header (%s)", ex.what());
    }
  }

  Status parse_impl(const char* h, std::size_t n, std::uint64_t data_size) {
    // Duplicate keys: nlohmann keeps the last silently, so watch top-level keys while parsing.
    std::set<std::string> seen;
    std::string duplicate;
    auto cb = [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
      if (ev == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string()) {
        const auto& k = parsed.get_ref<const std::string&>();
        if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
      }
      return true;
    };
    const nlohmann::json j = nlohmann::json::parse(h, h + n, cb, /*allow_exceptions=*/false);
    if (j.is_discarded()) return KVP_INVALID("safetensors: header is not valid JSON");
    if (!j.is_object()) return KVP_INVALID("safetensors: header is JSON but not an object");
    if (!duplicate.empty()) return KVP_INVALID("safetensors: duplicate tensor name '%s'", duplicate.c_str());
    data_start_ = 8 + n;
    data_size_ = data_size;

    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) return KVP_INVALID("safetensors: __metadata__ is not an object");
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string()) return KVP_INVALID("safetensors: __metadata__ value of '%s' is not a string", m.key().c_str());
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      const char* nm = name.c_str();
      if (!v.is_object()) return KVP_INVALID("safetensors: entry '%s' is not an object", nm);
      const auto dt = v.find("dtype"), sh = v.find("shape"), off = v.find("data_offsets");
      if (dt == v.end() || !dt->is_string()) return KVP_INVALID("safetensors: tensor '%s' has no string 'dtype'", nm);
      if (sh == v.end() || !sh->is_array()) return KVP_INVALID("safetensors: tensor '%s' has no array 'shape'", nm);
      if (off == v.end() || !off->is_array() || off->size() != 2)
        return KVP_INVALID("safetensors: tensor '%s' has no 2-element array 'data_offsets'", nm);
      SafetensorsEntry e;
      e.name = name;
      e.dtype_name = dt->get<std::string>();
      const SafetensorsDType* d = find_safetensors_dtype(e.dtype_name);
      if (d == nullptr) return KVP_INVALID("safetensors: tensor '%s' has unknown dtype '%s'", nm, e.dtype_name.c_str());
      e.element_size = d->size;
      e.supported = d->supported;
      e.dtype = d->dtype;
      // Byte size with overflow checks: every extent and product stays below 2^62.
      constexpr std::uint64_t kLimit = std::uint64_t{1} << 62;
      std::uint64_t bytes = d->size;
      for (std::size_t i = 0; i < sh->size(); ++i) {
        const auto& x = (*sh)[i];
        if (!is_uint(x)) return KVP_INVALID("safetensors: tensor '%s' shape[%zu] is not a non-negative integer", nm, i);
        const std::uint64_t ext = x.get<std::uint64_t>();
        if (ext >= kLimit)
          return KVP_INVALID("safetensors: tensor '%s' shape[%zu] = %llu is absurd", nm, i, static_cast<unsigned long long>(ext));
        if (ext != 0 && bytes > kLimit / ext) return KVP_INVALID("safetensors: tensor '%s' byte size overflows (shape too large)", nm);
        bytes *= ext;
        e.shape.push_back(static_cast<std::int64_t>(ext));
      }
      // The byte size above is 0 as soon as one extent is; the strides of a view still multiply the others.
      std::vector<std::int64_t> strides(e.shape.size());
      if (!checked_row_major_strides(e.shape.data(), static_cast<int>(e.shape.size()), strides.data()))
        return KVP_INVALID("safetensors: tensor '%s' shape is too large: its row-major strides overflow int64", nm);
      if (!is_uint((*off)[0]) || !is_uint((*off)[1]))
        return KVP_INVALID("safetensors: tensor '%s' data_offsets are not non-negative integers", nm);
      e.begin = (*off)[0].get<std::uint64_t>();
      e.end = (*off)[1].get<std::uint64_t>();
      if (e.begin > e.end)
        return KVP_INVALID("safetensors: tensor '%s' data_offsets [%llu, %llu] end before they begin", nm,
                           static_cast<unsigned long long>(e.begin), static_cast<unsigned long long>(e.end));
      if (e.end > data_size_)
        return KVP_INVALID("safetensors: tensor '%s' data_offsets end %llu is past the %llu-byte data section (truncated file?)", nm,
                           static_cast<unsigned long long>(e.end), static_cast<unsigned long long>(data_size_));
      if (e.end - e.begin != bytes)
        return KVP_INVALID("safetensors: tensor '%s' has %llu bytes but shape x %s needs %llu", nm,
                           static_cast<unsigned long long>(e.end - e.begin), e.dtype_name.c_str(), static_cast<unsigned long long>(bytes));
      entries_.push_back(std::move(e));
    }
    std::stable_sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    const SafetensorsEntry* prev = nullptr;
    for (const auto& e : entries_) {
      if (e.begin == e.end) continue;  // empty tensors occupy no bytes
      if (prev && e.begin < prev->end)
        return KVP_INVALID("safetensors: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", prev->name.c_str(),
                           static_cast<unsigned long long>(prev->begin), static_cast<unsigned long long>(prev->end), e.name.c_str(),
                           static_cast<unsigned long long>(e.begin), static_cast<unsigned long long>(e.end));
      prev = &e;
    }
    for (std::size_t i = 0; i < entries_.size(); ++i) by_name_.emplace(entries_[i].name, i);
    return Status::ok();
  }

  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<std::max_align_t[]> storage_;
  const std::byte* data_ = nullptr;
  std::size_t data_start_ = 0;
  std::uint64_t data_size_ = 0;
};

/// Builds a safetensors file in memory. Tensors are laid out contiguously,
/// largest element size first (so every tensor is aligned to its element size
/// once the header is padded to a multiple of 8, as the reference writer does).
class SafetensorsWriter {
 public:
  /// Add a tensor from raw bytes (`bytes` must be prod(shape) * element size).
  Status add(std::string name, DType dtype, std::vector<std::int64_t> shape, const void* data, std::size_t bytes) {
    if (name == "__metadata__" || name.empty()) return KVP_INVALID("safetensors writer: invalid tensor name '%s'", name.c_str());
    for (const auto& t : tensors_)
      if (t.name == name) return KVP_INVALID("safetensors writer: duplicate tensor name '%s'", name.c_str());
    std::uint64_t n = dtype_size(dtype);
    for (auto e : shape) {
      if (e < 0) return KVP_INVALID("safetensors writer: tensor '%s' has a negative extent", name.c_str());
      n *= static_cast<std::uint64_t>(e);
    }
    if (n != bytes)
      return KVP_INVALID("safetensors writer: tensor '%s' has %zu bytes, shape needs %llu", name.c_str(), bytes,
                         static_cast<unsigned long long>(n));
    if (data == nullptr && bytes != 0) return KVP_INVALID("safetensors writer: tensor '%s' data is null", name.c_str());
    Pending p{std::move(name), dtype, std::move(shape), std::vector<std::byte>(bytes)};
    if (bytes) std::memcpy(p.data.data(), data, bytes);
    tensors_.push_back(std::move(p));
    return Status::ok();
  }

  /// Add a row-major tensor of element type T.
  template <class T>
  Status add(std::string name, std::vector<std::int64_t> shape, const T* data) {
    std::size_t n = 1;
    for (auto e : shape) n *= static_cast<std::size_t>(std::max<std::int64_t>(e, 0));
    return add(std::move(name), dtype_v<T>, std::move(shape), data, n * sizeof(T));
  }

  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  /// The serialized file.
  std::vector<std::byte> to_bytes() const {
    std::vector<const Pending*> order;
    for (const auto& t : tensors_) order.push_back(&t);
    std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return dtype_size(a->dtype) > dtype_size(b->dtype); });
    nlohmann::json h = nlohmann::json::object();
    if (!metadata_.empty()) h["__metadata__"] = metadata_;
    std::uint64_t off = 0;
    for (const auto* t : order) {
      h[t->name] = {{"dtype", safetensors_dtype_name(t->dtype)}, {"shape", t->shape}, {"data_offsets", {off, off + t->data.size()}}};
      off += t->data.size();
    }
    std::string js = h.dump();
    js.append((8 - js.size() % 8) % 8, ' ');
    std::vector<std::byte> out(8 + js.size() + off);
    const std::uint64_t n = js.size();
    std::memcpy(out.data(), &n, 8);
    std::memcpy(out.data() + 8, js.data(), js.size());
    std::size_t pos = 8 + js.size();
    for (const auto* t : order) {
      if (!t->data.empty()) std::memcpy(out.data() + pos, t->data.data(), t->data.size());
      pos += t->data.size();
    }
    return out;
  }

  /// Write the file to `path`.
  Status write(const std::string& path) const {
    const auto b = to_bytes();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) return KVP_INVALID("safetensors writer: cannot create '%s'", path.c_str());
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    if (!f) return KVP_INVALID("safetensors writer: write to '%s' failed", path.c_str());
    return Status::ok();
  }

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> data;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace io
KVP_NAMESPACE_END
