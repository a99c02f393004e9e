// Bad-input tables per public entry point (issue #16, deliverable 5).
//
// Each table starts from one valid call (asserted to succeed), then applies
// one mutation per row — a bad shape, stride, pointer, budget, page table,
// NaN / Inf, workspace or output size — and asserts that the call fails with
// the row's status code, that the message names the argument (the row's
// needle), and that the poisoned outputs and every input buffer are
// byte-identical afterwards. Eviction rows run for every erased one-shot
// policy on dense and paged keys, on Scalar and Cpu.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/registry.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using kvp_test::KeepSetBuffer;
using kvp_test::RandomCase;

namespace {

template <class F>
struct BadRow {
  const char* cls;   ///< shape, stride, pointer, budget, table, nan, workspace, output
  const char* what;  ///< the mutation
  std::function<void(F&)> mutate;
  StatusCode code;
  const char* needle;  ///< a word of the message that names the argument
};

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

int g_rows_run = 0;

/// Runs a table: the fixture's valid call succeeds; each row fails as stated and changes nothing.
template <class F, class Make>
void run_table(const std::string& entry, Make make, const std::vector<BadRow<F>>& rows) {
  {
    F f = make();
    const Status s = f.call();
    INFO(entry << " (valid call): " << s.message());
    REQUIRE(s.is_ok());
  }
  for (const BadRow<F>& row : rows) {
    F f = make();
    row.mutate(f);
    const auto before = f.snapshot();
    const Status s = f.call();
    INFO(entry << " / " << row.cls << " / " << row.what << " -> [" << status_code_name(s.code()) << "] " << s.message());
    if (std::getenv("KVP_BAD_INPUT_TABLE") != nullptr)
      std::printf("%s | %s | %s | %s | %s\n", entry.c_str(), row.cls, row.what, status_code_name(s.code()), s.message());
    CHECK(!s.is_ok());
    CHECK(s.code() == row.code);
    CHECK(std::string(s.message()).find(row.needle) != std::string::npos);
    CHECK(f.snapshot() == before);
    ++g_rows_run;
  }
}

// ---- one-shot eviction (every erased policy) ---------------------------------

struct EvictFixture {
  std::string spec;
  BackendKind backend = BackendKind::kCpu;
  bool paged = false;
  std::int64_t Hq = 8, Hkv = 2, T = 64, d = 32, w = 8;
  RandomCase<half> rc;
  ScoreInput<float, half> in;
  std::vector<half> values;
  std::vector<float> q_copy;
  std::vector<half> k_copy;
  std::string spec_extra;
  std::int64_t ws_delta = 0, cap_delta = 0, rows_delta = 0;
  KeepSetBuffer keep{0, 0};

  EvictFixture(std::string s, BackendKind b, bool pg, bool full_queries)
      : spec(std::move(s)), backend(b), paged(pg), w(full_queries ? 64 : 8), rc(Hq, Hkv, T, d, w, 3) {
    in = paged ? rc.paged_input(16) : rc.input();
    values.resize(rc.keys.size());
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = from_float<half>(rc.keys[i] * 0.5f);
    in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.data(), {Hkv, T, d}));
  }
  Status call() {
    AnyEvictionPolicy p;
    KVP_RETURN_IF_ERROR(make_eviction_policy(spec + spec_extra, &p));
    const Requirements r = p.requirements(backend, ProblemShape{Hq, Hkv, d, T, w});
    KVP_RETURN_IF_ERROR(r.status);
    keep = KeepSetBuffer(r.output.rows + rows_delta, r.output.capacity + cap_delta);
    keep.fill_sentinel();
    std::vector<std::byte> ws(static_cast<std::size_t>(static_cast<std::int64_t>(r.workspace_bytes) + ws_delta));
    const Status s = p.evict(backend, in, keep.view(), Workspace{ws.empty() ? nullptr : ws.data(), ws.size()});
    if (!s.is_ok() && !keep.untouched()) return Status::ok();  // a failed call that wrote: reported by the snapshot check
    return s;
  }
  /// Inputs as bytes plus whether the output is still poisoned (checked after the call).
  std::vector<std::vector<std::byte>> snapshot() const {
    return {bytes_of(rc.queries), bytes_of(rc.keys_t), bytes_of(rc.pool),    bytes_of(values), bytes_of(q_copy),
            bytes_of(k_copy),     bytes_of(rc.indptr), bytes_of(rc.indices), bytes_of(rc.last)};
  }
};

std::vector<BadRow<EvictFixture>> eviction_rows(bool paged, bool reads_queries, bool needs_workspace) {
  using F = EvictFixture;
  const auto kInv = StatusCode::kInvalidArgument;
  std::vector<BadRow<F>> rows = {
      {"shape", "7 query heads over 2 kv heads",
       [](F& f) {
         f.in.queries = TensorView<const float, 3>(f.in.queries.data(), {7, f.w, f.d}, f.in.queries.strides());
       },
       kInv, "queries"},
      {"shape", "queries head_dim 30, keys 32",
       [](F& f) {
         f.in.queries = TensorView<const float, 3>(f.in.queries.data(), {f.Hq, f.w, f.d - 2}, f.in.queries.strides());
       },
       kInv, "head_dim"},
      {"shape", "queries with a negative extent",
       [](F& f) {
         f.in.queries = TensorView<const float, 3>(f.in.queries.data(), {f.Hq, -1, f.d}, f.in.queries.strides());
       },
       kInv, "queries"},
      {"pointer", "queries data null",
       [](F& f) {
         f.in.queries = TensorView<const float, 3>(nullptr, {f.Hq, f.w, f.d}, f.in.queries.strides());
       },
       kInv, "queries"},
      {"pointer", "queries misaligned by 2 bytes",
       [](F& f) {
         const auto* p = reinterpret_cast<const float*>(reinterpret_cast<const char*>(f.in.queries.data()) + 2);
         f.in.queries = TensorView<const float, 3>(p, {f.Hq, f.w, f.d - 1}, f.in.queries.strides());
       },
       kInv, "aligned"},
      {"nan", "a NaN query",
       [](F& f) {
         f.q_copy = f.rc.queries;
         f.q_copy[5] = std::numeric_limits<float>::quiet_NaN();
         f.in.queries = TensorView<const float, 3>(f.q_copy.data(), f.in.queries.extents(), f.in.queries.strides());
       },
       kInv, "queries"},
      {"nan", "an infinite query",
       [](F& f) {
         f.q_copy = f.rc.queries;
         f.q_copy[f.q_copy.size() - 1] = -std::numeric_limits<float>::infinity();
         f.in.queries = TensorView<const float, 3>(f.q_copy.data(), f.in.queries.extents(), f.in.queries.strides());
       },
       kInv, "queries"},
      {"budget", "compression_ratio=1.5",
       [](F& f) { f.spec_extra = (f.spec.find(':') == std::string::npos ? ":" : ",") + std::string("compression_ratio=1.5"); }, kInv,
       "compression_ratio"},
      {"budget", "compression_ratio=nan",
       [](F& f) { f.spec_extra = (f.spec.find(':') == std::string::npos ? ":" : ",") + std::string("compression_ratio=nan"); }, kInv,
       "compression_ratio"},
      {"workspace", "one byte short", [](F& f) { f.ws_delta = -1; }, StatusCode::kWorkspaceTooSmall, "workspace"},
      {"output", "keep set capacity one short", [](F& f) { f.cap_delta = -1; }, StatusCode::kOutputTooSmall, "capacity"},
      {"output", "keep set with one row too few", [](F& f) { f.rows_delta = -1; }, kInv, "rows"},
  };
  if (!needs_workspace)  // a policy that needs no scratch cannot get too little
    rows.erase(std::remove_if(rows.begin(), rows.end(), [](const BadRow<F>& r) { return r.code == StatusCode::kWorkspaceTooSmall; }),
               rows.end());
  if (!reads_queries)  // StreamingLLM keeps positions: its queries are not read, so not checked
    rows.erase(
        std::remove_if(rows.begin(), rows.end(), [](const BadRow<F>& r) { return std::string(r.what).find("quer") != std::string::npos; }),
        rows.end());
  if (!paged) {
    rows.push_back({"pointer", "keys data null",
                    [](F& f) {
                      const auto& k = f.in.keys.dense;
                      f.in.keys = KVSource<half>::from(TensorView<const half, 3>(nullptr, k.extents(), k.strides()));
                    },
                    kInv, "keys"});
    rows.push_back({"pointer", "keys misaligned by 1 byte",
                    [](F& f) {
                      const auto& k = f.in.keys.dense;
                      const auto* p = reinterpret_cast<const half*>(reinterpret_cast<const char*>(k.data()) + 1);
                      f.in.keys = KVSource<half>::from(TensorView<const half, 3>(p, {f.Hkv, f.T, f.d - 1}, k.strides()));
                    },
                    kInv, "aligned"});
    rows.push_back({"shape", "keys with a negative extent",
                    [](F& f) {
                      const auto& k = f.in.keys.dense;
                      f.in.keys = KVSource<half>::from(TensorView<const half, 3>(k.data(), {f.Hkv, -3, f.d}, k.strides()));
                    },
                    kInv, "keys"});
    rows.push_back({"stride", "keys extents whose element count overflows int64",
                    [](F& f) {
                      const auto& k = f.in.keys.dense;
                      f.in.keys = KVSource<half>::from(
                          TensorView<const half, 3>(k.data(), {std::int64_t{1} << 40, std::int64_t{1} << 40, f.d}, k.strides()));
                    },
                    kInv, "keys"});
  } else {
    rows.push_back({"table", "page table indptr null", [](F& f) { f.rc.paged.table.indptr = nullptr; }, kInv, "indptr"});
    rows.push_back(
        {"table", "page table last_page_len null", [](F& f) { f.rc.paged.table.last_page_len = nullptr; }, kInv, "last_page_len"});
    rows.push_back({"table", "page id outside the pool", [](F& f) { f.rc.indices[1] = f.rc.paged.num_pages + 4; }, kInv, "page"});
    rows.push_back({"table", "negative page id", [](F& f) { f.rc.indices[0] = -1; }, kInv, "page"});
    rows.push_back({"table", "last_page_len above the page size", [](F& f) { f.rc.last[0] = 17; }, kInv, "last_page_len"});
    rows.push_back({"table", "last_page_len 0", [](F& f) { f.rc.last[0] = 0; }, kInv, "last_page_len"});
    rows.push_back({"table", "indptr decreasing", [](F& f) { f.rc.indptr[1] = -2; }, kInv, "indptr"});
    rows.push_back({"pointer", "page pool null", [](F& f) { f.rc.paged.k_data = nullptr; }, kInv, "k_data"});
  }
  return rows;
}

// ---- compact_contiguous ----------------------------------------------------------

struct CompactFixture {
  std::int64_t H = 2, C = 16, d = 8, kv_len = 12, row0 = 0;
  std::vector<float> k, v;
  std::vector<std::int32_t> pos, kp{0, 4, 7}, ki{0, 3, 5, 11, 1, 2, 10};
  std::vector<std::int64_t> lens;
  TensorView<float, 3> kv, vv;
  TensorView<std::int32_t, 2> pv;
  KeepSet keep;
  std::size_t lens_size = 2;

  CompactFixture() : k(static_cast<std::size_t>(H * C * d)), v(k.size()), pos(static_cast<std::size_t>(H * C)), lens(2, -7) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(i);
      v[i] = -static_cast<float>(i);
    }
    for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(i);
    kv = TensorView<float, 3>::contiguous(k.data(), {H, C, d});
    vv = TensorView<float, 3>::contiguous(v.data(), {H, C, d});
    pv = TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, C});
    keep = KeepSet{kp.data(), ki.data(), 2, static_cast<std::int64_t>(ki.size())};
  }
  CompactFixture(const CompactFixture&) = delete;
  Status call() { return compact_contiguous<float>(kv, vv, pv, kv_len, keep, row0, std::span<std::int64_t>(lens.data(), lens_size)); }
  std::vector<std::vector<std::byte>> snapshot() const {
    return {bytes_of(k), bytes_of(v), bytes_of(pos), bytes_of(lens), bytes_of(kp), bytes_of(ki)};
  }
};

std::vector<BadRow<CompactFixture>> compact_rows() {
  using F = CompactFixture;
  const auto kInv = StatusCode::kInvalidArgument;
  return {
      {"table", "keep set indices null", [](F& f) { f.keep.indices = nullptr; }, kInv, "indices"},
      {"table", "keep set indptr null", [](F& f) { f.keep.indptr = nullptr; }, kInv, "indptr"},
      {"table", "kept token at kv_len", [](F& f) { f.ki[3] = 12; }, kInv, "out of range"},
      {"table", "negative kept token", [](F& f) { f.ki[4] = -1; }, kInv, "holds token -1, out of range"},
      {"table", "keep row not ascending", [](F& f) { f.ki[1] = 0; }, kInv, "ascending"},
      {"table", "keep indptr decreasing", [](F& f) { f.kp[1] = 8; }, kInv, "indptr"},
      {"table", "keep set with one row", [](F& f) { f.keep.num_rows = 1; }, kInv, "rows"},
      {"table", "keep indptr beyond capacity", [](F& f) { f.keep.capacity = 5; }, kInv, "indptr"},
      {"shape", "kv_len above the capacity", [](F& f) { f.kv_len = 17; }, kInv, "kv_len"},
      {"shape", "negative kv_len", [](F& f) { f.kv_len = -1; }, kInv, "kv_len"},
      {"shape", "values with one head",
       [](F& f) {
         f.vv = TensorView<float, 3>::contiguous(f.v.data(), {1, f.C, f.d});
       },
       kInv, "values"},
      {"shape", "positions too short",
       [](F& f) {
         f.pv = TensorView<std::int32_t, 2>::contiguous(f.pos.data(), {f.H, 8});
       },
       kInv, "positions"},
      {"output", "new_lens with one entry", [](F& f) { f.lens_size = 1; }, kInv, "new_lens"},
      {"range", "row0 near INT64_MAX", [](F& f) { f.row0 = INT64_MAX - 1; }, kInv, "row"},
      {"pointer", "keys null", [](F& f) { f.kv = TensorView<float, 3>(nullptr, f.kv.extents(), f.kv.strides()); }, kInv, "keys"},
      {"pointer", "keys misaligned by 2 bytes",
       [](F& f) {
         auto* p = reinterpret_cast<float*>(reinterpret_cast<char*>(f.k.data()) + 2);
         f.kv = TensorView<float, 3>(p, {f.H, f.C, f.d - 1}, f.kv.strides());
       },
       kInv, "aligned"},
      {"stride", "keys rows overlap (token stride 4 < head_dim 8)",
       [](F& f) {
         f.kv = TensorView<float, 3>(f.k.data(), f.kv.extents(), {f.C * f.d, 4, 1});
       },
       kInv, "overlapping"},
      {"stride", "keys head stride 0",
       [](F& f) {
         f.kv = TensorView<float, 3>(f.k.data(), f.kv.extents(), {0, f.d, 1});
       },
       kInv, "overlapping"},
      {"stride", "positions token stride 0",
       [](F& f) {
         f.pv = TensorView<std::int32_t, 2>(f.pos.data(), f.pv.extents(), {f.C, 0});
       },
       kInv, "overlapping"},
      {"stride", "values are the keys' memory",
       [](F& f) {
         f.vv = TensorView<float, 3>::contiguous(f.k.data(), {f.H, f.C, f.d});
       },
       kInv, "share memory"},
      {"stride", "values overlap the keys by one head",
       [](F& f) {
         f.vv = TensorView<float, 3>::contiguous(f.k.data() + f.C * f.d, {1, f.C, f.d});
       },
       kInv, "values"},
  };
}

bool needs_workspace(const std::string& spec, BackendKind b, bool full) {
  AnyEvictionPolicy p;
  REQUIRE(make_eviction_policy(spec, &p).is_ok());
  return p.requirements(b, ProblemShape{8, 2, 32, 64, full ? 64 : 8}).workspace_bytes > 0;
}

}  // namespace

TEST_CASE("bad input: every erased eviction policy, dense and paged keys, Scalar and Cpu", "[bad_input][eviction]") {
  const std::vector<std::pair<std::string, bool>> specs = {{"streaming_llm:compression_ratio=0.5", false},
                                                           {"snapkv:compression_ratio=0.5,window=8", false},
                                                           {"observed_attention", true},
                                                           {"tova", false},
                                                           {"pyramidkv:window=8,layer=2,num_layers=4", false},
                                                           {"adakv:window=8,compression_ratio=0.5", false},
                                                           {"expected_attention:compression_ratio=0.5,n_sink=2", false}};
  for (const auto& [spec, full] : specs)
    for (const BackendKind b : {BackendKind::kScalar, BackendKind::kCpu})
      for (const bool paged : {false, true}) {
        const std::string entry = spec + (b == BackendKind::kCpu ? " on Cpu" : " on Scalar") + (paged ? ", paged keys" : "");
        run_table<EvictFixture>(
            entry, [&, s = spec, f = full] { return EvictFixture(s, b, paged, f); },
            eviction_rows(paged, spec.rfind("streaming_llm", 0) != 0, needs_workspace(spec, b, full)));
      }
  INFO(g_rows_run << " rows");
}

TEST_CASE("bad input: compact_contiguous", "[bad_input][apply]") {
  run_table<CompactFixture>(
      "compact_contiguous", [] { return CompactFixture(); }, compact_rows());
}

TEST_CASE("bad input: an enum parameter outside its named values is rejected by name", "[bad_input][params]") {
  SnapKVParams sp;
  sp.pooling = static_cast<Pooling>(7);
  CHECK_THAT(SnapKV(sp).validate_params().message(), Catch::Contains("snapkv: pooling is 7, not one of none | avg | max"));
  sp = SnapKVParams{};
  sp.group_reduce = static_cast<GroupReduce>(200);
  CHECK_THAT(SnapKV(sp).validate_params().message(), Catch::Contains("group_reduce is 200, not one of mean | max | sum"));
  AdaKVParams ap;
  ap.variant = static_cast<AdaKVVariant>(5);
  CHECK_THAT(AdaKV<SnapKV>(ap, SnapKV{}).validate_params().message(), Catch::Contains("variant is 5, not one of"));
  QuestParams qp;
  qp.gqa = static_cast<QuestGqa>(9);
  CHECK_THAT(Quest(qp).validate_params().message(), Catch::Contains("quest: gqa is 9, not one of"));
  GgmlQuantParams gp;
  gp.type = static_cast<GgmlType>(9);
  CHECK_THAT(GgmlQuant(gp).validate_params().message(), Catch::Contains("ggml: type is 9, not one of q8_0 | q4_0"));
  // requirements() carries the same error and zero sizes
  const Requirements r =
      SnapKV(SnapKVParams{.pooling = static_cast<Pooling>(7)}).requirements(Context<backend::Cpu>{}, ProblemShape{8, 2, 32, 64, 8});
  CHECK(!r.status.is_ok());
  CHECK(r.workspace_bytes == 0);
}

TEST_CASE("bad input: K and V interleaved in one buffer are separate views, overlapping pools are rejected", "[bad_input][apply]") {
  // Combined layout (H, C, 2, d): keys at +0, values at +d of each token's pair. Element-disjoint, so accepted.
  const std::int64_t H = 2, C = 6, d = 4, len = 5;
  std::vector<float> kv(static_cast<std::size_t>(H * C * 2 * d));
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(i);
  const auto orig = kv;
  const TensorView<float, 3> K(kv.data(), {H, C, d}, {C * 2 * d, 2 * d, 1}), V(kv.data() + d, {H, C, d}, {C * 2 * d, 2 * d, 1});
  std::vector<std::int32_t> kp{0, 2, 4}, ki{1, 4, 0, 3};
  std::vector<std::int64_t> lens(2, -7);
  const KeepSet keep{kp.data(), ki.data(), 2, 4};
  REQUIRE(compact_contiguous<float>(K, V, {}, len, keep, 0, std::span<std::int64_t>(lens)).is_ok());
  CHECK(lens == std::vector<std::int64_t>{2, 2});
  for (std::int64_t c = 0; c < d; ++c) {
    CHECK(kv[static_cast<std::size_t>(0 * 2 * d + c)] == orig[static_cast<std::size_t>(1 * 2 * d + c)]);  // head 0 key row 0 <- token 1
    CHECK(kv[static_cast<std::size_t>(1 * 2 * d + d + c)] ==
          orig[static_cast<std::size_t>(4 * 2 * d + d + c)]);  // head 0 value row 1 <- token 4
  }
  // The same buffer with values at +d/2: keys and values overlap element-wise.
  const TensorView<float, 3> Vbad(kv.data() + d / 2, {H, C, d}, {C * 2 * d, 2 * d, 1});
  const auto before = kv;
  const Status s = compact_contiguous<float>(K, Vbad, {}, len, keep, 0, std::span<std::int64_t>(lens));
  CHECK_THAT(s.message(), Catch::Contains("keys and values share memory"));
  CHECK(kv == before);

  // A paged pool whose slot stride is smaller than a row: rejected by compact_paged, nothing written.
  const std::int32_t pages = 2, ps = 2, Hp = 1, dp = 4;
  std::vector<float> pool(static_cast<std::size_t>(pages * ps * dp), 1.0f);
  PageStrides st = PageStrides::contiguous(PageLayout::kNHD, Hp, ps, dp);
  st.slot = 2;  // rows of 4 channels 2 apart
  std::vector<std::int32_t> indptr{0, 2}, indices{0, 1}, last{2};
  const PagedKVView<float> cache{pool.data(), nullptr, st, st, pages, Hp, ps, dp, PageTable{indptr.data(), indices.data(), last.data(), 1},
                                 kHost};
  std::vector<std::int32_t> pkp{0, 2}, pki{0, 3}, oip(2, -7), oix(2, -7), ol(1, -7), freed(2, -7);
  PagedCompactOutput out{oip.data(), oix.data(), ol.data(), 2, freed.data(), 2, -7};
  std::vector<std::byte> ws(compact_paged_workspace(pages));
  const auto pool0 = pool;
  const Status p = compact_paged<float>(cache, KeepSet{pkp.data(), pki.data(), 1, 2}, {}, out, Workspace{ws.data(), ws.size()});
  CHECK_THAT(p.message(), Catch::Contains("key pool's strides"));
  CHECK(pool == pool0);
  CHECK(oip == std::vector<std::int32_t>(2, -7));
  CHECK(out.num_freed == -7);
}
