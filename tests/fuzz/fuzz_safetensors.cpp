// Fuzz target: the safetensors reader (kvpolicy/io/safetensors.hpp) on arbitrary bytes.
// Contract: no crash or sanitizer report; the in-place (`from_memory`) and the
// copying (`from_bytes`) readers agree; an accepted file's entries lie inside
// its data section with exactly numel * element_size bytes, and every view it
// hands out reads only that (the input is exactly as large as the fuzzer's, so
// ASan sees any overread); a rejected file leaves the output untouched.
#include <string>

#include "fuzz_util.hpp"
#include "kvpolicy/io/safetensors.hpp"

using namespace kvpolicy;

namespace {

void check_file(const io::SafetensorsFile& f) {
  std::uint64_t prev_end = 0;
  for (const io::SafetensorsEntry& e : f.tensors()) {
    KVP_FUZZ_CHECK(e.begin <= e.end && e.end <= f.data_size(), "tensor '%s' [%llu, %llu) outside %llu bytes", e.name.c_str(),
                   static_cast<unsigned long long>(e.begin), static_cast<unsigned long long>(e.end),
                   static_cast<unsigned long long>(f.data_size()));
    // Empty tensors occupy no bytes (the reader's documented rule), so only
    // non-empty ones must not overlap.
    if (e.begin != e.end) {
      KVP_FUZZ_CHECK(e.begin >= prev_end, "tensor '%s' overlaps its predecessor", e.name.c_str());
      prev_end = e.end;
    }
    KVP_FUZZ_CHECK(e.numel() >= 0 && static_cast<std::uint64_t>(e.numel()) * e.element_size == e.end - e.begin,
                   "tensor '%s': numel %lld x %zu bytes != %llu", e.name.c_str(), static_cast<long long>(e.numel()), e.element_size,
                   static_cast<unsigned long long>(e.end - e.begin));
    KVP_FUZZ_CHECK(f.find(e.name) == &e, "find('%s') is not the entry", e.name.c_str());
    // Touch every byte of the tensor.
    const std::byte* p = f.bytes(e);
    unsigned sum = 0;
    for (std::uint64_t i = 0; i < e.end - e.begin; ++i) sum += static_cast<unsigned>(p[i]);
    (void)sum;
    AnyTensorView v;
    if (f.tensor(e.name, &v).is_ok()) {
      KVP_FUZZ_CHECK(v.rank == static_cast<std::int32_t>(e.shape.size()), "rank");
      if (e.supported && e.dtype == DType::kF32 && e.shape.size() == 1) {
        TensorView<const float, 1> t;
        KVP_FUZZ_CHECK(f.view(e.name, &t).is_ok(), "1-d F32 view of '%s' refused", e.name.c_str());
        float s = 0;
        for (std::int64_t i = 0; i < t.extent(0); ++i) s += t(i);
        (void)s;
      }
    }
  }
  for (const auto& [k, v] : f.metadata()) (void)(k.size() + v.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  io::SafetensorsFile in_place;
  const Status a = io::SafetensorsFile::from_memory(data, size, &in_place);
  if (!a.is_ok()) {
    KVP_FUZZ_CHECK(in_place.tensors().empty() && in_place.metadata().empty() && in_place.data_size() == 0,
                   "rejected file (%s) left entries in the output", a.message());
    KVP_FUZZ_CHECK(a.message()[0] != '\0', "error without a message");
  } else {
    check_file(in_place);
  }
  std::vector<std::byte> copy(size);
  if (size) std::memcpy(copy.data(), data, size);
  io::SafetensorsFile owned;
  const Status b = io::SafetensorsFile::from_bytes(std::move(copy), &owned);
  KVP_FUZZ_CHECK(a.is_ok() == b.is_ok(), "from_memory: '%s', from_bytes: '%s'", a.message(), b.message());
  if (b.is_ok()) {
    check_file(owned);
    KVP_FUZZ_CHECK(owned.tensors().size() == in_place.tensors().size(), "readers disagree on the tensor count");
  } else {
    KVP_FUZZ_CHECK(std::string(a.message()) == b.message(), "readers disagree: '%s' vs '%s'", a.message(), b.message());
  }
  return 0;
}
