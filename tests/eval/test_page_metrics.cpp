// eval/page_metrics.hpp on the scalar reference: workspace size and carve agree
// on every shape, NaN propagates, bad tables are rejected with clear messages.
#include <catch2/catch.hpp>

#include <limits>
#include <vector>

#include "eval/eval_test_util.hpp"
#include "kvpolicy/eval/page_metrics.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using namespace eval_test;
using Catch::Matchers::Contains;

TEST_CASE("attend_pages: every (group, head_dim, page_size) matches the reference with an exactly sized workspace", "[eval][attention]") {
  check_many_shapes<backend::Scalar>(ExecContext{});
  ThreadPool pool(3);
  check_many_shapes<backend::Scalar>(pool.context());
}

TEST_CASE("attend_pages: head_dim 8 with group 1 (plan and carve used to differ by 64 bytes)", "[eval][attention]") {
  check_shape<backend::Scalar>(1, 8, 16, ExecContext{});
  // The reported size is what the carve uses: one byte less is rejected, not carved short.
  const Pool pool(1, 1, 16, 8, 20, 1);
  std::vector<float> q(8, 0.5f), out(8), lse(1);
  const std::size_t need = attend_pages_workspace<backend::Scalar>(1, 16, 8);
  std::vector<std::byte> mem(need);
  const Status s = dense_attention<backend::Scalar>(pool.view(), TensorView<const float, 3>::contiguous(q.data(), {1, 1, 8}), 1.0f,
                                                    TensorView<float, 3>::contiguous(out.data(), {1, 1, 8}),
                                                    TensorView<float, 2>::contiguous(lse.data(), {1, 1}), Workspace{mem.data(), need - 1});
  REQUIRE(s.code() == StatusCode::kWorkspaceTooSmall);
}

TEST_CASE("attend_pages: a NaN query gives NaN output and lse, not an empty attention", "[eval][attention][nan]") {
  check_nan_query<backend::Scalar>(ExecContext{});
}

TEST_CASE("page metrics: a negative num_pages or a broken selection is named, not reported as a range", "[eval][errors]") {
  const Pool pool(1, 1, 4, 8, 6, 2);
  auto kv = pool.view();
  kv.num_pages = -3;
  std::vector<float> q(8, 0.1f), out(8, -1.0f), lse(1, -1.0f);
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {1, 1, 8});
  auto o3 = TensorView<float, 3>::contiguous(out.data(), {1, 1, 8});
  auto l2 = TensorView<float, 2>::contiguous(lse.data(), {1, 1});
  std::vector<std::byte> mem(attend_pages_workspace<backend::Scalar>(1, 4, 8));
  const Workspace ws{mem.data(), mem.size()};
  std::vector<std::int32_t> indptr{0, 2}, indices{0, 1}, last{2};
  PageSelection sel{indptr.data(), indices.data(), last.data(), nullptr, 1, 2};
  Status s = selection_attention<backend::Scalar>(kv, qv, sel, 1.0f, o3, l2, ws);
  INFO(s.message());
  REQUIRE_THAT(s.message(), Contains("num_pages is -3, must be >= 0"));
  REQUIRE_THAT(s.message(), !Contains("out of range"));
  kv.num_pages = pool.num_pages;
  sel.last_page_len = nullptr;
  s = selection_attention<backend::Scalar>(kv, qv, sel, 1.0f, o3, l2, ws);
  REQUIRE_THAT(s.message(), Contains("page selection last_page_len is null"));
  sel.last_page_len = last.data();
  sel.indices = nullptr;
  s = selection_attention<backend::Scalar>(kv, qv, sel, 1.0f, o3, l2, ws);
  REQUIRE_THAT(s.message(), Contains("page selection indices is null"));
  REQUIRE(out == std::vector<float>(8, -1.0f));
  // selection_bytes validates the table and the selection before reading them.
  StepBytes sb;
  PageTable bad = kv.table;
  bad.indptr = nullptr;
  sel.indices = indices.data();
  REQUIRE_THAT(selection_bytes(bad, 4, sel, 1, 1, 8, 2, 2, 0, &sb).message(), Contains("page table indptr is null"));
  sel.last_page_len = nullptr;
  REQUIRE_THAT(selection_bytes(kv.table, 4, sel, 1, 1, 8, 2, 2, 0, &sb).message(), Contains("page selection last_page_len is null"));
}
