// PageTable / PageSelection validation: null members, negative counts and
// sizes are named with their constraint before anything is read.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

TEST_CASE("PageSelection::validate: null last_page_len / indices and negative counts are named", "[checked][paged]") {
  std::vector<std::int32_t> indptr{0, 2, 3}, indices{4, 1, 2}, last{3, 1};
  PageSelection sel{indptr.data(), indices.data(), last.data(), nullptr, 2, 3};
  REQUIRE(sel.validate("t", 8, 4).is_ok());
  PageSelection s = sel;
  s.last_page_len = nullptr;
  REQUIRE_THAT(s.validate("t", 8, 4).message(), Contains("t: page selection last_page_len is null"));
  s = sel;
  s.indices = nullptr;
  REQUIRE_THAT(s.validate("t", 8, 4).message(), Contains("t: page selection indices is null with 3 entries"));
  s = sel;
  REQUIRE_THAT(s.validate("t", -3, 4).message(), Contains("num_pages is -3, must be >= 0"));
  REQUIRE_THAT(s.validate("t", 8, 0).message(), Contains("page_size is 0, must be >= 1"));
  s.capacity = -1;
  REQUIRE_THAT(s.validate("t", 8, 4).message(), Contains("capacity is -1, must be >= 0"));
  s = sel;
  s.num_rows = std::int64_t{1} << 32;
  REQUIRE_THAT(s.validate("t", 8, 4).message(), Contains("at most 2^31-1"));
  // An empty selection needs neither indices nor last_page_len.
  std::vector<std::int32_t> zero{0};
  REQUIRE(PageSelection{zero.data(), nullptr, nullptr, nullptr, 0, 0}.validate("t", 8, 4).is_ok());
}

TEST_CASE("PageTable::validate: a negative pool size says it must be >= 0 (not a range ending at -3)", "[checked][paged]") {
  std::vector<std::int32_t> indptr{0, 2}, indices{0, 1}, last{2};
  const PageTable t{indptr.data(), indices.data(), last.data(), 1};
  const Status s = t.validate("t", -3, 4);
  INFO(s.message());
  REQUIRE_THAT(s.message(), Contains("num_pages is -3, must be >= 0"));
  REQUIRE_THAT(s.message(), !Contains("out of range"));
  REQUIRE_THAT(t.validate("t", 4, -1).message(), Contains("page_size is -1, must be >= 1"));
}

TEST_CASE("PageTable::seq_len of a table not yet validated is defined: a decreasing indptr gives length 0", "[checked][paged]") {
  // Found by tests/fuzz/fuzz_evict: policies read lengths before validating the table; with
  // indptr[1] = INT32_MIN the page count minus one overflowed int32 (and wrapped to a huge length).
  const std::vector<std::int32_t> indptr{0, INT32_MIN, INT32_MAX}, last{1, 2};
  const PageTable t{indptr.data(), nullptr, last.data(), 2};
  REQUIRE(t.seq_len(0, 16) == 0);
  const std::vector<std::int32_t> ok{0, 3}, last3{5};
  REQUIRE(PageTable{ok.data(), nullptr, last3.data(), 1}.seq_len(0, 16) == 2 * 16 + 5);
  REQUIRE_THAT(t.validate("t", 4, 16).message(), Contains("t: page table indptr is not monotonic at 0"));
}
