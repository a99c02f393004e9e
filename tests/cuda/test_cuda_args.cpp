// Host-only tests of kvpolicy::cuda: compiled by the C++ compiler (the public
// header needs no CUDA headers) and runnable without a GPU. Every bad
// argument must be rejected on the host with a Status that names it, before
// anything is enqueued: the pointers handed in below are never valid device
// memory, so a call that reached the device would report kDeviceError here
// (no driver) or fault on a GPU machine instead of returning kInvalidArgument.
#include <catch2/catch.hpp>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>

#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/ops/contract.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"
#include "kvpolicy/policy/eviction/knorm.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/selection/quest.hpp"

#if defined(__CUDA_RUNTIME_H__) || defined(__CUDA_RUNTIME_API_H__) || defined(__CUDACC__)
#error "kvpolicy/backends/cuda.hpp must not pull in CUDA headers"
#endif

using kvpolicy::Rows;
using kvpolicy::Status;
using kvpolicy::StatusCode;
using kvpolicy::WindowReduce;
using kvpolicy::WindowScoreShape;
using kvpolicy::Workspace;
using kvpolicy::backend::Cuda;

namespace {

// Distinct non-null addresses that are never dereferenced (64-byte aligned so
// workspace alignment is not what a test trips over).
template <class T>
T* fake(std::uintptr_t slot) {
  return reinterpret_cast<T*>(std::uintptr_t{0x1000} * slot);
}

bool mentions(const Status& s, const char* text) { return std::strstr(s.message(), text) != nullptr; }

/// Contract-form ops run as in a policy call: the call's first recorded error mentions `what`.
template <class F>
void require_recorded(F&& op, const char* what) {
  const Cuda::CallScope scope(nullptr, 1);
  op();
  const Status s = scope.end();
  INFO(s.message());
  CHECK_FALSE(s.is_ok());
  CHECK(mentions(s, what));
}

/// A call refused with `code`, its message mentioning `what`.
void require_refused(const Status& s, StatusCode code, const char* what) {
  INFO(s.message());
  CHECK(s.code() == code);
  CHECK(mentions(s, what));
}

WindowScoreShape snapkv_shape() {
  WindowScoreShape s;
  s.group = 4;
  s.window = 8;
  s.head_dim = 64;
  s.kv_len = 100;
  s.num_cols = 92;
  s.q_pos0 = 92;
  s.scale = 0.125f;
  s.reduce = WindowReduce::kMean;
  return s;
}

Workspace big_ws() { return Workspace{fake<void>(64), std::size_t{1} << 40}; }

Status scores_call(const WindowScoreShape& s, const float* q, Rows<float> keys, float* out, Workspace ws) {
  return Cuda::window_scores(s, q, keys, out, ws, nullptr);
}

Rows<float> contiguous_keys(std::int64_t row_stride) { return Rows<float>{fake<const float>(2), row_stride}; }

}  // namespace

TEST_CASE("cuda window_scores: shape errors name the field", "[cuda][args]") {
  const float* q = fake<const float>(1);
  float* out = fake<float>(3);
  auto expect = [&](WindowScoreShape s, const char* field) {
    const Status st = scores_call(s, q, contiguous_keys(s.head_dim > 0 ? s.head_dim : 1), out, big_ws());
    INFO(st.message());
    REQUIRE(st.code() == StatusCode::kInvalidArgument);
    REQUIRE(mentions(st, "cuda window_scores"));
    REQUIRE(mentions(st, field));
  };
  WindowScoreShape s = snapkv_shape();
  s.group = 0;
  expect(s, "group is 0");
  s = snapkv_shape();
  s.window = -1;
  expect(s, "window is -1");
  s = snapkv_shape();
  s.head_dim = 0;
  expect(s, "head_dim is 0");
  s = snapkv_shape();
  s.kv_len = -5;
  s.num_cols = 0;
  expect(s, "kv_len is -5");
  s = snapkv_shape();
  s.num_cols = 101;
  expect(s, "num_cols is 101");
  s = snapkv_shape();
  s.q_pos0 = -1;
  expect(s, "q_pos0 is -1");
  s = snapkv_shape();
  s.reduce = static_cast<WindowReduce>(7);
  expect(s, "reduce");
}

TEST_CASE("cuda window_scores: null pointers and bad key strides", "[cuda][args]") {
  const WindowScoreShape s = snapkv_shape();
  const float* q = fake<const float>(1);
  float* out = fake<float>(3);

  Status st = scores_call(s, nullptr, contiguous_keys(64), out, big_ws());
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "q is null"));

  st = scores_call(s, q, contiguous_keys(64), nullptr, big_ws());
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "out is null"));

  st = scores_call(s, q, Rows<float>{}, out, big_ws());
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "keys.base is null"));

  st = scores_call(s, q, contiguous_keys(63), out, big_ws());
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "keys.row_stride is 63"));

  // Paged keys: page_size must be positive, pages must not alias.
  Rows<kvpolicy::half> paged{fake<const kvpolicy::half>(2), 64, fake<const std::int32_t>(4), 0, 16};
  st = Cuda::window_scores(s, q, paged, out, big_ws(), nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "keys.page_stride is 0"));
  paged.page_stride = 2 * 16 * 64;
  paged.page_size = 0;
  st = Cuda::window_scores(s, q, paged, out, big_ws(), nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "keys.page_size is 0"));

  Rows<kvpolicy::bfloat16> bf{nullptr, 64};
  st = Cuda::window_scores(s, q, bf, out, big_ws(), nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "keys.base is null"));
}

TEST_CASE("cuda window_scores: workspace size is checked before launching", "[cuda][args]") {
  const WindowScoreShape s = snapkv_shape();
  const std::size_t need = Cuda::window_scores_workspace(s);
  // (G*w) x min(T, q_pos0 + w) logits, two floats per row, and per (row, chunk of
  // keys) a float max and a double sum (one chunk at this length), 64-byte blocks,
  // plus alignment slack.
  const std::size_t rows = 32, ld = 100;
  const auto plan = [&](std::size_t cols) {
    return kvpolicy::WorkspacePlan{}.add<float>(rows * cols).add<float>(rows).add<float>(rows).add<float>(rows).add<double>(rows).total();
  };
  REQUIRE(need == plan(ld));

  Status st = scores_call(s, fake<const float>(1), contiguous_keys(64), fake<float>(3), Workspace{});
  REQUIRE(st.code() == StatusCode::kWorkspaceTooSmall);
  REQUIRE(mentions(st, "cuda window_scores"));
  st = scores_call(s, fake<const float>(1), contiguous_keys(64), fake<float>(3), Workspace{fake<void>(64), need - 1});
  REQUIRE(st.code() == StatusCode::kWorkspaceTooSmall);

  // The logits only span the keys the last window query sees.
  WindowScoreShape early = s;
  early.q_pos0 = 10;  // ld = min(100, 10 + 8) = 18
  REQUIRE(Cuda::window_scores_workspace(early) == plan(18));
  // Chunks of 2048 keys: a 5000-key row has 3 per row.
  WindowScoreShape longer = s;
  longer.kv_len = longer.num_cols = 5000;
  longer.q_pos0 = 5000 - longer.window;
  REQUIRE(Cuda::window_scores_workspace(longer) == kvpolicy::WorkspacePlan{}
                                                       .add<float>(rows * 5000)
                                                       .add<float>(rows)
                                                       .add<float>(rows)
                                                       .add<float>(rows * 3)
                                                       .add<double>(rows * 3)
                                                       .total());
}

TEST_CASE("cuda window_scores: empty problems succeed without touching the device", "[cuda][args]") {
  WindowScoreShape s = snapkv_shape();
  s.kv_len = 0;
  s.num_cols = 0;
  s.q_pos0 = 0;
  REQUIRE(Cuda::window_scores_workspace(s) == 0);
  // Nothing to write: no pointer is needed and nothing is enqueued.
  REQUIRE(scores_call(s, nullptr, Rows<float>{}, nullptr, Workspace{}).is_ok());
  s = snapkv_shape();
  s.num_cols = 0;
  REQUIRE(scores_call(s, nullptr, Rows<float>{}, nullptr, Workspace{}).is_ok());
}

TEST_CASE("cuda window_scores: launch limits are reported as unsupported", "[cuda][args]") {
  WindowScoreShape s = snapkv_shape();
  s.group = 70000;
  const Status st = scores_call(s, fake<const float>(1), contiguous_keys(64), fake<float>(3), big_ws());
  REQUIRE(st.code() == StatusCode::kUnsupported);
  REQUIRE(mentions(st, "group=70000"));
}

TEST_CASE("cuda topk: bad arguments", "[cuda][args]") {
  const float* scores = fake<const float>(1);
  std::int32_t* out = fake<std::int32_t>(2);
  REQUIRE(Cuda::topk_workspace(1 << 20) == 0);
  REQUIRE(Cuda::topk_rows_workspace(8, 1 << 20) == 0);

  Status st = Cuda::topk(scores, 10, 11, out, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "cuda topk: k is 11, larger than n=10"));

  st = Cuda::topk(scores, 10, -1, out, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "k is -1"));

  st = Cuda::topk(scores, -3, 0, out, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "n is -3"));

  st = Cuda::topk(nullptr, 10, 3, out, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "scores is null"));

  st = Cuda::topk(scores, 10, 3, nullptr, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "out is null"));

  st = Cuda::topk(scores, std::int64_t{1} << 31, 5, out, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kUnsupported);
  REQUIRE(mentions(st, "int32"));

  // k == 0 (and n == 0) is a valid no-op that needs no pointers.
  REQUIRE(Cuda::topk(nullptr, 10, 0, nullptr, Workspace{}, nullptr).is_ok());
  REQUIRE(Cuda::topk(nullptr, 0, 0, nullptr, Workspace{}, nullptr).is_ok());
}

TEST_CASE("cuda topk_rows: bad strides and row counts", "[cuda][args]") {
  const float* scores = fake<const float>(1);
  std::int32_t* out = fake<std::int32_t>(2);
  Status st = Cuda::topk_rows(scores, 4, 100, 99, 10, out, 10, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "cuda topk_rows: ld is 99, less than n=100"));

  st = Cuda::topk_rows(scores, 4, 100, 100, 10, out, 9, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "out_ld is 9, less than k=10"));

  st = Cuda::topk_rows(scores, -1, 100, 100, 10, out, 10, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "rows is -1"));

  st = Cuda::topk_rows(scores, 2, 5, 5, 6, out, 6, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "k is 6, larger than n=5"));

  // A single row ignores ld / out_ld; zero rows is a no-op.
  REQUIRE(Cuda::topk_rows(nullptr, 0, 100, 0, 10, nullptr, 0, Workspace{}, nullptr).is_ok());
  st = Cuda::topk_rows(nullptr, 1, 100, 0, 10, out, 0, Workspace{}, nullptr);
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(st, "scores is null"));
}

TEST_CASE("cuda device_count: reports the runtime's answer as a Status", "[cuda][device]") {
  REQUIRE(Cuda::device_count(nullptr).code() == StatusCode::kInvalidArgument);
  int n = -1;
  const Status st = Cuda::device_count(&n);
  if (st.is_ok()) {
    REQUIRE(n >= 0);
    REQUIRE(Cuda::device_available() == (n > 0));
  } else {
    INFO(st.message());
    REQUIRE(st.code() == StatusCode::kDeviceError);
    REQUIRE(std::string(st.message()).rfind("cudaGetDeviceCount: ", 0) == 0);
    REQUIRE(n == 0);
    REQUIRE_FALSE(Cuda::device_available());
  }
}

// ---- the ops contract and policies on backend::Cuda (host side only) --------

static_assert(kvpolicy::ScoreOps<Cuda, float> && kvpolicy::ScoreOps<Cuda, kvpolicy::half> && kvpolicy::ScoreOps<Cuda, kvpolicy::bfloat16>,
              "backend::Cuda models the score-op family for every key dtype");
static_assert(kvpolicy::PageOps<Cuda, float, float> && kvpolicy::PageOps<Cuda, kvpolicy::half, kvpolicy::half> &&
                  kvpolicy::PageOps<Cuda, kvpolicy::bfloat16, kvpolicy::bfloat16>,
              "backend::Cuda models the page-op family (Quest) for every key dtype");

namespace {
void pool_fn(void*, std::int64_t, kvpolicy::ParallelBody, void*) {}
}  // namespace

TEST_CASE("cuda policies: a context with several host workers is refused before anything is written", "[cuda][policy]") {
  using namespace kvpolicy;
  // Pointers are never dereferenced: the call must fail on the host first.
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const ScoreInput<float, half> in{
      TensorView<const float, 3>(fake<const float>(1), {8, 64, 64}, {64 * 64, 64, 1}, gpu),
      KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {2, 1000, 64}, {64000, 64, 1}, gpu))};
  std::int32_t indptr[3] = {-7, -7, -7};
  const KeepSet out{indptr, fake<std::int32_t>(3), 2, 1000};
  ExecContext two_workers{pool_fn, nullptr, 2};
  const Context<Cuda> cx{Workspace{fake<void>(4), std::size_t{1} << 30}, two_workers, nullptr};
  const Status s = SnapKV(SnapKVParams::kvpress(0.5)).evict(cx, in, out);
  REQUIRE(s.code() == StatusCode::kUnsupported);
  REQUIRE(mentions(s, "2 workers"));
  REQUIRE((indptr[0] == -7 && indptr[1] == -7 && indptr[2] == -7));
  const Status t = StreamingLLM(StreamingLLMParams{4, Budget::tokens(100), 0}).evict(cx, in, out);
  REQUIRE(t.code() == StatusCode::kUnsupported);
  REQUIRE((indptr[0] == -7 && indptr[1] == -7 && indptr[2] == -7));

  // Host views handed to the device backend are refused by name.
  const Context<Cuda> one{Workspace{fake<void>(4), std::size_t{1} << 30}, {}, nullptr};
  ScoreInput<float, half> host_q = in;
  host_q.queries = TensorView<const float, 3>(fake<const float>(1), {8, 64, 64}, {64 * 64, 64, 1});
  const Status h = SnapKV(SnapKVParams::kvpress(0.5)).evict(one, host_q, out);
  REQUIRE(h.code() == StatusCode::kInvalidArgument);
  REQUIRE(mentions(h, "queries is a host tensor"));
  ScoreInput<float, half> host_k = in;
  host_k.keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {2, 1000, 64}, {64000, 64, 1}));
  REQUIRE(mentions(SnapKV(SnapKVParams::kvpress(0.5)).evict(one, host_k, out), "keys is a host tensor"));
  REQUIRE((indptr[0] == -7 && indptr[1] == -7 && indptr[2] == -7));
}

TEST_CASE("cuda policies: the call scope binds the context's stream and restores the previous one", "[cuda][policy]") {
  REQUIRE(Cuda::current_stream() == nullptr);
  {
    const Cuda::CallScope outer(fake<void>(5), 1);
    REQUIRE(Cuda::current_stream() == fake<void>(5));
    {
      const Cuda::CallScope inner(fake<void>(6), 1);
      REQUIRE(Cuda::current_stream() == fake<void>(6));
      REQUIRE(inner.end().is_ok());
      // An op rejected on the host records its error for the enclosing call.
      Cuda::pool1d(fake<const float>(7), 10, 4, kvpolicy::Pooling::kAvg, fake<float>(8));
      REQUIRE(mentions(inner.end(), "kernel is 4"));
    }
    REQUIRE(Cuda::current_stream() == fake<void>(5));
    REQUIRE(mentions(outer.end(), "kernel is 4"));  // first error wins, kept for the outer call
  }
  REQUIRE(Cuda::current_stream() == nullptr);
}

// Every device-capable policy takes device-tagged views through all of its host checks: with a context of two
// host workers the first thing refused is the worker count (checked after validation, before anything is
// written or enqueued), so a check that wrongly demands host memory would show here as another error. Runs
// without a GPU; the pointers are never dereferenced.
TEST_CASE("cuda policies: device views pass every policy's host checks", "[cuda][policy]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  ExecContext two_workers{pool_fn, nullptr, 2};
  const Context<Cuda> cx{Workspace{fake<void>(4), std::size_t{1} << 34}, two_workers, nullptr};
  auto refused_for_workers = [](const Status& s) {
    INFO(s.message());
    return s.code() == StatusCode::kUnsupported && mentions(s, "2 workers");
  };
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 1000;
  const KVSource<half> keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {Hkv, T, d}, {T * d, d, 1}, gpu));
  std::int32_t indptr[3] = {-7, -7, -7};
  const KeepSet out{indptr, fake<std::int32_t>(3), Hkv, Hkv * T};
  auto untouched = [&] { return indptr[0] == -7 && indptr[1] == -7 && indptr[2] == -7; };

  const ScoreInput<float, half> last_query{TensorView<const float, 3>(fake<const float>(1), {Hq, 1, d}, {d, d, 1}, gpu), keys};
  CHECK(refused_for_workers(TOVA(TOVAParams{Budget::compression_ratio(0.5)}).evict(cx, last_query, out)));
  const ScoreInput<float, half> prompt{TensorView<const float, 3>(fake<const float>(1), {Hq, T, d}, {T * d, d, 1}, gpu), keys};
  CHECK(refused_for_workers(ObservedAttention(ObservedAttentionParams{}).evict(cx, prompt, out)));
  CHECK(refused_for_workers(Knorm(KnormParams{Budget::compression_ratio(0.5)}).evict(cx, ScoreInput<float, half>{{}, keys}, out)));
  const ScoreInput<float, half> window{TensorView<const float, 3>(fake<const float>(1), {Hq, 64, d}, {64 * d, d, 1}, gpu), keys};
  CHECK(refused_for_workers(PyramidKV(PyramidKVParams::kvpress(0.5, 3, 32)).evict(cx, window, out)));
  ScoreInput<float, half> pseudo{TensorView<const float, 3>(fake<const float>(1), {Hq, 8, d}, {8 * d, d, 1}, gpu), keys};
  pseudo.lookahead = 8;
  CHECK(refused_for_workers(LAQ(LAQParams::laq(128)).evict(cx, pseudo, out)));
  CHECK(untouched());

  // Quest: plan, select and on_append with device page ids, metadata, queries and pool; host lengths.
  const std::int32_t P = 16, pages = 63, batch = 1;
  std::int32_t t_indptr[2] = {0, pages}, t_last[1] = {7};
  const PageTable table{t_indptr, fake<const std::int32_t>(5), t_last, batch};
  const DecodeInput<float> step{TensorView<const float, 3>(fake<const float>(1), {batch, Hq, d}, {Hq * d, d, 1}, gpu), table, P, 5};
  const auto meta = PageMetaView<half>::contiguous(fake<half>(6), pages, static_cast<std::int32_t>(Hkv), static_cast<std::int32_t>(d), gpu);
  QuestParams qp;
  qp.budget = Budget::tokens(256);
  const Quest quest(qp);
  Quest::Plan plan;
  const Status ps = quest.plan(cx, step, ProblemShape{.num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d}, plan);
  INFO(ps.message());
  REQUIRE(ps.is_ok());
  std::int32_t s_indptr[9], s_last[8];
  std::fill(s_indptr, s_indptr + 9, -7);
  std::fill(s_last, s_last + 8, -7);
  const PageSelection sel{s_indptr, fake<std::int32_t>(7),         s_last,
                          nullptr,  plan.requirements.output.rows, plan.requirements.output.capacity};
  CHECK(refused_for_workers(quest.select(cx, plan, step, PageMetaView<const half>(meta), sel)));
  CHECK(std::all_of(s_indptr, s_indptr + 9, [](std::int32_t v) { return v == -7; }));
  PagedKVView<const half> pool{fake<const half>(8),
                               nullptr,
                               PageStrides::contiguous(PageLayout::kHND, Hkv, P, d),
                               PageStrides::contiguous(PageLayout::kHND, Hkv, P, d),
                               pages,
                               static_cast<std::int32_t>(Hkv),
                               P,
                               static_cast<std::int32_t>(d),
                               table,
                               gpu};
  const std::int32_t append_len[1] = {1};
  CHECK(refused_for_workers(quest.on_append(cx, AppendInput<half>{pool, append_len}, meta)));
  // Host memory handed to a device call is refused by name.
  const auto host_meta = PageMetaView<half>::contiguous(fake<half>(6), pages, static_cast<std::int32_t>(Hkv), static_cast<std::int32_t>(d));
  CHECK(mentions(quest.on_append(cx, AppendInput<half>{pool, append_len}, host_meta), "metadata is host memory"));

  // The key-reading policies over the same paged pool (device pool and page ids, host offsets: T = 62 * 16 + 7).
  const std::int64_t Tp = (pages - 1) * P + 7;
  const KVSource<half> paged = KVSource<half>::from_paged(pool, 0);
  const ScoreInput<float, half> p_last{TensorView<const float, 3>(fake<const float>(1), {Hq, 1, d}, {d, d, 1}, gpu), paged};
  const ScoreInput<float, half> p_window{TensorView<const float, 3>(fake<const float>(1), {Hq, 64, d}, {64 * d, d, 1}, gpu), paged};
  const ScoreInput<float, half> p_prompt{TensorView<const float, 3>(fake<const float>(1), {Hq, Tp, d}, {Tp * d, d, 1}, gpu), paged};
  std::int32_t p_indptr[3] = {-7, -7, -7};
  const KeepSet p_out{p_indptr, fake<std::int32_t>(3), Hkv, Hkv * Tp};
  CHECK(refused_for_workers(SnapKV(SnapKVParams::kvpress(0.5)).evict(cx, p_window, p_out)));
  CHECK(refused_for_workers(PyramidKV(PyramidKVParams::kvpress(0.5, 3, 32)).evict(cx, p_window, p_out)));
  CHECK(refused_for_workers(TOVA(TOVAParams{Budget::compression_ratio(0.5)}).evict(cx, p_last, p_out)));
  CHECK(refused_for_workers(ObservedAttention(ObservedAttentionParams{}).evict(cx, p_prompt, p_out)));
  CHECK(refused_for_workers(Knorm(KnormParams{Budget::compression_ratio(0.5)}).evict(cx, ScoreInput<float, half>{{}, paged}, p_out)));
  CHECK(refused_for_workers(StreamingLLM(StreamingLLMParams{4, Budget::tokens(100), 0}).evict(cx, p_last, p_out)));
  ScoreInput<float, half> p_pseudo{TensorView<const float, 3>(fake<const float>(1), {Hq, 8, d}, {8 * d, d, 1}, gpu), paged};
  p_pseudo.lookahead = 8;
  CHECK(refused_for_workers(LAQ(LAQParams::laq(128)).evict(cx, p_pseudo, p_out)));
  CHECK(std::all_of(p_indptr, p_indptr + 3, [](std::int32_t v) { return v == -7; }));
  // A pool tagged as host memory is refused by name on the device backend.
  PagedKVView<const half> host_pool = pool;
  host_pool.device = Device{};
  const ScoreInput<float, half> h_window{p_window.queries, KVSource<half>::from_paged(host_pool, 0)};
  CHECK(mentions(SnapKV(SnapKVParams::kvpress(0.5)).evict(cx, h_window, p_out), "keys is a paged pool in host memory"));
  CHECK(std::all_of(p_indptr, p_indptr + 3, [](std::int32_t v) { return v == -7; }));
}

TEST_CASE("cuda policies: the workspace a policy asks for covers window_scores at its last query block", "[cuda][policy]") {
  // H2O and ObservedAttention score the prompt's queries in blocks of 64 at growing causal
  // offsets; Cuda's window_scores scratch grows with the offset (the logits tile holds
  // q_pos0 + window columns), so the request must cover the last block (q_pos0 = T - 64).
  // The H200 check found both sized for the first block.
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 200, G = Hq / Hkv, B = 64;
  const kvpolicy::ProblemShape shape{Hq, Hkv, d, T, T};
  const std::size_t last_block = Cuda::window_scores_workspace(WindowScoreShape{G, B, d, T, T, T - B, 1.0f, WindowReduce::kSum});
  REQUIRE(last_block > Cuda::window_scores_workspace(WindowScoreShape{G, B, d, T, T, 0, 1.0f, WindowReduce::kSum}));
  const auto h2o = kvpolicy::H2O(kvpolicy::H2OParams::original(24, 40)).requirements(kvpolicy::Context<Cuda>{}, shape);
  REQUIRE(h2o.status.is_ok());
  CHECK(h2o.workspace_bytes >= last_block);
  const auto obs = kvpolicy::ObservedAttention(kvpolicy::ObservedAttentionParams{}).requirements(kvpolicy::Context<Cuda>{}, shape);
  REQUIRE(obs.status.is_ok());
  CHECK(obs.workspace_bytes >= last_block);
}

TEST_CASE("cuda batched ops: bad arguments are recorded for the call, nothing is launched", "[cuda][args]") {
  // Each check runs on the host before any launch, so no device is needed.
  require_recorded([] { Cuda::gather_page_rows(nullptr, nullptr, 0, 2, 3, -1, fake<std::int32_t>(1), nullptr, 3); },
                   "pages or dst is null");
  require_recorded([] { Cuda::gather_page_rows(fake<const std::int32_t>(1), nullptr, 0, 2, 3, 5, fake<std::int32_t>(2), nullptr, 3); },
                   "rows would overlap");  // 3 ids + the last page = 4 per row > dst_ld 3
  require_recorded(
      [] {
        Cuda::gather_page_rows(fake<const std::int32_t>(1), fake<const std::int32_t>(3), 2, 2, 3, -1, fake<std::int32_t>(2), nullptr, 4);
      },
      "rows would overlap");  // sel_ld 2 < k 3
  require_recorded([] { Cuda::iota_rows(nullptr, 4, 2, 0, 4); }, "dst is null");
  require_recorded([] { Cuda::iota_rows(fake<std::int32_t>(1), 3, 2, 0, 4); }, "dst_ld 3 < n 4");
  require_recorded([] { Cuda::pool1d_rows(fake<const float>(1), 2, 10, 8, 5, kvpolicy::Pooling::kAvg, fake<float>(2)); }, "ld 8 < n 10");
  require_recorded([] { Cuda::pool1d_rows(fake<const float>(1), 2, 10, 10, 4, kvpolicy::Pooling::kAvg, fake<float>(2)); }, "kernel is 4");
  require_recorded([] { Cuda::pool1d_rows(nullptr, 2, 10, 10, 5, kvpolicy::Pooling::kAvg, fake<float>(2)); }, "in or out is null");
  require_recorded([] { Cuda::topk_rows_strided(fake<const float>(1), 5, 2, 10, 3, fake<std::int32_t>(2), 3, Workspace{}); },
                   "ld is 5, less than n=10");
  require_recorded([] { Cuda::topk_rows_strided(fake<const float>(1), 10, 2, 10, 11, fake<std::int32_t>(2), 11, Workspace{}); },
                   "k is 11, larger than n=10");
  // Negative counts are errors, not empty work.
  require_recorded([] { Cuda::gather_page_rows(fake<const std::int32_t>(1), nullptr, 0, 2, -1, 5, fake<std::int32_t>(2), nullptr, 3); },
                   "k=-1");
  require_recorded([] { Cuda::iota_rows(fake<std::int32_t>(1), 4, -2, 0, 4); }, "rows=-2");
  require_recorded([] { Cuda::pool1d_rows(fake<const float>(1), -1, 10, 10, 5, kvpolicy::Pooling::kAvg, fake<float>(2)); }, "rows=-1");
  require_recorded([] { Cuda::topk_rows_strided(fake<const float>(1), 10, 2, 10, -3, fake<std::int32_t>(2), 3, Workspace{}); }, "k is -3");
  // Empty work is no error and enqueues nothing.
  const Cuda::CallScope scope(nullptr, 1);
  Cuda::gather_page_rows(nullptr, nullptr, 0, 0, 3, -1, nullptr, nullptr, 3);
  Cuda::iota_rows(nullptr, 0, 2, 0, 0);
  Cuda::pool1d_rows(nullptr, 0, 10, 10, 5, kvpolicy::Pooling::kAvg, nullptr);
  Cuda::topk_rows_strided(nullptr, 10, 2, 10, 0, nullptr, 0, Workspace{});
  CHECK(scope.end().is_ok());
}

TEST_CASE("cuda adakv_keep: bad arguments are recorded for the call, nothing is launched", "[cuda][args][adakv]") {
  kvpolicy::AdaKVKeepSpec kv;  // kvpress: 2 safe per row, 6 more over the layer
  kv.row_k = 2;
  kv.layer_k = 6;
  kv.base = 2;
  const std::int64_t rows = 4, T = 100;
  const std::size_t need = Cuda::adakv_keep_workspace(rows, T);
  REQUIRE(need >= rows * T * sizeof(float) + (rows + 1) * sizeof(std::uint64_t));
  const Workspace ws{fake<void>(64), need};
  auto call = [&](const float* s, std::int64_t r, std::int64_t t, const kvpolicy::AdaKVKeepSpec& sp, std::int64_t* c, std::int32_t* ip,
                  std::int32_t* ids, Workspace w) { return [=] { Cuda::adakv_keep(s, r, t, sp, c, ip, ids, w); }; };
  const float* S = fake<const float>(1);
  std::int64_t* C = fake<std::int64_t>(2);
  std::int32_t* I = fake<std::int32_t>(3);
  std::int32_t* X = fake<std::int32_t>(4);
  require_recorded(call(S, -1, T, kv, C, I, X, ws), "rows=-1");
  require_recorded(call(S, rows, -5, kv, C, I, X, ws), "T=-5");
  require_recorded(call(S, 70000, T, kv, C, I, X, ws), "70000 rows, at most 65535");
  require_recorded(call(S, 30000, 100000, kv, C, I, X, ws), "exceed the int32 range");
  require_recorded(call(nullptr, rows, T, kv, C, I, X, ws), "is null");
  require_recorded(call(S, rows, T, kv, nullptr, I, X, ws), "is null");
  require_recorded(call(S, rows, T, kv, C, nullptr, X, ws), "is null");
  require_recorded(call(S, rows, T, kv, C, I, nullptr, ws), "is null");
  kvpolicy::AdaKVKeepSpec bad = kv;
  bad.layer_k = rows * T + 1;
  require_recorded(call(S, rows, T, bad, C, I, X, ws), "layer_k=401");
  bad = kv;
  bad.row_k = T + 1;
  require_recorded(call(S, rows, T, bad, C, I, X, ws), "row_k=101");
  require_recorded(call(S, rows, T, kv, C, I, X, Workspace{fake<void>(64), need - 1}), "workspace");
  // keep_all reads no scores: a null score map is accepted; no rows is empty work.
  const Cuda::CallScope scope(nullptr, 1);
  Cuda::adakv_keep(nullptr, 0, T, kv, nullptr, nullptr, nullptr, Workspace{});
  CHECK(scope.end().is_ok());
}

TEST_CASE("cuda Ada-KV: host checks before anything is enqueued (views, sharded layers, workspace, output)", "[cuda][policy][adakv]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 1000;
  const AdaKV<SnapKV> policy(AdaKVParams::kvpress(0.5), SnapKV(adakv_scoring()));
  const ProblemShape shape{Hq, Hkv, d, T, 32};
  const Requirements req = policy.requirements(Context<Cuda>{}, shape);
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  // The device op's workspace is in the request (not the host allocation's sort buffers).
  REQUIRE(req.workspace_bytes >= Cuda::adakv_keep_workspace(Hkv, T));
  const KVSource<half> keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {Hkv, T, d}, {T * d, d, 1}, gpu));
  const ScoreInput<float, half> window{TensorView<const float, 3>(fake<const float>(1), {Hq, 32, d}, {32 * d, d, 1}, gpu), keys};
  const ScoreInput<float, half> host_q{TensorView<const float, 3>(fake<const float>(1), {Hq, 32, d}, {32 * d, d, 1}), keys};
  // indptr is device memory for Ada-KV on Cuda: a fake pointer, never dereferenced by the host on a refused call.
  const KeepSet out{fake<std::int32_t>(5), fake<std::int32_t>(3), req.output.rows, req.output.capacity};
  const Context<Cuda> cx{Workspace{fake<void>(4), req.workspace_bytes}};
  require_refused(policy.evict(cx, host_q, out), StatusCode::kInvalidArgument, "host tensor");
  require_refused(policy.evict(Context<Cuda>{Workspace{fake<void>(4), req.workspace_bytes - 1}}, window, out),
                  StatusCode::kWorkspaceTooSmall, "workspace");
  require_refused(policy.evict(cx, window, KeepSet{fake<std::int32_t>(5), fake<std::int32_t>(3), req.output.rows, req.output.capacity - 1}),
                  StatusCode::kOutputTooSmall, "capacity");
  ExecContext two_workers{pool_fn, nullptr, 2};
  require_refused(policy.evict(Context<Cuda>{Workspace{fake<void>(4), std::size_t{1} << 34}, two_workers}, window, out),
                  StatusCode::kUnsupported, "2 workers");
  const Collective comm{0, 2, nullptr, [](void*, std::int64_t*, std::size_t) noexcept { return Status::ok(); },
                        [](void*, const void*, std::size_t, void*) noexcept { return Status::ok(); }};
  const HeadShard shard{0, 2 * Hkv, 2 * Hq, &comm};
  ExecContext sharded;
  sharded.shard = &shard;
  require_refused(policy.requirements(Context<Cuda>{{}, sharded}, shape).status, StatusCode::kUnsupported, "sharded");
  require_refused(policy.evict(Context<Cuda>{Workspace{fake<void>(4), req.workspace_bytes}, sharded}, window, out),
                  StatusCode::kUnsupported, "sharded");
}

TEST_CASE("cuda Expected Attention: host checks before anything is enqueued", "[cuda][policy][expected_attention]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t Hq = 8, Hkv = 2, d = 64, T = 1000, q_len = 200;
  const ExpectedAttention policy(ExpectedAttentionParams::kvpress(0.5));
  const Requirements req = policy.requirements(Context<Cuda>{}, ProblemShape{Hq, Hkv, d, T, q_len});
  INFO(req.status.message());
  REQUIRE(req.status.is_ok());
  REQUIRE(req.workspace_bytes >= Cuda::expected_softmax_workspace(T));
  ExpectedAttentionInput<float, half> in;
  in.queries = TensorView<const float, 3>(fake<const float>(1), {Hq, q_len, d}, {q_len * d, d, 1}, gpu);
  in.keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {Hkv, T, d}, {T * d, d, 1}, gpu));
  in.values = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(3), {Hkv, T, d}, {T * d, d, 1}, gpu));
  std::int32_t indptr[3] = {-7, -7, -7};
  const KeepSet out{indptr, fake<std::int32_t>(4), Hkv, req.output.capacity};
  const auto refused = [&](const Status& s, StatusCode code, const char* what) {
    require_refused(s, code, what);
    CHECK((indptr[0] == -7 && indptr[1] == -7 && indptr[2] == -7));
  };
  ExecContext two_workers{pool_fn, nullptr, 2};
  refused(policy.evict(Context<Cuda>{Workspace{fake<void>(5), std::size_t{1} << 34}, two_workers}, in, out), StatusCode::kUnsupported,
          "2 workers");
  refused(policy.evict(Context<Cuda>{Workspace{fake<void>(5), req.workspace_bytes - 1}}, in, out), StatusCode::kWorkspaceTooSmall,
          "workspace");
  ExpectedAttentionInput<float, half> host_q = in;
  host_q.queries = TensorView<const float, 3>(fake<const float>(1), {Hq, q_len, d}, {q_len * d, d, 1});
  refused(policy.evict(Context<Cuda>{Workspace{fake<void>(5), req.workspace_bytes}}, host_q, out), StatusCode::kInvalidArgument,
          "host tensor");
  ExpectedAttentionInput<float, half> stats = in;
  stats.queries = {};
  stats.query_mean = TensorView<const float, 2>(fake<const float>(6), {Hq, d}, {d, 1}, gpu);
  stats.query_cov = TensorView<const float, 3>(fake<const float>(7), {Hq, d, d}, {d * d, d, 1}, gpu);
  refused(policy.evict(Context<Cuda>{Workspace{fake<void>(5), req.workspace_bytes}}, stats, out), StatusCode::kUnsupported,
          "precomputed statistics");
  const std::int64_t big = 512;
  ExpectedAttentionInput<float, half> wide;
  wide.queries = TensorView<const float, 3>(fake<const float>(1), {Hq, q_len, big}, {q_len * big, big, 1}, gpu);
  wide.keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {Hkv, T, big}, {T * big, big, 1}, gpu));
  wide.values = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(3), {Hkv, T, big}, {T * big, big, 1}, gpu));
  refused(policy.evict(Context<Cuda>{Workspace{fake<void>(5), std::size_t{1} << 34}}, wide, out), StatusCode::kUnsupported, "at most 256");
}

TEST_CASE("cuda Fp8Quant: host checks before anything is enqueued", "[cuda][policy][fp8]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t H = 2, T = 10, d = 64;
  const Fp8Quant policy(Fp8QuantParams{Fp8Format::kE4M3, Fp8Scale::kPerHead, 1.0f});
  const float bad_scales[2] = {1.0f, -2.0f};
  Fp8Quant::State st{std::span<const float>(bad_scales, 2)};
  QuantizedKV q{policy.layout(), TensorView<std::uint8_t, 3>(fake<std::uint8_t>(1), {H, T, d}, {T * d, d, 1}, gpu), {}, T};
  const auto rows = TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d, d, 1}, gpu);
  const Context<Cuda> cx{};
  require_refused(policy.quantize(cx, rows, st, q), StatusCode::kInvalidArgument, "per_head scale of head 1");
  const float scales[2] = {1.0f, 2.0f};
  st.head_scales = std::span<const float>(scales, 2);
  require_refused(policy.quantize(cx, TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d, d, 1}), st, q),
                  StatusCode::kInvalidArgument, "rows is a host tensor");
  require_refused(policy.quantize(cx, TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d * 2, d * 2, 2}, gpu), st, q),
                  StatusCode::kInvalidArgument, "channel stride 2");
  QuantizedKV host_codes = q;
  host_codes.codes = TensorView<std::uint8_t, 3>(fake<std::uint8_t>(1), {H, T, d}, {T * d, d, 1});
  require_refused(policy.quantize(cx, rows, st, host_codes), StatusCode::kInvalidArgument, "codes is a host tensor");
  ExecContext two_workers{pool_fn, nullptr, 2};
  require_refused(policy.quantize(Context<Cuda>{{}, two_workers}, rows, st, q), StatusCode::kUnsupported, "2 workers");
  require_refused(policy.dequantize(cx, q, TensorView<half, 3>(fake<half>(3), {H, T, d}, {T * d, d, 1}), st), StatusCode::kInvalidArgument,
                  "out is a host tensor");
  // The ops record bad arguments and enqueue nothing.
  const Cuda::CallScope scope(nullptr, 1);
  Cuda::fp8_quantize_rows(Fp8Format::kE4M3, static_cast<const float*>(nullptr), 3, 64, 64, 1.0f, fake<std::uint8_t>(1), 64);
  const Status s = scope.end();
  CHECK(mentions(s, "input or output is null"));
}

static_assert(kvpolicy::QuantOps<Cuda, float> && kvpolicy::QuantOps<Cuda, kvpolicy::half> && kvpolicy::QuantOps<Cuda, kvpolicy::bfloat16>,
              "backend::Cuda models the quantization-op family");

TEST_CASE("cuda GgmlQuant / Int4Quant: host checks before anything is enqueued", "[cuda][policy][ggml][int4]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t H = 2, T = 10, d = 64;
  const auto rows = TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d, d, 1}, gpu);
  const Context<Cuda> cx{};
  ExecContext two_workers{pool_fn, nullptr, 2};
  const auto check_policy = [&](const auto& policy) {
    using P = std::decay_t<decltype(policy)>;
    typename P::State st;
    const std::int64_t rb = policy.row_bytes(d);
    QuantizedKV q{policy.layout(), TensorView<std::uint8_t, 3>(fake<std::uint8_t>(1), {H, T, rb}, {T * rb, rb, 1}, gpu), {}, T};
    require_refused(policy.quantize(cx, TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d, d, 1}), st, q),
                    StatusCode::kInvalidArgument, "rows is a host tensor");
    require_refused(policy.quantize(cx, TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d * 2, d * 2, 2}, gpu), st, q),
                    StatusCode::kInvalidArgument, "channel stride 2");
    QuantizedKV host_codes = q;
    host_codes.codes = TensorView<std::uint8_t, 3>(fake<std::uint8_t>(1), {H, T, rb}, {T * rb, rb, 1});
    require_refused(policy.quantize(cx, rows, st, host_codes), StatusCode::kInvalidArgument, "codes is a host tensor");
    QuantizedKV short_codes = q;
    short_codes.codes = TensorView<std::uint8_t, 3>(fake<std::uint8_t>(1), {H, T, rb - 1}, {T * rb, rb, 1}, gpu);
    require_refused(policy.quantize(cx, rows, st, short_codes), StatusCode::kInvalidArgument, "codes is (2, 10,");
    require_refused(policy.quantize(Context<Cuda>{{}, two_workers}, rows, st, q), StatusCode::kUnsupported, "2 workers");
    require_refused(policy.dequantize(cx, q, TensorView<half, 3>(fake<half>(3), {H, T, d}, {T * d, d, 1})), StatusCode::kInvalidArgument,
                    "out is a host tensor");
  };
  check_policy(GgmlQuant(GgmlQuantParams{GgmlType::kQ4_0, HadamardMode::kLlamaCpp, 64, QuantRole::kKeys}));
  check_policy(Int4Quant(Int4QuantParams{4, HadamardMode::kBlock, 32, QuantRole::kKeys}));
  // The ops record bad arguments and enqueue nothing.
  const auto op_refuses = [](auto&& call, const char* what) {
    const Cuda::CallScope scope(nullptr, 1);
    call();
    const Status s = scope.end();
    INFO(s.message());
    CHECK(mentions(s, what));
  };
  op_refuses(
      [] {
        Cuda::encode_token_rows(TokenRowCodec::int_tokens(4), static_cast<const float*>(nullptr), 3, 64, 64, fake<std::uint8_t>(1), 40);
      },
      "input or output is null");
  op_refuses(
      [] {
        Cuda::encode_token_rows(TokenRowCodec::ggml_blocks(GgmlType::kQ8_0), fake<const float>(1), 3, 48, 48, fake<std::uint8_t>(1), 51);
      },
      "multiple of the ggml block");
  op_refuses(
      [] { Cuda::decode_token_rows(TokenRowCodec::int_tokens(4, 64), fake<const std::uint8_t>(1), 3, 72, 8192, fake<float>(2), 8192); },
      "<= 4096");
  op_refuses([] { Cuda::decode_token_rows(TokenRowCodec::int_tokens(6), fake<const std::uint8_t>(1), 3, 72, 64, fake<half>(2), 64); },
             "bits must be 4 or 8");
  op_refuses([] { Cuda::encode_token_rows(TokenRowCodec::int_tokens(8), fake<const float>(1), -1, 64, 64, fake<std::uint8_t>(1), 72); },
             "rows=-1");
}

TEST_CASE("cuda paged quantized pool: host checks before anything is enqueued", "[cuda][policy][quantized]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  constexpr std::int32_t H = 2, P = 16, pages = 8;
  constexpr std::int64_t d = 64;
  const GgmlQuant q(GgmlQuantParams{GgmlType::kQ4_0});
  const std::int64_t rb = q.row_bytes(d);
  const std::int32_t indptr[3] = {0, 3, 5}, last[2] = {8, 13};
  const PageTable table{indptr, fake<const std::int32_t>(9), last, 2};  // the ids are device memory: never read on the host
  const PageStrides cs = PageStrides::contiguous(PageLayout::kNHD, H, P, rb);
  const PagedKVView<std::uint8_t> pool{
      fake<std::uint8_t>(1), fake<std::uint8_t>(2), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), table, gpu};
  PagedKVView<std::uint8_t> host_pool = pool;
  host_pool.device = {};
  const auto rows = TensorView<const float, 3>(fake<const float>(3), {H, 40, d}, {40 * d, d, 1}, gpu);
  const std::size_t aw = quantize_paged_append_workspace<Cuda>(q, P, d, H);
  REQUIRE(aw >= static_cast<std::size_t>(H * 1024 * rb));
  const Context<Cuda> cx{Workspace{fake<std::byte>(4), aw}};
  ExecContext two_workers{pool_fn, nullptr, 2};
  require_refused(quantize_paged_append(cx, q, host_pool, 0, rows, false), StatusCode::kInvalidArgument, "the code pool is host memory");
  require_refused(
      quantize_paged_append(cx, q, pool, 0, TensorView<const float, 3>(fake<const float>(3), {H, 40, d}, {40 * d, d, 1}), false),
      StatusCode::kInvalidArgument, "rows is a host tensor");
  require_refused(quantize_paged_append(Context<Cuda>{Workspace{fake<std::byte>(4), aw - 1}}, q, pool, 0, rows, false),
                  StatusCode::kWorkspaceTooSmall, "workspace");
  require_refused(
      quantize_paged_append(cx, q, pool, 0, TensorView<const float, 3>(fake<const float>(3), {H, 41, d}, {41 * d, d, 1}, gpu), false),
      StatusCode::kInvalidArgument, "41 rows for a sequence of 40 tokens");
  require_refused(quantize_paged_append(Context<Cuda>{Workspace{fake<std::byte>(4), aw}, two_workers}, q, pool, 0, rows, false),
                  StatusCode::kUnsupported, "2 workers");
  const PagedKVView<const std::uint8_t> cpool = pool;
  const std::size_t mw = quantized_page_meta_workspace<Cuda>(q, P, d, H);
  const auto meta = PageMetaView<float>::contiguous(fake<float>(5), pages, H, static_cast<std::int32_t>(d), gpu);
  require_refused(quantized_page_meta_append(Context<Cuda>{Workspace{fake<std::byte>(4), mw}}, q, cpool, d, nullptr,
                                             PageMetaView<float>::contiguous(fake<float>(5), pages, H, static_cast<std::int32_t>(d))),
                  StatusCode::kInvalidArgument, "metadata is host memory");
  require_refused(quantized_page_meta_append(Context<Cuda>{Workspace{fake<std::byte>(4), mw - 1}}, q, cpool, d, nullptr, meta),
                  StatusCode::kWorkspaceTooSmall, "workspace");
  const std::int32_t too_many[2] = {41, 0};
  require_refused(quantized_page_meta_append(Context<Cuda>{Workspace{fake<std::byte>(4), mw}}, q, cpool, d, too_many, meta),
                  StatusCode::kInvalidArgument, "append_len[0] is 41");
  const std::size_t tw = quantized_paged_attention_workspace<Cuda>(q, P, d, 4);
  const auto attend = [&](Workspace ws, std::int32_t h, const PagedKVView<const std::uint8_t>& p) {
    return quantized_paged_decode_attention(Context<Cuda>{ws}, q, q, p, h, fake<const std::int32_t>(9), 40, fake<const float>(6), 4, d,
                                            0.125f, fake<float>(7), fake<float>(8));
  };
  require_refused(attend(Workspace{fake<std::byte>(4), tw - 1}, 0, cpool), StatusCode::kWorkspaceTooSmall, "workspace");
  require_refused(attend(Workspace{fake<std::byte>(4), tw}, 2, cpool), StatusCode::kInvalidArgument, "kv head 2 out of range");
  require_refused(attend(Workspace{fake<std::byte>(4), tw}, 0, host_pool), StatusCode::kInvalidArgument, "the code pool is host memory");
  const GgmlQuant q8(GgmlQuantParams{GgmlType::kQ8_0});
  require_refused(
      quantized_paged_decode_attention(Context<Cuda>{Workspace{fake<std::byte>(4), tw}}, q, q8, cpool, 0, fake<const std::int32_t>(9), 40,
                                       fake<const float>(6), 4, d, 0.125f, fake<float>(7), nullptr),
      StatusCode::kInvalidArgument, "differ from the keys'");
}

TEST_CASE("cuda KiviQuant: host checks before anything is enqueued", "[cuda][policy][kivi]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t H = 2, T = 64, d = 64, R = 32;
  const KiviQuant policy(KiviQuantParams{QuantRole::kKeys, 2, 32, static_cast<std::int32_t>(R)});
  const std::int64_t cb = policy.codes_row_bytes(d), sb = policy.scales_row_bytes(d), rows = policy.code_rows(T);
  QuantizedKV q{policy.layout(), TensorView<std::uint8_t, 3>(fake<std::uint8_t>(1), {H, rows, cb}, {rows * cb, cb, 1}, gpu),
                TensorView<std::uint8_t, 3>(fake<std::uint8_t>(2), {H, rows, sb}, {rows * sb, sb, 1}, gpu), 0};
  const auto x = TensorView<const half, 3>(fake<const half>(3), {H, T, d}, {T * d, d, 1}, gpu);
  KiviState none;
  const Context<Cuda> cx{};
  require_refused(policy.quantize(cx, TensorView<const half, 3>(fake<const half>(3), {H, T, d}, {T * d, d, 1}), none, q),
                  StatusCode::kInvalidArgument, "rows is a host tensor");
  QuantizedKV host_scales = q;
  host_scales.scales = TensorView<std::uint8_t, 3>(fake<std::uint8_t>(2), {H, rows, sb}, {rows * sb, sb, 1});
  require_refused(policy.quantize(cx, x, none, host_scales), StatusCode::kInvalidArgument, "scales is a host tensor");
  KiviState host_res{TensorView<half, 3>(fake<half>(4), {H, R, d}, {R * d, d, 1}), 0};
  require_refused(policy.append(cx, x, host_res, q), StatusCode::kInvalidArgument, "state residual is a host tensor");
  KiviState long_res{TensorView<half, 3>(fake<half>(4), {H, R, d}, {R * d, d, 1}, gpu), R};
  require_refused(policy.append(cx, x, long_res, q), StatusCode::kInvalidArgument, "residual_len is 32");
  ExecContext two_workers{pool_fn, nullptr, 2};
  require_refused(policy.quantize(Context<Cuda>{{}, two_workers}, x, none, q), StatusCode::kUnsupported, "2 workers");
  // The ops record bad arguments and enqueue nothing.
  const auto op_refuses = [](auto&& call, const char* what) {
    const Cuda::CallScope scope(nullptr, 1);
    call();
    const Status s = scope.end();
    INFO(s.message());
    CHECK(mentions(s, what));
  };
  op_refuses(
      [] {
        Cuda::kivi_encode_tokens(kivi::Codec{true, 2, 512}, static_cast<const half*>(nullptr), 0, 0, fake<const float>(1), 64, 512, 64,
                                 fake<std::uint8_t>(2), 64, fake<std::uint8_t>(3), 64);
      },
      "at most 256");
  op_refuses(
      [] {
        Cuda::kivi_encode_tokens(kivi::Codec{false, 3, 32}, static_cast<const half*>(nullptr), 0, 0, fake<const float>(1), 64, 4, 64,
                                 fake<std::uint8_t>(2), 64, fake<std::uint8_t>(3), 64);
      },
      "not a KIVI values layout");
  op_refuses(
      [] {
        Cuda::kivi_encode_tokens(kivi::Codec{false, 2, 32}, static_cast<const half*>(nullptr), 0, 4, fake<const float>(1), 64, 8, 64,
                                 fake<std::uint8_t>(2), 64, fake<std::uint8_t>(3), 64);
      },
      "a needed pointer is null");
  op_refuses(
      [] {
        Cuda::kivi_decode_tokens(kivi::Codec{true, 2, 32}, fake<const std::uint8_t>(1), 64, fake<const std::uint8_t>(2), 64, 40, 64,
                                 fake<float>(3), 64);
      },
      "not a KIVI keys layout");
  op_refuses([] { Cuda::kivi_update_residual(fake<half>(1), 64, 4, 9, fake<const float>(2), 64, 2, 64); }, "nq <= res_len + n");
}

TEST_CASE("cuda rank_tiers: bad arguments are recorded, nothing enqueued", "[cuda][mixed]") {
  using namespace kvpolicy;
  const auto refuses = [](auto&& call, const char* what) {
    const Cuda::CallScope scope(nullptr, 1);
    call();
    const Status s = scope.end();
    INFO(s.message());
    CHECK(mentions(s, what));
  };
  refuses([] { Cuda::rank_tiers(fake<const float>(1), 2, 10, 10, 4, 5, fake<std::int32_t>(2), fake<std::uint8_t>(3), 4, {}); },
          "0 <= n_full <= n_keep <= n");
  refuses([] { Cuda::rank_tiers(fake<const float>(1), 2, 10, 8, 4, 2, fake<std::int32_t>(2), fake<std::uint8_t>(3), 4, {}); }, "ld >= n");
  refuses([] { Cuda::rank_tiers(nullptr, 2, 10, 10, 4, 2, fake<std::int32_t>(2), fake<std::uint8_t>(3), 4, {}); }, "is null");
  CHECK(Cuda::rank_tiers_workspace(1000) == 0);
}

static_assert(kvpolicy::MergeOps<Cuda, float> && kvpolicy::MergeOps<Cuda, kvpolicy::half> && kvpolicy::MergeOps<Cuda, kvpolicy::bfloat16>,
              "backend::Cuda models the merge op");

TEST_CASE("cuda merge_head: bad arguments are recorded, nothing enqueued", "[cuda][args][merging]") {
  using kvpolicy::MergeRule;
  const Rows<float> rows{fake<const float>(1), 16, nullptr, 0, 0};
  const Workspace ws{fake<void>(9), Cuda::merge_head_workspace(10, 16)};
  require_recorded(
      [&] {
        Cuda::merge_head(MergeRule{}, rows, rows, fake<const std::int32_t>(2), 11, 10, 16, nullptr, fake<std::int32_t>(3),
                         fake<std::int32_t>(4), fake<float>(5), nullptr, 0, nullptr, 0, ws);
      },
      "need 0 <= C <= T");
  require_recorded(
      [&] {
        Cuda::merge_head(MergeRule{}, rows, rows, fake<const std::int32_t>(2), 4, 10, 16, nullptr, nullptr, fake<std::int32_t>(4),
                         fake<float>(5), nullptr, 0, nullptr, 0, ws);
      },
      "dst, src or weight is null");
  require_recorded(
      [&] {
        Cuda::merge_head(MergeRule{}, rows, rows, nullptr, 4, 10, 16, nullptr, fake<std::int32_t>(3), fake<std::int32_t>(4), fake<float>(5),
                         nullptr, 0, nullptr, 0, ws);
      },
      "kept, keys or values is null");
  MergeRule state_rule;
  state_rule.beta = kvpolicy::MergeBeta::kStateWeight;
  require_recorded(
      [&] {
        Cuda::merge_head(state_rule, rows, rows, fake<const std::int32_t>(2), 4, 10, 16, nullptr, fake<std::int32_t>(3),
                         fake<std::int32_t>(4), fake<float>(5), nullptr, 0, nullptr, 0, ws);
      },
      "w is null");
  require_recorded(
      [&] {
        Cuda::merge_head(MergeRule{}, rows, rows, fake<const std::int32_t>(2), 4, 10, 16, nullptr, fake<std::int32_t>(3),
                         fake<std::int32_t>(4), fake<float>(5), nullptr, 0, nullptr, 0, Workspace{fake<void>(9), 64});
      },
      "workspace is 64 bytes");
}

TEST_CASE("cuda merging policies: host checks before anything is enqueued", "[cuda][policy][merging]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t H = 2, T = 10, d = 16;
  MergeInput<half> in;
  in.keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(1), {H, T, d}, {T * d, d, 1}, gpu));
  in.values = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(2), {H, T, d}, {T * d, d, 1}, gpu));
  std::int32_t kindptr[3] = {0, 4, 8}, pindptr[3] = {-7, -7, -7};
  const KeepSet keep{kindptr, fake<std::int32_t>(3), H, 8};
  MergePlan plan{pindptr, fake<std::int32_t>(4), fake<std::int32_t>(5), fake<float>(6), H, H * T};
  plan.merged_values = TensorView<float, 2>(fake<float>(7), {H * T, d}, {d, 1}, gpu);
  plan.slots_per_row = T;
  const std::size_t need = Cuda::merge_head_workspace(T, d);
  const Requirements r = KvpressMerging{}.requirements(Context<Cuda>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(r.status.is_ok());
  CHECK(r.workspace_bytes == need);
  const Context<Cuda> small{Workspace{fake<void>(8), need - 1}};
  require_refused(KvpressMerging{}.merge(small, in, keep, plan), StatusCode::kWorkspaceTooSmall, "workspace");
  MergeInput<half> host_keys = in;
  host_keys.keys = KVSource<half>::from(TensorView<const half, 3>(fake<const half>(1), {H, T, d}, {T * d, d, 1}));
  const Context<Cuda> cx{Workspace{fake<void>(8), need}};
  require_refused(KvpressMerging{}.merge(cx, host_keys, keep, plan), StatusCode::kInvalidArgument, "keys is a host tensor");
  MergePlan host_plan = plan;
  host_plan.merged_values = TensorView<float, 2>(fake<float>(7), {H * T, d}, {d, 1});
  require_refused(LookMPivot{}.merge(cx, in, keep, host_plan), StatusCode::kInvalidArgument, "merged_values is a host tensor");
  std::int32_t long_row[3] = {0, 11, 12};
  require_refused(LookMPivot{}.merge(cx, in, KeepSet{long_row, fake<std::int32_t>(3), H, 12}, plan), StatusCode::kInvalidArgument,
                  "at most kv_len");
  CHECK(pindptr[0] == -7);  // nothing written
}

TEST_CASE("cuda merge_nearest / merge_apply / d2o_decide: bad arguments are recorded, nothing enqueued", "[cuda][args][merging]") {
  using kvpolicy::MergeRule;
  const Rows<float> rows{fake<const float>(1), 16, nullptr, 0, 0};
  const Workspace ws{fake<void>(9), Cuda::merge_head_workspace(10, 16)};
  require_recorded(
      [&] { Cuda::merge_nearest(rows, fake<const std::int32_t>(2), 4, 10, 16, 1e-8f, nullptr, fake<std::int32_t>(3), fake<float>(4), ws); },
      "evicted, target or sim is null");
  require_recorded(
      [&] {
        Cuda::merge_nearest(rows, fake<const std::int32_t>(2), 4, 10, 0, 1e-8f, fake<std::int32_t>(2), fake<std::int32_t>(3),
                            fake<float>(4), ws);
      },
      "d >= 1");
  require_recorded(
      [&] {
        Cuda::merge_apply(MergeRule{}, rows, rows, fake<const std::int32_t>(2), 4, 10, 16, nullptr, fake<const std::int32_t>(5),
                          fake<std::int32_t>(6), fake<const float>(7), nullptr, fake<std::int32_t>(3), fake<float>(4), nullptr, 0, nullptr,
                          0, ws);
      },
      "dst, src, weight, evicted, target or sim is null");
  require_recorded(
      [&] {
        Cuda::merge_apply(MergeRule{}, rows, rows, fake<const std::int32_t>(2), 4, 10, 16, nullptr, fake<const std::int32_t>(5),
                          fake<std::int32_t>(6), fake<const float>(7), fake<std::int32_t>(8), fake<std::int32_t>(3), fake<float>(4),
                          nullptr, 0, nullptr, 0, Workspace{fake<void>(9), 8});
      },
      "workspace is 8 bytes");
  require_recorded([] { Cuda::d2o_decide(fake<const float>(1), fake<std::int32_t>(2), 0, 5, 0.5f, 0.5f, fake<kvpolicy::D2OState>(3)); },
                   "need H >= 1");
  require_recorded([] { Cuda::d2o_decide(fake<const float>(1), fake<std::int32_t>(2), 2, 5, 0.5f, 0.5f, nullptr); },
                   "sim, target or state is null");
}

TEST_CASE("cuda CaM ops: bad arguments are recorded, nothing enqueued", "[cuda][args][merging][cam]") {
  using kvpolicy::TensorView;
  const Rows<float> rows{fake<const float>(1), 16, nullptr, 0, 0};
  const kvpolicy::ops::CamAttention attn{fake<const float>(2), 10, 1, 1};
  require_recorded([] { Cuda::torch_uniforms(1, -1, fake<float>(3)); }, "n is -1");
  require_recorded([] { Cuda::torch_uniforms(1, 5, nullptr); }, "u is null");
  require_recorded([] { Cuda::evicted_ids(fake<const std::int32_t>(2), 11, 10, fake<std::int32_t>(3)); }, "need 0 <= C <= T");
  require_recorded([] { Cuda::evicted_ids(nullptr, 4, 10, fake<std::int32_t>(3)); }, "kept or evicted is null");
  const auto scores = TensorView<const float, 2>::contiguous(fake<const float>(4), {2, 10});
  require_recorded(
      [&] {
        Cuda::cam_candidates(scores, fake<const std::int32_t>(2), 4, 10, 3, fake<std::int32_t>(3), Workspace{fake<void>(9), 8});
      },
      "workspace is 8 bytes");
  require_recorded(
      [&] {
        Cuda::cam_candidates(TensorView<const float, 2>::contiguous(fake<const float>(4), {2, 9}), fake<const std::int32_t>(2), 4, 10, 3,
                             fake<std::int32_t>(3), Workspace{fake<void>(9), Cuda::cam_candidates_workspace(10)});
      },
      "scores has shape (2, 9)");
  require_recorded(
      [&] {
        Cuda::cam_merge_head(kvpolicy::ops::CamRule{0, true}, attn, 0, rows, fake<const std::int32_t>(2), 4, fake<const std::int32_t>(3), 6,
                             16, fake<const float>(5), 1, fake<std::int32_t>(6), fake<std::int32_t>(7), fake<float>(8), nullptr, 0,
                             fake<std::int64_t>(9));
      },
      "need window, d, group >= 1");
  require_recorded(
      [&] {
        Cuda::cam_merge_head(kvpolicy::ops::CamRule{}, attn, 0, rows, fake<const std::int32_t>(2), 4, fake<const std::int32_t>(3), 6, 16,
                             nullptr, 1, fake<std::int32_t>(6), fake<std::int32_t>(7), fake<float>(8), nullptr, 0, fake<std::int64_t>(9));
      },
      "are null");
}

TEST_CASE("cuda CaM / CAMPress: host checks before anything is enqueued", "[cuda][policy][merging][cam]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t H = 2, T = 10, d = 16;
  std::vector<std::int32_t> indptr{0, 4, 8};
  MergeInput<half> in;
  in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(fake<const half>(1), {H, T, d}, gpu));
  in.attention_sums = TensorView<const float, 2>::contiguous(fake<const float>(2), {H, T}, gpu);
  const KeepSet keep{indptr.data(), fake<std::int32_t>(3), H, 8};
  const std::int64_t cap = H * T * 32;
  std::vector<std::int32_t> out_indptr(H + 1, -7);
  MergePlan plan{out_indptr.data(), fake<std::int32_t>(5), fake<std::int32_t>(6), fake<float>(7), H, cap};
  plan.merged_values = TensorView<float, 2>::contiguous(fake<float>(8), {H * T, d}, gpu);
  plan.slots_per_row = T;
  const CaM cam;
  const auto req = cam.requirements(Context<Cuda>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(req.status.is_ok());
  const Context<Cuda> cx{Workspace{fake<void>(9), req.workspace_bytes}};
  require_refused(cam.merge(cx.with_workspace(Workspace{fake<void>(9), 32}), in, keep, plan), StatusCode::kWorkspaceTooSmall, "workspace");
  MergeInput<half> host_sums = in;
  host_sums.attention_sums = TensorView<const float, 2>::contiguous(fake<const float>(2), {H, T});
  require_refused(cam.merge(cx, host_sums, keep, plan), StatusCode::kInvalidArgument, "attention_sums is a host tensor");
  require_refused(CaM(CaMParams::prefill(2, 2)).merge(cx, in, keep, plan), StatusCode::kUnsupported, "host backends only");
  std::vector<std::int32_t> ragged{0, 4, 9};
  const KvpressCAM press;
  const auto preq = press.requirements(Context<Cuda>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(preq.status.is_ok());
  require_refused(press.merge(Context<Cuda>{Workspace{fake<void>(9), preq.workspace_bytes}}, in,
                              KeepSet{ragged.data(), fake<std::int32_t>(3), H, 9}, plan),
                  StatusCode::kInvalidArgument, "evicts the same tokens from every kv head");
  REQUIRE(std::all_of(out_indptr.begin(), out_indptr.end(), [](std::int32_t x) { return x == -7; }));
}

TEST_CASE("cuda MiniCache: bad arguments recorded, host checks before anything is enqueued", "[cuda][args][merging][minicache]") {
  using namespace kvpolicy;
  const Rows<float> rows{fake<const float>(1), 16, nullptr, 0, 0};
  const Workspace ws{fake<void>(9), Cuda::minicache_workspace(10, 16)};
  require_recorded(
      [&] {
        Cuda::minicache_head(1.5f, 0.1f, rows, rows, 10, 16, 0, fake<float>(2), fake<float>(3), 1, 1, fake<float>(4), 16,
                             fake<std::int32_t>(5), fake<std::int32_t>(6), fake<float>(7), 16, fake<float>(8), 16, ws);
      },
      "t and gamma in [0, 1]");
  require_recorded(
      [&] {
        Cuda::minicache_head(0.5f, 0.1f, rows, rows, 10, 16, 0, nullptr, fake<float>(3), 1, 1, fake<float>(4), 16, fake<std::int32_t>(5),
                             fake<std::int32_t>(6), fake<float>(7), 16, fake<float>(8), 16, ws);
      },
      "is null");
  require_recorded(
      [&] {
        Cuda::minicache_head(0.5f, 0.1f, rows, rows, 10, 16, 0, fake<float>(2), fake<float>(3), 1, 1, fake<float>(4), 16,
                             fake<std::int32_t>(5), fake<std::int32_t>(6), fake<float>(7), 16, fake<float>(8), 16,
                             Workspace{fake<void>(9), 64});
      },
      "workspace is 64 bytes");
  constexpr Device gpu{DeviceType::kCUDA, 0};
  const std::int64_t H = 2, T = 10, d = 16;
  const MiniCacheInput<half> in{KVSource<half>::from(TensorView<const half, 3>::contiguous(fake<const half>(1), {H, T, d}, gpu)),
                                KVSource<half>::from(TensorView<const half, 3>::contiguous(fake<const half>(2), {H, T, d}, gpu))};
  MiniCacheMerged m;
  m.direction = TensorView<float, 3>::contiguous(fake<float>(3), {H, T, d}, gpu);
  m.norm_prev = TensorView<float, 2>::contiguous(fake<float>(4), {H, T}, gpu);
  m.norm_cur = TensorView<float, 2>::contiguous(fake<float>(5), {H, T}, gpu);
  m.retained = KeepSet{fake<std::int32_t>(6), fake<std::int32_t>(7), H, H * T};
  m.retained_prev = TensorView<float, 2>::contiguous(fake<float>(8), {H * T, d}, gpu);
  m.retained_cur = TensorView<float, 2>::contiguous(fake<float>(9), {H * T - 1, d}, gpu);
  const MiniCache mc;
  const auto req = mc.requirements(Context<Cuda>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(req.status.is_ok());
  REQUIRE(req.workspace_bytes == Cuda::minicache_workspace(T, d));
  const Context<Cuda> cx{Workspace{fake<void>(10), req.workspace_bytes}};
  require_refused(mc.merge(cx, in, m), StatusCode::kInvalidArgument, "worst case");
  m.retained_cur = TensorView<float, 2>::contiguous(fake<float>(9), {H * T, d});
  require_refused(mc.merge(cx, in, m), StatusCode::kInvalidArgument, "retained_cur is a host tensor");
  m.retained_cur = TensorView<float, 2>::contiguous(fake<float>(9), {H * T, d}, gpu);
  require_refused(mc.merge(cx.with_workspace(Workspace{fake<void>(10), 8}), in, m), StatusCode::kWorkspaceTooSmall, "workspace");
}

static_assert(kvpolicy::PrefetchOps<Cuda>, "backend::Cuda models the prefetch ops");

TEST_CASE("cuda prefetch ops: bad arguments are recorded, nothing enqueued", "[cuda][args][prefetch]") {
  using namespace kvpolicy;
  require_recorded([] { Cuda::prefetch_history_reset(nullptr, 4); }, "buf is null");
  require_recorded([] { Cuda::prefetch_history_reset(fake<std::int64_t>(1), -1); }, "must be >= 0");
  require_recorded([] { Cuda::prefetch_votes(fake<const std::int32_t>(1), 3, 4, 2, 10, fake<std::int32_t>(2)); }, "ld >= row_len");
  require_recorded([] { Cuda::prefetch_votes(nullptr, 3, 4, 4, 10, fake<std::int32_t>(2)); }, "is null");
  require_recorded([] { Cuda::prefetch_vote_priorities(nullptr, fake<const std::int32_t>(1), 8, 0.5f, nullptr, -1, 0.0f, fake<float>(2)); },
                   "is null");
  require_recorded(
      [] {
        Cuda::prefetch_vote_priorities(fake<const std::int32_t>(1), fake<const std::int32_t>(2), 8, 0.5f, nullptr, 3, 0.0f, fake<float>(2));
      },
      "is null");
  const auto write = [](Workspace ws, std::int64_t* pending) {
    Cuda::prefetch_write_request(fake<const float>(1), fake<const std::int32_t>(2), 100, fake<std::int64_t>(3), fake<const std::int64_t>(4),
                                 pending, 1, 2, fake<std::int32_t>(5), nullptr, nullptr, ws);
  };
  require_recorded([&] { write(Workspace{fake<void>(6), 64}, fake<std::int64_t>(7)); }, "workspace is 64 bytes");
  require_recorded([&] { write(Workspace{fake<void>(6), Cuda::prefetch_request_workspace(100)}, nullptr); }, "pending is null");
  CHECK(Cuda::prefetch_request_workspace(100) >= 2 * 100 * sizeof(std::uint64_t));
  CHECK(Cuda::prefetch_request_workspace(0) == 0);
  PrefetchCounters* counters = fake<PrefetchCounters>(8);
  require_recorded(
      [&] {
        Cuda::prefetch_observe(fake<const std::int32_t>(1), -1, fake<std::int64_t>(2), fake<const std::int64_t>(3),
                               fake<const std::int64_t>(4), 0, false, 0, counters);
      },
      "must be >= 0");
  require_recorded(
      [&] {
        Cuda::prefetch_observe(fake<const std::int32_t>(1), 5, fake<std::int64_t>(2), fake<const std::int64_t>(3),
                               fake<const std::int64_t>(4), 0, false, 0, nullptr);
      },
      "is null");
}

TEST_CASE("cuda ShadowKV ops and the reuse op: bad arguments are recorded, nothing enqueued", "[cuda][args][prefetch]") {
  using kvpolicy::ops::ChunkGeometry;
  const ChunkGeometry geo{16, 8, 2, 64}, bad_geo{12, 8, 2, 64};
  const kvpolicy::PageStrides ks = kvpolicy::PageStrides::contiguous(kvpolicy::PageLayout::kNHD, 2, 16, 64);
  require_recorded(
      [&] {
        Cuda::shadowkv_landmarks(fake<const float>(1), ks, fake<const std::int32_t>(2), bad_geo, 0, 4, fake<float>(3), fake<float>(4));
      },
      "positive multiple of the chunk");
  require_recorded(
      [&] { Cuda::shadowkv_landmarks(fake<const float>(1), ks, fake<const std::int32_t>(2), geo, -1, 4, fake<float>(3), fake<float>(4)); },
      "must be >= 0");
  require_recorded([&] { Cuda::shadowkv_landmarks(fake<const kvpolicy::half>(1), ks, nullptr, geo, 0, 4, fake<float>(3), fake<float>(4)); },
                   "is null");
  require_recorded([&] { Cuda::shadowkv_outlier_keys(fake<const float>(1), fake<const std::int32_t>(2), geo, -3, fake<float>(3)); },
                   "must be >= 0");
  require_recorded([&] { Cuda::shadowkv_outlier_keys(nullptr, fake<const std::int32_t>(2), geo, 5, fake<float>(3)); }, "is null");
  require_recorded(
      [&] {
        Cuda::shadowkv_chunk_scores(fake<const float>(1), 64, 1, 2, 0.125f, fake<const float>(2), fake<const std::int32_t>(3), geo, 4,
                                    fake<const std::int32_t>(4), 5, fake<float>(5), fake<float>(6));
      },
      "outliers <= cand");
  require_recorded(
      [&] {
        Cuda::shadowkv_chunk_scores(fake<const kvpolicy::bfloat16>(1), 64, 1, 2, 0.125f, fake<const float>(2), fake<const std::int32_t>(3),
                                    geo, 10, nullptr, 3, fake<float>(5), fake<float>(6));
      },
      "is null");
  require_recorded(
      [&] {
        Cuda::shadowkv_priorities(geo, 40, 6, fake<const std::int32_t>(1), 2, fake<const std::int32_t>(2), 3, fake<const float>(3),
                                  fake<float>(4));
      },
      "cand <= n / chunk");
  require_recorded(
      [&] { Cuda::shadowkv_priorities(geo, 100, 10, fake<const std::int32_t>(1), 2, nullptr, 3, fake<const float>(3), fake<float>(4)); },
      "is null");
  require_recorded(
      [&] { Cuda::prefetch_add_reuse(fake<float>(1), fake<const std::int32_t>(2), -1, fake<const std::int64_t>(3), 0, -1.0f); },
      "must be >= 0");
  require_recorded([&] { Cuda::prefetch_add_reuse(fake<float>(1), nullptr, 5, fake<const std::int64_t>(3), 0, -1.0f); }, "is null");
}

TEST_CASE("cuda SpeCache ops: bad arguments are recorded, nothing enqueued", "[cuda][args][prefetch]") {
  using kvpolicy::ops::KeyCopyGeometry;
  const KeyCopyGeometry geo{16, 2, 64, 2 * 18, kvpolicy::GgmlType::kQ4_0}, bad_geo{16, 2, 48, 2 * 18, kvpolicy::GgmlType::kQ4_0};
  const kvpolicy::PageStrides ks = kvpolicy::PageStrides::contiguous(kvpolicy::PageLayout::kNHD, 2, 16, 64);
  require_recorded(
      [&] { Cuda::specache_encode(fake<const float>(1), ks, fake<const std::int32_t>(2), bad_geo, 0, 4, fake<std::uint8_t>(3)); },
      "multiple of 32");
  require_recorded(
      [&] { Cuda::specache_encode(fake<const kvpolicy::half>(1), ks, fake<const std::int32_t>(2), geo, 0, -4, fake<std::uint8_t>(3)); },
      "must be >= 0");
  require_recorded([&] { Cuda::specache_encode(fake<const float>(1), ks, nullptr, geo, 0, 4, fake<std::uint8_t>(3)); }, "is null");
  require_recorded(
      [&] {
        Cuda::specache_scores(fake<const float>(1), 64, 1, 0, 0.125f, fake<const std::uint8_t>(2), fake<const std::int32_t>(3), geo, 10,
                              fake<float>(4), fake<float>(5));
      },
      "group >= 1");
  require_recorded(
      [&] {
        Cuda::specache_scores(fake<const kvpolicy::bfloat16>(1), 64, 1, 2, 0.125f, nullptr, fake<const std::int32_t>(3), geo, 10,
                              fake<float>(4), fake<float>(5));
      },
      "is null");
  require_recorded([&] { Cuda::specache_priorities(16, 10, 2, fake<const std::int32_t>(1), 11, fake<const float>(2), fake<float>(3)); },
                   "0 <= k <= n");
  require_recorded([&] { Cuda::specache_priorities(16, 10, 2, nullptr, 3, fake<const float>(2), fake<float>(3)); }, "is null");
}

/// A device prefetcher's host checks (`st`: a device-tagged state over fake pointers, its history in place):
/// host queries, a host-tagged copy of the state, a short request, a short workspace and host keys are each
/// refused before anything is enqueued.
template <class Pol, class State>
void require_prefetcher_host_checks(const Pol& pol, State& st, std::int32_t d) {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  constexpr std::int32_t P = 8;
  const std::int32_t indptr[3] = {0, 3, 5}, last[2] = {4, 2};
  const PageTable table{indptr, fake<const std::int32_t>(1), last, 2};
  const ProblemShape shape{.num_q_heads = 2, .num_kv_heads = 1, .head_dim = d, .max_kv_len = 12, .batch = 2};
  const auto req = pol.requirements(Context<Cuda>{}, shape, 4);
  REQUIRE(req.status.is_ok());
  const Context<Cuda> cx{Workspace{fake<void>(2), req.workspace_bytes}};
  State host_st = st;
  host_st.device = Device{};
  PrefetchRequest out{fake<std::int32_t>(5), nullptr, 5, 0};
  const DecodeInput<float> dev{TensorView<const float, 3>::contiguous(fake<const float>(6), {2, 2, d}, gpu), table, 4, 3};
  const DecodeInput<float> host{TensorView<const float, 3>::contiguous(fake<const float>(6), {2, 2, d}), table, 4, 3};
  require_refused(pol.predict(cx, st, host, out), StatusCode::kInvalidArgument, "queries is host memory");
  require_refused(pol.predict(cx, host_st, dev, out), StatusCode::kInvalidArgument, "state is host memory");
  PrefetchRequest small{fake<std::int32_t>(5), nullptr, 4, 0};
  require_refused(pol.predict(cx, st, dev, small), StatusCode::kOutputTooSmall, "capacity is 4");
  require_refused(pol.predict(cx.with_workspace(Workspace{fake<void>(2), 64}), st, dev, out), StatusCode::kWorkspaceTooSmall, "workspace");
  PagedKVView<const float> keys{
      fake<const float>(7), nullptr, PageStrides::contiguous(PageLayout::kNHD, 1, 4, d), {}, P, 1, 4, d, table, {}};
  require_refused(pol.on_append(cx, AppendInput<float>{keys, nullptr}, st), StatusCode::kInvalidArgument, "keys are host memory");
  CHECK(out.size == 0);
  CHECK(st.history.serial == 0);
}

TEST_CASE("cuda ShadowKV, SpeCache and InfiniGen: host checks before anything is enqueued", "[cuda][policy][prefetch]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  {
    const ShadowKV pol(ShadowKVParams{.chunk_size = 2, .chunk_budget = 2, .outlier_chunks = 1, .local_chunks = 1});
    ShadowKVState st;
    REQUIRE(pol.make_state(fake<float>(3), fake<std::int64_t>(4), 8, 4, 1, 16, &st, gpu).is_ok());
    require_prefetcher_host_checks(pol, st, 16);
  }
  {
    const SpeCache pol(SpeCacheParams{.topk = 3});
    SpeCacheState st;
    REQUIRE(pol.make_state(fake<std::uint8_t>(3), fake<std::int64_t>(4), 8, 4, 1, 32, &st, gpu).is_ok());
    require_prefetcher_host_checks(pol, st, 32);
  }
  {
    const InfiniGen pol(InfiniGenParams{.partial_ratio = 0.5f, .dense_layers = 0});
    InfiniGenState st;
    REQUIRE(pol.make_state(fake<float>(3), fake<std::int32_t>(8), fake<std::int64_t>(4), 8, 4, 1, 16, &st, gpu).is_ok());
    st.prepared = true;
    require_prefetcher_host_checks(pol, st, 16);
  }
}

TEST_CASE("cuda prefetch policies: host checks before anything is enqueued", "[cuda][policy][prefetch]") {
  using namespace kvpolicy;
  constexpr Device gpu{DeviceType::kCUDA, 0};
  constexpr std::int32_t P = 8, d = 16;
  const std::int32_t indptr[3] = {0, 3, 5}, last[2] = {4, 2};
  const PageTable table{indptr, fake<const std::int32_t>(1), last, 2};
  const QuestLookahead<float> pol(QuestLookaheadParams{.page_budget = 2, .dense_layers = 0});
  const ProblemShape shape{.num_q_heads = 2, .num_kv_heads = 1, .head_dim = d, .max_kv_len = 12, .batch = 2};
  const auto req = pol.requirements(Context<Cuda>{}, shape, 4);
  REQUIRE(req.status.is_ok());
  const Context<Cuda> cx{Workspace{fake<void>(2), req.workspace_bytes}};
  QuestLookaheadState<float> st{PageMetaView<const float>::contiguous(fake<const float>(3), P, 1, d, gpu),
                                PrefetchHistory::wrap(fake<std::int64_t>(4), P)};
  PrefetchRequest out{fake<std::int32_t>(5), nullptr, 5, 0};
  const DecodeInput<float> dev{TensorView<const float, 3>::contiguous(fake<const float>(6), {2, 2, d}, gpu), table, 4, 3};
  const DecodeInput<float> host{TensorView<const float, 3>::contiguous(fake<const float>(6), {2, 2, d}), table, 4, 3};
  require_refused(pol.predict(cx, st, host, out), StatusCode::kInvalidArgument, "queries is host memory");
  PrefetchRequest small{fake<std::int32_t>(5), nullptr, 4, 0};
  require_refused(pol.predict(cx, st, dev, small), StatusCode::kOutputTooSmall, "capacity is 4");
  require_refused(pol.predict(cx.with_workspace(Workspace{fake<void>(2), 64}), st, dev, out), StatusCode::kWorkspaceTooSmall, "workspace");
  QuestLookaheadState<float> host_meta{PageMetaView<const float>::contiguous(fake<const float>(3), P, 1, d), st.history};
  require_refused(pol.predict(cx, host_meta, dev, out), StatusCode::kInvalidArgument, "metadata is host memory");
  CHECK(out.size == 0);
  CHECK(st.history.serial == 0);
  const std::int32_t bad_indptr[3] = {0, 3, 2}, sel_last[2] = {1, 1};
  const PageSelection bad{const_cast<std::int32_t*>(bad_indptr), fake<std::int32_t>(7), const_cast<std::int32_t*>(sel_last), nullptr, 2, 3};
  PrefetchCounters* counters = fake<PrefetchCounters>(8);
  require_refused(pol.observe(cx, st, bad, *counters), StatusCode::kInvalidArgument, "decreases");
  CHECK(st.history.step == 0);
  const InfiniGen ig;
  InfiniGenState igs{};
  require_refused(ig.observe(cx, igs, bad, *counters), StatusCode::kInvalidArgument, "state buffers are null");
  require_refused(
      ig.prepare(cx, TensorView<const float, 3>::contiguous(fake<const float>(6), {2, 1, d}, gpu), PagedKVView<const float>{}, igs),
      StatusCode::kUnsupported, "prepare runs on the host");
}

TEST_CASE("cuda InfiniGen ops: bad arguments are recorded, nothing enqueued", "[cuda][args][prefetch]") {
  using kvpolicy::ops::PartialKeyGeometry;
  const PartialKeyGeometry geo{16, 2, 64, 12}, bad_geo{16, 2, 64, 65};
  const kvpolicy::PageStrides ks = kvpolicy::PageStrides::contiguous(kvpolicy::PageLayout::kNHD, 2, 16, 64);
  require_recorded(
      [&] {
        Cuda::infinigen_fold(fake<const float>(1), ks, fake<const std::int32_t>(2), bad_geo, fake<const float>(3),
                             fake<const std::int32_t>(4), 0, 4, fake<float>(5));
      },
      "partial_dim <= head_dim");
  require_recorded(
      [&] {
        Cuda::infinigen_fold(fake<const kvpolicy::half>(1), ks, nullptr, geo, fake<const float>(3), fake<const std::int32_t>(4), 0, 4,
                             fake<float>(5));
      },
      "is null");
  require_recorded(
      [&] {
        Cuda::infinigen_scores(fake<const float>(1), 64, 1, 2, 0.125f, fake<const float>(2), fake<const std::int32_t>(3),
                               fake<const float>(4), fake<const std::int32_t>(5), geo, 100, fake<float>(6), fake<float>(7), 50);
      },
      "n <= ld");
  require_recorded(
      [&] {
        Cuda::infinigen_scores(fake<const kvpolicy::bfloat16>(1), 64, 1, 2, 0.125f, nullptr, fake<const std::int32_t>(3),
                               fake<const float>(4), fake<const std::int32_t>(5), geo, 10, fake<float>(6), fake<float>(7), 10);
      },
      "is null");
  require_recorded([&] { Cuda::infinigen_counts(fake<const float>(1), 4, 10, 5, 2.0f, fake<std::int64_t>(2)); }, "ld >= n");
  require_recorded([&] { Cuda::infinigen_counts(nullptr, 4, 10, 10, 2.0f, fake<std::int64_t>(2)); }, "is null");
  require_recorded(
      [&] {
        Cuda::infinigen_select(fake<const float>(1), 4, 10, 10, fake<const std::int64_t>(2), 4, 0, 16, fake<std::uint64_t>(3),
                               fake<float>(4));
      },
      "max_num_kv and page_size >= 1");
  require_recorded(
      [&] { Cuda::infinigen_select(fake<const float>(1), 4, 10, 10, nullptr, 4, 8, 16, fake<std::uint64_t>(3), fake<float>(4)); },
      "is null");
}
