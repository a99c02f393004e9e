// Fuzz target: the attention-trace reader (kvpolicy/io/trace.hpp) on arbitrary
// bytes (seeds are small valid traces). Contract: no crash or sanitizer report;
// an accepted trace hands out views of every layer with the shapes its info
// states, all of whose elements can be read, and positions of the stated lengths.
#include "fuzz_util.hpp"
#include "kvpolicy/io/trace.hpp"

using namespace kvpolicy;

namespace {

template <class T>
float touch(const TensorView<const T, 3>& v) {
  float s = 0;
  for (std::int64_t i = 0; i < v.extent(0); ++i)
    for (std::int64_t j = 0; j < v.extent(1); ++j)
      for (std::int64_t k = 0; k < v.extent(2); ++k) s += to_float(v(i, j, k));
  return s;
}

template <class T>
void check_layers(const io::Trace& t) {
  const io::TraceInfo& info = t.info();
  for (std::int32_t i = 0; i < std::min(info.num_layers, 8); ++i) {
    io::TraceLayerView<T> v;
    const Status s = t.layer(i, &v);
    KVP_FUZZ_CHECK(s.is_ok(), "layer %d of an accepted trace: %s", i, s.message());
    KVP_FUZZ_CHECK(v.q.extent(0) == info.num_q_heads && v.q.extent(1) == info.num_tokens && v.q.extent(2) == info.head_dim, "q shape");
    KVP_FUZZ_CHECK(v.k.extent(0) == info.num_kv_heads && v.k.extent(1) == info.num_tokens, "k shape");
    KVP_FUZZ_CHECK(v.v.extent(0) == info.num_kv_heads && v.v.extent(1) == info.num_tokens, "v shape");
    float s0 = touch(v.q) + touch(v.k) + touch(v.v) + touch(v.q_decode) + touch(v.k_decode) + touch(v.v_decode) + touch(v.out) +
               touch(v.out_decode);
    (void)s0;
  }
  KVP_FUZZ_CHECK(!t.layer<T>(info.num_layers, nullptr).is_ok(), "layer num_layers accepted");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  io::Trace t;
  const Status s = io::Trace::from_bytes(std::move(bytes), &t);
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(t.info().num_layers == 0 && t.positions().empty(), "rejected trace (%s) filled the output", s.message());
    return 0;
  }
  const io::TraceInfo& info = t.info();
  KVP_FUZZ_CHECK(info.num_layers >= 1 && info.num_q_heads % info.num_kv_heads == 0, "info");
  KVP_FUZZ_CHECK(static_cast<std::int64_t>(t.positions().size()) == info.num_tokens, "positions size");
  KVP_FUZZ_CHECK(static_cast<std::int64_t>(t.decode_positions().size()) == info.num_decode, "decode positions size");
  for (auto p : t.needles()) KVP_FUZZ_CHECK(p >= 0 && p < info.num_tokens, "needle");
  switch (t.dtype()) {
    case DType::kF32: check_layers<float>(t); break;
    case DType::kF16: check_layers<half>(t); break;
    case DType::kBF16: check_layers<bfloat16>(t); break;
    default: KVP_FUZZ_CHECK(false, "trace dtype %s", dtype_name(t.dtype()));
  }
  return 0;
}
