// The newcomer path through an installed kvpolicy: one include, SnapKV on the
// caller's fp16 cache in three statements, and any policy by spec string.
#include <kvpolicy/kvpolicy.hpp>

#include <cstdio>
#include <vector>

int main() {
  const int Hq = 8, Hkv = 2, T = 300, d = 64, w = 16;
  std::vector<float> q(Hq * w * d);
  std::vector<kvpolicy::half> k(Hkv * T * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 37) % 17) / 17.0f - 0.5f;
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = kvpolicy::to_half(static_cast<float>((i * 53) % 23) / 23.0f - 0.5f);

  kvpolicy::Evictor<kvpolicy::SnapKV> snapkv(kvpolicy::SnapKVParams::kvpress(0.5, w, 5));
  const kvpolicy::KeepSet& keep =
      snapkv.evict(kvpolicy::TensorView<const float, 3>::contiguous(q.data(), {Hq, w, d}), kvpolicy::heads_major(k.data(), Hkv, T, d));

  kvpolicy::AnyEvictionPolicy byname;
  const kvpolicy::Status s = kvpolicy::make_eviction_policy("streaming_llm:compression_ratio=0.5,sinks=4", &byname);
  std::printf("kvpolicy one-include consumer: kept %lld of %d; registry: %s (%zu policies)\n", static_cast<long long>(keep.row_size(0)), T,
              s.is_ok() ? "ok" : s.message(), kvpolicy::registry().size());
  return keep.row_size(0) == 150 && s.is_ok() && byname.kept_count(T) == 150 ? 0 : 1;
}
