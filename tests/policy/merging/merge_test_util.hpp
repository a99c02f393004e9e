// Helpers of the merging tests: an owning MergePlan, keep sets from lists, and
// one-call merges sized by `requirements`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/policy/merging/merge_common.hpp"
#include "policy/emulated_device.hpp"
#include "policy/policy_test_util.hpp"

namespace kvp_merge_test {
using namespace kvpolicy;

/// Plan storage: `rows` rows, `capacity` entries, merged buffers of rows x slots rows of d.
struct PlanBuffer {
  std::vector<std::int32_t> indptr, dst, src;
  std::vector<float> weight, keys, values;
  std::int64_t rows, capacity, slots, d;
  PlanBuffer(std::int64_t r, std::int64_t cap, std::int64_t s, std::int64_t dd, bool with_keys = true, bool with_values = true)
      : indptr(r + 1, -7),
        dst(cap, -7),
        src(cap, -7),
        weight(cap, -7.0f),
        keys(with_keys ? r * s * dd : 0, -7.0f),
        values(with_values ? r * s * dd : 0, -7.0f),
        rows(r),
        capacity(cap),
        slots(s),
        d(dd) {}
  MergePlan view() {
    MergePlan p{indptr.data(), dst.data(), src.data(), weight.data(), rows, capacity};
    if (!keys.empty()) p.merged_keys = TensorView<float, 2>::contiguous(keys.data(), {rows * slots, d});
    if (!values.empty()) p.merged_values = TensorView<float, 2>::contiguous(values.data(), {rows * slots, d});
    p.slots_per_row = slots;
    return p;
  }
  bool untouched() const {
    auto all = [](const auto& v, auto x) { return std::all_of(v.begin(), v.end(), [&](auto y) { return y == x; }); };
    return all(indptr, -7) && all(dst, -7) && all(src, -7) && all(weight, -7.0f) && all(keys, -7.0f) && all(values, -7.0f);
  }
  const float* value_row(std::int64_t r, std::int64_t c) const { return values.data() + (r * slots + c) * d; }
  const float* key_row(std::int64_t r, std::int64_t c) const { return keys.data() + (r * slots + c) * d; }
  /// Entries of row r as (dst, src, weight) triples.
  struct Entry {
    std::int32_t dst, src;
    float weight;
  };
  std::vector<Entry> entries(std::int64_t r) const {
    std::vector<Entry> e;
    for (std::int32_t i = indptr[r]; i < indptr[r + 1]; ++i) e.push_back({dst[i], src[i], weight[i]});
    return e;
  }
};

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

/// Row h of a device backend's dense plan (`all`) against the host's compacted row (`want`): its entries
/// with dst >= 0, in order, equal the host's bit for bit; the others weigh 0.
inline void require_dense_matches(const std::vector<PlanBuffer::Entry>& all, const std::vector<PlanBuffer::Entry>& want, std::int64_t h) {
  std::vector<PlanBuffer::Entry> merged;
  for (const PlanBuffer::Entry& e : all) {
    if (e.dst >= 0)
      merged.push_back(e);
    else
      REQUIRE(same_bits(e.weight, 0.0f));
  }
  REQUIRE(merged.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("head " << h << " entry " << i);
    REQUIRE(merged[i].dst == want[i].dst);
    REQUIRE(merged[i].src == want[i].src);
    REQUIRE(same_bits(merged[i].weight, want[i].weight));
  }
}

/// KeepSet storage from per-row id lists.
struct Keep {
  std::vector<std::int32_t> indptr{0}, indices;
  explicit Keep(const std::vector<std::vector<std::int32_t>>& rows) {
    for (const auto& r : rows) {
      indices.insert(indices.end(), r.begin(), r.end());
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
    }
  }
  KeepSet view() const {
    return KeepSet{const_cast<std::int32_t*>(indptr.data()), const_cast<std::int32_t*>(indices.data()),
                   static_cast<std::int64_t>(indptr.size()) - 1, static_cast<std::int64_t>(indices.size())};
  }
};

/// Workspace sized by the policy's requirements for (H, T, d).
template <class B, class P>
std::vector<std::byte> workspace_for(const P& p, std::int64_t H, std::int64_t T, std::int64_t d, std::int64_t Hq = 0,
                                     const ExecContext& ex = {}) {
  const Requirements r = p.requirements(Context<B>{{}, ex}, ProblemShape{Hq > 0 ? Hq : H, H, d, T, 1});
  REQUIRE(r.status.is_ok());
  return std::vector<std::byte>(r.workspace_bytes + 1, kvp_test::kWorkspacePoison);
}

template <class B, class P, class In>
Status run_merge(const P& p, const In& in, const KeepSet& keep, MergePlan plan, std::int64_t H, std::int64_t T, std::int64_t d,
                 std::int64_t Hq = 0) {
  auto ws = workspace_for<B>(p, H, T, d, Hq);
  return p.merge(Context<B>{Workspace{ws.data(), ws.size()}}, in, keep, plan);
}

}  // namespace kvp_merge_test
