// An owning KeepSet for tests (no test framework needed: the MPI test uses it too).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvpolicy/core/keep_set.hpp"

namespace kvp_test {
using namespace kvpolicy;

struct KeepSetBuffer {
  std::vector<std::int32_t> indptr, indices;
  KeepSetBuffer(std::int64_t rows, std::int64_t capacity) : indptr(rows + 1, 0), indices(capacity, 0) {}
  KeepSet view() {
    return KeepSet{indptr.data(), indices.data(), static_cast<std::int64_t>(indptr.size()) - 1, static_cast<std::int64_t>(indices.size())};
  }
  std::vector<std::int32_t> row(std::int64_t r) const { return {indices.begin() + indptr[r], indices.begin() + indptr[r + 1]}; }
  void fill_sentinel() {
    std::fill(indptr.begin(), indptr.end(), -7);
    std::fill(indices.begin(), indices.end(), -7);
  }
  bool untouched() const {
    return std::all_of(indptr.begin(), indptr.end(), [](auto v) { return v == -7; }) &&
           std::all_of(indices.begin(), indices.end(), [](auto v) { return v == -7; });
  }
  bool operator==(const KeepSetBuffer& o) const {
    if (indptr != o.indptr) return false;
    return std::equal(indices.begin(), indices.begin() + indptr.back(), o.indices.begin());
  }
};

}  // namespace kvp_test
