// SPDX-License-Identifier: Apache-2.0
// How an engine embeds kvpolicy: after prefill, run SnapKV on the engine's own
// fp16 cache laid out (capacity, kv_heads, head_dim) token-major with padding,
// then compact K/V in place and keep the logical RoPE positions.
#include <cstdio>
#include <random>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/util/thread_pool.hpp"

int main() {
  using namespace kvpolicy;
  // ---- the engine's buffers (normally owned by the engine) ----
  const std::int64_t n_q_heads = 32, n_kv_heads = 8, head_dim = 128, capacity = 4096, kv_len = 3000, window = 32;
  std::vector<half> k_cache(capacity * n_kv_heads * head_dim), v_cache(k_cache.size());
  std::vector<float> q_window(window * n_q_heads * head_dim);  // (window, q_heads, head_dim) as the engine produced it
  std::vector<std::int32_t> positions(n_kv_heads * capacity);
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  for (auto& x : k_cache) x = to_half(nd(rng));
  for (auto& x : v_cache) x = to_half(nd(rng));
  for (auto& x : q_window) x = nd(rng);
  for (std::int64_t h = 0; h < n_kv_heads; ++h)
    for (std::int64_t t = 0; t < capacity; ++t) positions[h * capacity + t] = static_cast<std::int32_t>(t);

  // ---- views over them: no copies ----
  const std::int64_t tok = n_kv_heads * head_dim;  // token stride of the token-major cache
  TensorView<half, 3> keys(k_cache.data(), {n_kv_heads, capacity, head_dim}, {head_dim, tok, 1});
  TensorView<half, 3> values(v_cache.data(), {n_kv_heads, capacity, head_dim}, {head_dim, tok, 1});
  ScoreInput<float, half> in{
      TensorView<const float, 3>(q_window.data(), {n_q_heads, window, head_dim}, {head_dim, n_q_heads * head_dim, 1}),
      KVSource<half>::from(TensorView<const half, 3>(keys.narrow(1, 0, kv_len)))};

  // ---- decide ----
  const SnapKV snapkv(SnapKVParams::kvpress(/*compression_ratio=*/0.75, window, /*kernel=*/5));
  ThreadPool pool(2);
  const ExecContext ctx = pool.context();
  // One size query: workspace, KeepSet rows / capacity (and the query window the engine must keep).
  const Requirements req =
      snapkv.requirements(Context<backend::Cpu>{{}, ctx}, ProblemShape{n_q_heads, n_kv_heads, head_dim, kv_len, window});
  if (!req) {
    std::fprintf(stderr, "snapkv: %s\n", req.status.message());
    return 1;
  }
  std::vector<std::byte> ws(req.workspace_bytes);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(req.output.rows + 1)), ids(static_cast<std::size_t>(req.output.capacity));
  KeepSet keep{indptr.data(), ids.data(), req.output.rows, req.output.capacity};
  Status s = snapkv.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, ctx}, in, keep);
  if (!s) {
    std::fprintf(stderr, "snapkv: %s\n", s.message());
    return 1;
  }
  // ---- apply ----
  std::vector<std::int64_t> new_lens(n_kv_heads);
  s = compact_contiguous<half>(keys, values, TensorView<std::int32_t, 2>::contiguous(positions.data(), {n_kv_heads, capacity}), kv_len,
                               keep, 0, new_lens);
  if (!s) {
    std::fprintf(stderr, "compact: %s\n", s.message());
    return 1;
  }
  std::printf("SnapKV kept %lld of %lld tokens per kv head (ISA %s); kv head 0 now starts with positions %d %d %d ... ends %d\n",
              static_cast<long long>(new_lens[0]), static_cast<long long>(kv_len), backend::Cpu::isa_name(), positions[0], positions[1],
              positions[2], positions[new_lens[0] - 1]);
  // The next decode token gets RoPE position kv_len (= 3000), not new_lens[h].
  return 0;
}
