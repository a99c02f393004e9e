#include <catch2/catch.hpp>

#include <numeric>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(StreamingLLM);

namespace {
std::vector<std::int32_t> kept_row(const StreamingLLM& p, std::int64_t T) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(std::max<std::int64_t>(p.kept_count(T), 0)));
  REQUIRE(p.evict_row(T, std::span<std::int32_t>(out)).is_ok());
  return out;
}
}  // namespace

TEST_CASE("streaming_llm: golden vector of reference §11 (kvpress r=0.5, n_sink=2, T=12)", "[streaming][golden]") {
  // kvpress scores 1 1 0 0 0 0 0 0 1 1 1 1 -> kept {0, 1, 8, 9, 10, 11}
  REQUIRE(kept_row(StreamingLLM(StreamingLLMParams::kvpress(0.5, 2)), 12) == std::vector<std::int32_t>{0, 1, 8, 9, 10, 11});
}

TEST_CASE("streaming_llm: original StartRecentKVCache semantics and evict_for_space", "[streaming]") {
  const StreamingLLM p(StreamingLLMParams::original(4, 8));
  REQUIRE(kept_row(p, 10).size() == 10);  // n <= start + recent: untouched
  REQUIRE(kept_row(p, 12).size() == 12);
  REQUIRE(kept_row(p, 20) == std::vector<std::int32_t>{0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19});
  auto params = StreamingLLMParams::original(4, 8);
  params.num_coming = 3;  // cache[0:4] ++ cache[n - recent + 3 : n]
  REQUIRE(kept_row(StreamingLLM(params), 20) == std::vector<std::int32_t>{0, 1, 2, 3, 15, 16, 17, 18, 19});
  REQUIRE(kept_row(StreamingLLM(params), 9).size() == 9);  // 9 + 3 <= 12: nothing evicted
  // budget below the sinks: the first n tokens
  REQUIRE(kept_row(StreamingLLM(StreamingLLMParams::kvpress(0.9, 4)), 20) == std::vector<std::int32_t>{0});  // int(20 * (1 - 0.9)) == 1
  REQUIRE(kept_row(StreamingLLM(StreamingLLMParams::kvpress(0.5, 0)), 6) == std::vector<std::int32_t>{3, 4, 5});
  REQUIRE(kept_row(StreamingLLM(StreamingLLMParams::kvpress(0.5, 4)), 0).empty());
}

TEST_CASE("streaming_llm: plan matches kvpress's positional mask for many lengths and ratios", "[streaming]") {
  for (int n_sink : {0, 1, 4}) {
    for (double r : {0.1, 0.25, 0.5, 0.8, 0.9}) {
      for (std::int64_t T = n_sink + 1; T < 300; T += 7) {
        // kvpress: s = ones; s[n_sink : n_sink + n_pruned] = 0 ; keep top n_kept.
        const std::int64_t n_kept = kvpress_n_kept(T, r), n_pruned = T - n_kept;
        std::vector<std::int32_t> expect;
        if (n_kept >= n_sink) {
          for (std::int64_t j = 0; j < T; ++j)
            if (j < n_sink || j >= n_sink + n_pruned) expect.push_back(static_cast<std::int32_t>(j));
        } else {
          for (std::int64_t j = 0; j < n_kept; ++j) expect.push_back(static_cast<std::int32_t>(j));
        }
        REQUIRE(kept_row(StreamingLLM(StreamingLLMParams::kvpress(r, n_sink)), T) == expect);
      }
    }
  }
}

TEST_CASE("streaming_llm: batch select writes identical rows for every kv head - bad input", "[streaming]") {
  RandomCase<half> a(4, 2, 50, 64, 4, 1), b(4, 2, 9, 64, 4, 2);
  const StreamingLLM p(StreamingLLMParams::original(2, 6));
  const auto keep = run_evict_batch<backend::Cpu>(p, std::vector{a.input(), b.input()});
  REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 1, 44, 45, 46, 47, 48, 49});
  REQUIRE(keep.row(1) == keep.row(0));
  REQUIRE(keep.row(2) == std::vector<std::int32_t>{0, 1, 3, 4, 5, 6, 7, 8});  // T=9 > start+recent=8
  REQUIRE(run_evict<backend::Scalar>(p, a.paged_input(16)) == run_evict<backend::Scalar>(p, a.input()));

  std::vector<std::int32_t> out(4);
  const std::span<std::int32_t> out4(out.data(), 4);
  REQUIRE_THAT(StreamingLLM(StreamingLLMParams{-1, Budget::tokens(4), 0}).evict_row(10, out4).message(), Contains("sinks is -1"));
  REQUIRE_THAT(StreamingLLM(StreamingLLMParams{2, Budget::tokens(11), 0}).evict_row(10, out4).message(),
               Contains("token budget 11 is larger than the sequence length 10"));
  const Status too_small = StreamingLLM(StreamingLLMParams{2, Budget::tokens(8), 0}).evict_row(10, out4);
  REQUIRE(too_small.code() == StatusCode::kInvalidArgument);
  REQUIRE_THAT(too_small.message(), Contains("output capacity 4 < 8 kept tokens"));
  KeepSetBuffer small(2, 3);
  small.fill_sentinel();
  std::vector<ScoreInput<float, half>> batch{a.input()};
  REQUIRE(p.evict(Context<backend::Scalar>{}, std::span<const ScoreInput<float, half>>(batch), small.view()).code() ==
          StatusCode::kOutputTooSmall);
  REQUIRE(small.untouched());
}

TEST_CASE("streaming_llm: a paged source's page table is validated before use - nothing written", "[streaming][paged]") {
  // Two sequences, page size 4, a pool of 4 pages; the shape alone decides, so the pool is never read.
  std::vector<half> pool(4 * 4 * 2 * 8, from_float<half>(0.0f));
  std::vector<std::int32_t> indptr{0, 2, 3}, indices{0, 1, 2}, last{3, 4};
  const PageStrides st = PageStrides::contiguous(PageLayout::kNHD, 2, 4, 8);
  const auto view = [&] {
    return PagedKVView<const half>{pool.data(), nullptr, st, st, 4, 2, 4, 8, PageTable{indptr.data(), indices.data(), last.data(), 2},
                                   kHost};
  };
  const StreamingLLM p(StreamingLLMParams{1, Budget::tokens(3), 0});
  const auto evict = [&](const PagedKVView<const half>& kv, KeepSetBuffer& keep) {
    const std::vector<ScoreInput<float, half>> batch{{{}, KVSource<half>::from_paged(kv, 0)}, {{}, KVSource<half>::from_paged(kv, 1)}};
    return p.evict(Context<backend::Scalar>{}, std::span<const ScoreInput<float, half>>(batch), keep.view());
  };
  {
    KeepSetBuffer keep(4, 12);
    REQUIRE(evict(view(), keep).is_ok());  // the valid table: seq 0 has 7 tokens, seq 1 has 4
    REQUIRE(keep.row(0) == std::vector<std::int32_t>{0, 5, 6});
    REQUIRE(keep.row(2) == std::vector<std::int32_t>{0, 2, 3});
  }
  const auto expect_rejected = [&](const PagedKVView<const half>& kv, const char* what) {
    KeepSetBuffer keep(4, 64);
    keep.fill_sentinel();
    const Status s = evict(kv, keep);
    INFO(s.message());
    REQUIRE(s.code() == StatusCode::kInvalidArgument);
    REQUIRE_THAT(s.message(), Contains("streaming_llm") && Contains(what));
    REQUIRE(keep.untouched());
  };
  PagedKVView<const half> kv = view();
  kv.table.indptr = nullptr;  // used to crash
  expect_rejected(kv, "indptr is null");
  indptr = {0, 3, 2};  // non-monotonic: used to return ok with a negative page count
  expect_rejected(view(), "not monotonic");
  indptr = {0, 2, 3};
  last = {3, 9};  // last_page_len > page_size: used to return ids past the sequence's tokens
  expect_rejected(view(), "last_page_len[1] is 9");
  last = {3, 4};
  indices = {0, 1, 7};  // a page outside the pool
  expect_rejected(view(), "indices[2] is 7");
}
