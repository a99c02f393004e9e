// Minimal embedding: SnapKV on the caller's own fp16 buffers, CPU backend.
#include <cstdio>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"

int main() {
  using namespace kvpolicy;
  const int Hq = 8, Hkv = 2, T = 300, d = 64, w = 16;
  std::vector<float> q(Hq * w * d);
  std::vector<half> k(Hkv * T * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 37) % 17) / 17.0f - 0.5f;
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = to_half(static_cast<float>((i * 53) % 23) / 23.0f - 0.5f);
  ScoreInput<float, half> in{TensorView<const float, 3>::contiguous(q.data(), {Hq, w, d}),
                             KVSource<half>::from(TensorView<const half, 3>::contiguous(k.data(), {Hkv, T, d}))};
  const SnapKV policy(SnapKVParams::kvpress(0.5, w, 5));
  const Requirements req = policy.requirements(Context<backend::Cpu>{}, ProblemShape{Hq, Hkv, d, T, w});
  if (!req.status.is_ok()) {
    std::fprintf(stderr, "requirements failed: %s\n", req.status.message());
    return 1;
  }
  std::vector<std::byte> ws(req.workspace_bytes);
  std::vector<std::int32_t> indptr(req.output.rows + 1), idx(req.output.capacity);
  KeepSet keep{indptr.data(), idx.data(), req.output.rows, static_cast<std::int64_t>(idx.size())};
  const Status s = policy.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, keep);
  if (!s.is_ok()) {
    std::fprintf(stderr, "evict failed: %s\n", s.message());
    return 1;
  }
  std::printf("kvpolicy consumer: isa=%s kept %lld of %d tokens per kv head, last=%d\n", backend::Cpu::isa_name(),
              static_cast<long long>(keep.row_size(0)), T, keep.row(0).back());
  return keep.row_size(0) == 150 && keep.row(0).back() == T - 1 ? 0 : 1;
}
