// Fuzz target: the GGUF reader (kvpolicy/io/gguf.hpp) on arbitrary bytes.
// Contract: no crash or sanitizer report; a rejected file leaves the output
// file untouched (no metadata, no tensors) and says why; an accepted file's
// tensors lie inside the data section, do not overlap, hold exactly
// elements x block bytes, and dequantize without reading past their bytes (the
// reader keeps an exactly sized copy, so ASan sees any overread); every typed
// metadata getter either succeeds or fails with a message, never crashes.
#include <cmath>
#include <string>

#include "fuzz_util.hpp"
#include "kvpolicy/io/gguf.hpp"

using namespace kvpolicy;

namespace {

void check_metadata(const io::GgufFile& f) {
  for (const auto& [key, value] : f.metadata()) {
    std::string s;
    std::uint64_t u = 0;
    double x = 0;
    bool b = false;
    std::vector<std::string> strings;
    std::vector<std::int64_t> ints;
    const Status st[] = {f.get_string(key, &s), f.get_uint(key, &u),          f.get_float(key, &x),
                         f.get_bool(key, &b),   f.get_strings(key, &strings), f.get_ints(key, &ints)};
    for (const Status& e : st) KVP_FUZZ_CHECK(e.is_ok() || e.message()[0] != '\0', "metadata getter failed without a message");
    KVP_FUZZ_CHECK(f.find(key) == &value, "find('%s') is not the entry", key.c_str());
    (void)value;
  }
  std::string none;
  KVP_FUZZ_CHECK(!f.get_string("kvp.fuzz.absent.key", &none).is_ok(), "an absent key was found");
}

void check_tensors(const io::GgufFile& f, std::size_t file_size) {
  std::uint64_t total = 0;
  for (const io::GgufTensorInfo& t : f.tensors()) {
    KVP_FUZZ_CHECK(t.type != nullptr, "tensor '%s' has no type", t.name.c_str());
    KVP_FUZZ_CHECK(t.elements >= 0, "tensor '%s' has %lld elements", t.name.c_str(), static_cast<long long>(t.elements));
    KVP_FUZZ_CHECK(t.offset % f.alignment() == 0, "tensor '%s' offset %llu not aligned to %llu", t.name.c_str(),
                   static_cast<unsigned long long>(t.offset), static_cast<unsigned long long>(f.alignment()));
    KVP_FUZZ_CHECK(t.bytes <= file_size, "tensor '%s' claims %llu bytes of a %zu-byte file", t.name.c_str(),
                   static_cast<unsigned long long>(t.bytes), file_size);
    KVP_FUZZ_CHECK(f.find_tensor(t.name) == &t, "find_tensor('%s') is not the entry", t.name.c_str());
    const std::span<const std::uint8_t> bytes = f.data(t);
    KVP_FUZZ_CHECK(bytes.size() == t.bytes, "data('%s') has %zu bytes, info says %llu", t.name.c_str(), bytes.size(),
                   static_cast<unsigned long long>(t.bytes));
    unsigned sum = 0;
    for (const std::uint8_t c : bytes) sum += c;  // every byte readable
    (void)sum;
    total += t.bytes;
    // Dequantize what is small enough; a wrong-size output is refused and left alone.
    if (t.elements > 0 && t.elements <= (1 << 16)) {
      std::vector<float> out(static_cast<std::size_t>(t.elements), -7.0f);
      const Status s = f.dequantize(t, out);
      if (!s.is_ok()) {
        KVP_FUZZ_CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == -7.0f; }), "dequantize('%s') failed (%s) but wrote",
                       t.name.c_str(), s.message());
      }
      std::vector<float> short_out(out.size() - 1, -7.0f);
      KVP_FUZZ_CHECK(!f.dequantize(t, short_out).is_ok(), "dequantize('%s') accepted a short output", t.name.c_str());
      KVP_FUZZ_CHECK(std::all_of(short_out.begin(), short_out.end(), [](float v) { return v == -7.0f; }), "short output written");
    }
  }
  KVP_FUZZ_CHECK(total <= file_size, "tensors claim %llu bytes of a %zu-byte file", static_cast<unsigned long long>(total), file_size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  io::GgufFile f;
  const Status s = io::GgufFile::from_bytes(std::move(bytes), &f);
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(f.metadata().empty() && f.tensors().empty(), "rejected file (%s) left entries in the output", s.message());
    KVP_FUZZ_CHECK(s.message()[0] != '\0', "error without a message");
    return 0;
  }
  KVP_FUZZ_CHECK(f.version() >= 1, "accepted version %u", f.version());
  KVP_FUZZ_CHECK(f.alignment() > 0, "alignment 0");
  check_metadata(f);
  check_tensors(f, size);
  return 0;
}
