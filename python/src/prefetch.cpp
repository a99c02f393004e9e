// SPDX-License-Identifier: Apache-2.0
// Prefetch: Quest lookahead, SpeCache, ShadowKV and InfiniGen over a paged
// cache given as arrays (a key page pool, NHD or HND, and a FlashInfer CSR
// page table), each with a caller-owned state object per layer whose buffers
// (the hit-rate history, the policy's low-bit keys / landmarks / partial keys)
// are numpy arrays it owns; predict returns the request (pages, priority),
// observe folds the pages a step read into the state's counters. The offload
// simulator (eval/offload_sim.hpp) replays requests against a finite device
// buffer and a link model.
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/eval/offload_sim.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"
#include "kvpolicy/registry.hpp"

namespace kvpy {

namespace {

using kvpolicy::DType;
using Ctx = kvpolicy::Context<kvpolicy::backend::Cpu>;
using QuestLA = kvpolicy::QuestLookahead<float>;

/// A new zero-filled numpy array of T with `shape`, and its data pointer.
template <class T>
std::pair<nb::object, T*> zeros(std::initializer_list<std::size_t> shape) {
  auto [arr, p] = new_array<T>(shape);
  std::size_t n = 1;
  for (auto s : shape) n *= s;
  std::fill(p, p + n, T{});
  return {nb::cast(arr), p};
}

nb::dict counters_dict(const kvpolicy::PrefetchCounters& c) {
  nb::dict d;
  d["hits"] = c.hits;
  d["misses"] = c.misses;
  d["wasted"] = c.wasted;
  d["predicted"] = c.predicted;
  d["needed"] = c.needed;
  d["reused"] = c.reused;
  d["reuse_total"] = c.reuse_total;
  d["late"] = c.late;
  d["transferred"] = c.transferred;
  d["steps"] = c.steps;
  d["predicted_steps"] = c.predicted_steps;
  d["prediction_recall"] = c.prediction_recall();
  d["precision"] = c.precision();
  d["buffer_hit_rate"] = c.buffer_hit_rate();
  d["late_miss_rate"] = c.late_miss_rate();
  return d;
}

/// The state of one layer of policy P and the arrays that own its buffers.
template <class P>
struct PrefetchState {
  typename P::State st{};
  nb::object history;  // int64 (2 * num_pages): predicted_at, then used_at
  nb::object a, b, c;  // the policy's buffers (see each binding), or None
  kvpolicy::PrefetchCounters counters{};

  std::int64_t step() const { return st.history.step; }
  nb::dict totals() const { return counters_dict(counters); }
  void reset() {
    st.history.reset();
    counters = {};
  }
};

std::int32_t to_i32(const char* who, const char* name, std::int64_t v) {
  if (v < 0 || v > INT32_MAX) value_error(std::string(who) + ": " + name + " is " + std::to_string(v) + ", out of [0, 2^31)");
  return static_cast<std::int32_t>(v);
}

/// A key pool (num_pages, page_size, kv_heads, d) NHD or (num_pages, kv_heads, page_size, d) HND as a PagedKVView.
template <class Tk>
kvpolicy::PagedKVView<const Tk> key_pool(const ArrayArg& K, bool nhd, const kvpolicy::PageTable& table) {
  const auto& e = K.view.extents;
  const auto& st = K.view.strides;
  kvpolicy::PagedKVView<const Tk> kv;
  kv.k_data = static_cast<const Tk*>(K.view.data);
  kv.num_pages = static_cast<std::int32_t>(e[0]);
  kv.page_size = static_cast<std::int32_t>(nhd ? e[1] : e[2]);
  kv.num_kv_heads = static_cast<std::int32_t>(nhd ? e[2] : e[1]);
  kv.head_dim = static_cast<std::int32_t>(e[3]);
  kv.k_strides = kvpolicy::PageStrides{st[0], nhd ? st[2] : st[1], nhd ? st[1] : st[2], e[3] > 1 ? st[3] : 1};
  kv.table = table;
  kv.device = kvpolicy::kHost;
  return kv;
}

bool nhd_of(const char* who, const std::string& layout) {
  if (layout != "NHD" && layout != "HND") value_error(std::string(who) + ": layout is '" + layout + "', must be 'NHD' or 'HND'");
  return layout == "NHD";
}

template <class P>
std::int32_t kv_heads_of(const typename P::State& st) {
  if constexpr (std::is_same_v<P, QuestLA>)
    return st.meta.num_kv_heads;
  else
    return st.num_kv_heads;
}

template <class P>
class PrefetchPolicyObj {
 public:
  using State = PrefetchState<P>;

  explicit PrefetchPolicyObj(const std::string& spec) : spec_(spec) {
    check(kvpolicy::make_policy<P>(spec, &p_));
    check(p_.validate_params());
  }
  const std::string& spec() const { return spec_; }
  const P& policy() const { return p_; }

  /// The request for the next observation of `layer`: (pages int32, priority float32), most urgent first.
  nb::tuple predict(State& s, nb::handle queries, nb::handle indptr, nb::handle indices, nb::handle last_page_len, std::int32_t page_size,
                    std::int32_t layer) const {
    const std::string w = std::string(P::kName) + ".predict";
    const char* who = w.c_str();
    clear_pointers();
    const ArrayArg Q = array_arg(who, "queries", queries, {3});
    if (Q.view.dtype != DType::kF32) type_error(std::string(who) + ": queries must be float32 (batch, num_q_heads, head_dim)");
    const TableArgs t = table_args(who, indptr, indices, last_page_len);
    if (page_size < 1) value_error(std::string(who) + ": page_size is " + std::to_string(page_size) + ", must be >= 1");
    kvpolicy::TensorView<const float, 3> q;
    check(Q.view.as<const float, 3>(&q, "queries"));
    std::int64_t max_len = 0;
    for (std::int32_t b = 0; b < t.table.batch; ++b) {
      const std::int64_t n = t.table.indptr[b + 1] - t.table.indptr[b];
      max_len = std::max<std::int64_t>(max_len, n == 0 ? 0 : (n - 1) * page_size + t.table.last_page_len[b]);
    }
    const kvpolicy::ProblemShape shape{.num_q_heads = q.extent(1),
                                       .num_kv_heads = std::max<std::int64_t>(kv_heads_of<P>(s.st), 1),
                                       .head_dim = q.extent(2),
                                       .max_kv_len = max_len,
                                       .q_len = 1,
                                       .batch = std::max<std::int64_t>(t.table.batch, 1)};
    std::lock_guard<std::mutex> lk(exec_mutex());
    const kvpolicy::ExecContext ex = exec_context();
    const kvpolicy::Requirements req = p_.requirements(Ctx{{}, ex}, shape, page_size);
    check(req.status);
    const std::int64_t cap = std::max<std::int64_t>(req.output.capacity, t.indices.view.extents[0]);
    auto [pages, pp] = new_array<std::int32_t>({static_cast<std::size_t>(cap)});
    auto [prio, pr] = new_array<float>({static_cast<std::size_t>(cap)});
    kvpolicy::PrefetchRequest out{pp, pr, cap, 0};
    std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes + 1]);
    const kvpolicy::DecodeInput<float> next{q, t.table, page_size, layer};
    {
      nb::gil_scoped_release nogil;
      check(p_.predict(Ctx{kvpolicy::Workspace{ws.get(), req.workspace_bytes + 1}, ex}, s.st, next, out));
    }
    auto head = [&](nb::object a) { return a.attr("__getitem__")(nb::slice(nb::int_(0), nb::int_(out.size), nb::none())); };
    return nb::make_tuple(head(nb::cast(pages)), head(nb::cast(prio)));
  }

  /// Counts the pages a step read (a CSR selection over the pool, e.g. Quest's PageSelection) into the state;
  /// returns this observation's counters.
  nb::dict observe(State& s, nb::handle sel_indptr, nb::handle sel_indices) const {
    const std::string w = std::string(P::kName) + ".observe";
    const char* who = w.c_str();
    clear_pointers();
    const ArrayArg IP = array_arg(who, "indptr", sel_indptr, {1});
    const ArrayArg ID = array_arg(who, "indices", sel_indices, {1});
    if (IP.view.dtype != DType::kI32 || ID.view.dtype != DType::kI32) type_error(std::string(who) + ": indptr and indices must be int32");
    if ((IP.view.extents[0] > 1 && IP.view.strides[0] != 1) || (ID.view.extents[0] > 1 && ID.view.strides[0] != 1))
      value_error(std::string(who) + ": indptr and indices must be contiguous");
    if (IP.view.extents[0] < 1) value_error(std::string(who) + ": indptr is empty (rows + 1 entries expected)");
    const kvpolicy::PageSelection sel{static_cast<std::int32_t*>(IP.view.data),
                                      static_cast<std::int32_t*>(ID.view.data),
                                      nullptr,
                                      nullptr,
                                      IP.view.extents[0] - 1,
                                      ID.view.extents[0]};
    kvpolicy::PrefetchCounters d;
    check(p_.observe(Ctx{}, s.st, sel, d));
    s.counters += d;
    return counters_dict(d);
  }

  /// After keys are written to the pool: the policy's per-token state of the appended tokens (append_len per
  /// sequence; None: every token of the table).
  void on_append(State& s, nb::handle k_pages, nb::handle indptr, nb::handle indices, nb::handle last_page_len, nb::handle append_len,
                 const std::string& layout) const {
    const std::string w = std::string(P::kName) + ".on_append";
    const char* who = w.c_str();
    clear_pointers();
    const bool nhd = nhd_of(who, layout);
    const ArrayArg K = array_arg(who, "k_pages", k_pages, {4});
    const TableArgs t = table_args(who, indptr, indices, last_page_len);
    const ArrayArg A = array_arg(who, "append_len", append_len, {1}, false, true, true);
    if (A.present() && (A.view.dtype != DType::kI32 || A.view.extents[0] != t.table.batch))
      value_error(std::string(who) + ": append_len must be int32 with one entry per sequence (" + std::to_string(t.table.batch) + ")");
    check(kvpolicy::dispatch_dtype(K.view.dtype, "k_pages", [&](auto tag) -> kvpolicy::Status {
      using Tk = typename decltype(tag)::type;
      const kvpolicy::AppendInput<Tk> app{key_pool<Tk>(K, nhd, t.table),
                                          A.present() ? static_cast<const std::int32_t*>(A.view.data) : nullptr};
      std::lock_guard<std::mutex> lk(exec_mutex());
      nb::gil_scoped_release nogil;
      return p_.on_append(Ctx{{}, exec_context()}, app, s.st);
    }));
  }

  /// InfiniGen's prefill: skewing matrices, partial channels and the partial keys of every token of the table.
  void prepare(State& s, nb::handle queries, nb::handle k_pages, nb::handle indptr, nb::handle indices, nb::handle last_page_len,
               const std::string& layout) const {
    const char* who = "infinigen.prepare";
    clear_pointers();
    const bool nhd = nhd_of(who, layout);
    const ArrayArg Q = array_arg(who, "queries", queries, {3});
    if (Q.view.dtype != DType::kF32) type_error(std::string(who) + ": queries must be float32 (num_q_heads, W, head_dim)");
    kvpolicy::TensorView<const float, 3> q;
    check(Q.view.as<const float, 3>(&q, "queries"));
    const ArrayArg K = array_arg(who, "k_pages", k_pages, {4});
    const TableArgs t = table_args(who, indptr, indices, last_page_len);
    check(kvpolicy::dispatch_dtype(K.view.dtype, "k_pages", [&](auto tag) -> kvpolicy::Status {
      using Tk = typename decltype(tag)::type;
      const auto kv = key_pool<Tk>(K, nhd, t.table);
      std::lock_guard<std::mutex> lk(exec_mutex());
      const kvpolicy::ExecContext ex = exec_context();
      std::int64_t max_len = 0;
      for (std::int32_t b = 0; b < t.table.batch; ++b) max_len = std::max<std::int64_t>(max_len, kv.seq_len(b));
      const kvpolicy::Requirements req = p_.requirements(
          Ctx{{}, ex},
          kvpolicy::ProblemShape{q.extent(0), kv.num_kv_heads, kv.head_dim, max_len, 1, std::max<std::int64_t>(t.table.batch, 1)},
          std::max(kv.page_size, 1));
      KVP_RETURN_IF_ERROR(req.status);
      std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes + 1]);
      nb::gil_scoped_release nogil;
      return p_.prepare(Ctx{kvpolicy::Workspace{ws.get(), req.workspace_bytes + 1}, ex}, q, kv, s.st);
    }));
  }

 private:
  P p_{};
  std::string spec_;
};

// ---- states ---------------------------------------------------------------

PrefetchState<QuestLA> quest_la_state(const PrefetchPolicyObj<QuestLA>&, nb::handle meta) {
  const char* who = "quest_lookahead.new_state";
  const ArrayArg M = array_arg(who, "meta", meta, {4}, false, true);
  if (M.view.dtype != DType::kF32) type_error(std::string(who) + ": the Quest metadata must be float32 (a QuestState of dtype float32)");
  const auto& e = M.view.extents;
  if (e[2] != 2) value_error(std::string(who) + ": meta must be (num_pages, num_kv_heads, 2, head_dim) (QuestState.data)");
  PrefetchState<QuestLA> s;
  kvpolicy::PageMetaView<const float> mv;
  mv.max_data = static_cast<const float*>(M.view.data);
  mv.min_data = mv.max_data + M.view.strides[2];
  mv.page_stride = M.view.strides[0];
  mv.head_stride = M.view.strides[1];
  mv.num_pages = to_i32(who, "num_pages", e[0]);
  mv.num_kv_heads = to_i32(who, "num_kv_heads", e[1]);
  mv.head_dim = to_i32(who, "head_dim", e[3]);
  mv.device = kvpolicy::kHost;
  s.st.meta = mv;
  auto [h, hp] = zeros<std::int64_t>({static_cast<std::size_t>(kvpolicy::PrefetchHistory::buffer_size(mv.num_pages))});
  s.history = h;
  s.st.history = kvpolicy::PrefetchHistory::over(hp, mv.num_pages);
  s.a = nb::borrow(meta);  // the metadata the state reads (kept alive)
  return s;
}

PrefetchState<kvpolicy::SpeCache> specache_state(const PrefetchPolicyObj<kvpolicy::SpeCache>& p, std::int64_t num_pages,
                                                 std::int64_t page_size, std::int64_t num_kv_heads, std::int64_t head_dim) {
  const char* who = "specache.new_state";
  const std::int32_t P = to_i32(who, "num_pages", num_pages), S = to_i32(who, "page_size", page_size),
                     H = to_i32(who, "num_kv_heads", num_kv_heads), d = to_i32(who, "head_dim", head_dim);
  const kvpolicy::SpeCache& pol = p.policy();
  const std::int64_t rb = pol.row_bytes(d);
  PrefetchState<kvpolicy::SpeCache> s;
  auto [codes, cp] = zeros<std::uint8_t>({static_cast<std::size_t>(P), static_cast<std::size_t>(H), static_cast<std::size_t>(S),
                                          static_cast<std::size_t>(std::max<std::int64_t>(rb, 0))});
  auto [h, hp] = zeros<std::int64_t>({static_cast<std::size_t>(kvpolicy::PrefetchHistory::buffer_size(P))});
  check(pol.make_state(cp, hp, P, S, H, d, &s.st));
  s.a = codes;
  s.history = h;
  return s;
}

PrefetchState<kvpolicy::ShadowKV> shadowkv_state(const PrefetchPolicyObj<kvpolicy::ShadowKV>& p, std::int64_t num_pages,
                                                 std::int64_t page_size, std::int64_t num_kv_heads, std::int64_t head_dim) {
  const char* who = "shadowkv.new_state";
  const std::int32_t P = to_i32(who, "num_pages", num_pages), S = to_i32(who, "page_size", page_size),
                     H = to_i32(who, "num_kv_heads", num_kv_heads), d = to_i32(who, "head_dim", head_dim);
  const kvpolicy::ShadowKV& pol = p.policy();
  const auto sz = pol.state_size(P, S, H, d);
  PrefetchState<kvpolicy::ShadowKV> s;
  auto [f, fp] = zeros<float>({static_cast<std::size_t>(std::max<std::int64_t>(sz.floats, 1))});
  auto [h, hp] = zeros<std::int64_t>({static_cast<std::size_t>(sz.history)});
  check(pol.make_state(fp, hp, P, S, H, d, &s.st));
  const std::size_t cpp = static_cast<std::size_t>(s.st.chunks_per_page());
  // landmarks (num_pages, chunks_per_page, kv_heads, head_dim) and outlier scores (num_pages, chunks_per_page, kv_heads): views of f
  const std::size_t lshape[4] = {static_cast<std::size_t>(P), cpp, static_cast<std::size_t>(H), static_cast<std::size_t>(d)};
  const std::size_t oshape[3] = {static_cast<std::size_t>(P), cpp, static_cast<std::size_t>(H)};
  s.a = nb::cast(nb::ndarray<nb::numpy, float>(s.st.landmarks, 4, lshape, f));
  s.b = nb::cast(nb::ndarray<nb::numpy, float>(s.st.outlier, 3, oshape, f));
  s.c = f;
  s.history = h;
  return s;
}

PrefetchState<kvpolicy::InfiniGen> infinigen_state(const PrefetchPolicyObj<kvpolicy::InfiniGen>& p, std::int64_t num_pages,
                                                   std::int64_t page_size, std::int64_t num_kv_heads, std::int64_t head_dim) {
  const char* who = "infinigen.new_state";
  const std::int32_t P = to_i32(who, "num_pages", num_pages), S = to_i32(who, "page_size", page_size),
                     H = to_i32(who, "num_kv_heads", num_kv_heads), d = to_i32(who, "head_dim", head_dim);
  const kvpolicy::InfiniGen& pol = p.policy();
  const auto sz = pol.state_size(P, S, H, d);
  PrefetchState<kvpolicy::InfiniGen> s;
  auto [f, fp] = zeros<float>({static_cast<std::size_t>(std::max<std::int64_t>(sz.floats, 1))});
  auto [ints, ip] = zeros<std::int32_t>({static_cast<std::size_t>(std::max<std::int64_t>(sz.ints, 1))});
  auto [h, hp] = zeros<std::int64_t>({static_cast<std::size_t>(sz.history)});
  check(pol.make_state(fp, ip, hp, P, S, H, d, &s.st));
  const std::size_t r = static_cast<std::size_t>(s.st.partial_dim);
  const std::size_t kshape[3] = {static_cast<std::size_t>(H), static_cast<std::size_t>(d), static_cast<std::size_t>(d)};
  const std::size_t cshape[2] = {static_cast<std::size_t>(H), r};
  const std::size_t pshape[4] = {static_cast<std::size_t>(P), static_cast<std::size_t>(H), static_cast<std::size_t>(S), r};
  s.a = nb::cast(nb::ndarray<nb::numpy, float>(s.st.skew, 3, kshape, f));
  s.b = nb::cast(nb::ndarray<nb::numpy, std::int32_t>(s.st.channels, 2, cshape, ints));
  s.c = nb::cast(nb::ndarray<nb::numpy, float>(s.st.partial_keys, 4, pshape, f));
  s.history = h;
  return s;
}

template <class P>
nb::class_<PrefetchState<P>> bind_state_class(nb::module_& m, const char* name, const char* doc) {
  return nb::class_<PrefetchState<P>>(m, name, doc)
      .def_prop_ro("step", &PrefetchState<P>::step, "Observations made so far.")
      .def_prop_ro("counters", &PrefetchState<P>::totals, "Counters summed over every observe since the last reset, with the rates.")
      .def_ro("history", &PrefetchState<P>::history, "int64 (2 * num_pages): prediction serial per page, then last observation per page.")
      .def("reset", &PrefetchState<P>::reset, "Forgets every prediction, observation and counter (a new request).");
}

template <class P, bool Appends>
nb::class_<PrefetchPolicyObj<P>> bind_policy_class(nb::module_& m, const char* name, const char* doc) {
  using O = PrefetchPolicyObj<P>;
  auto c = nb::class_<O>(m, name, doc)
               .def(nb::init<const std::string&>(), nb::arg("spec"))
               .def_prop_ro("spec", &O::spec)
               .def("predict", &O::predict, nb::arg("state"), nb::arg("queries").none(), nb::arg("indptr").none(),
                    nb::arg("indices").none(), nb::arg("last_page_len").none(), nb::arg("page_size"), nb::arg("layer") = 0,
                    "The request for the next observation of the layer: (pages int32, priority float32), most urgent first. "
                    "queries (batch, num_q_heads, head_dim) float32 post-RoPE; the table is the cache's FlashInfer CSR table.")
               .def("observe", &O::observe, nb::arg("state"), nb::arg("indptr").none(), nb::arg("indices").none(),
                    "Counts the pages the step read (CSR rows of physical page ids) into the state; returns this step's counters.");
  if constexpr (Appends)
    c.def("on_append", &O::on_append, nb::arg("state"), nb::arg("k_pages").none(), nb::arg("indptr").none(), nb::arg("indices").none(),
          nb::arg("last_page_len").none(), nb::arg("append_len").none() = nb::none(), nb::arg("layout") = "NHD",
          "After keys are written to the pool (NHD (num_pages, page_size, kv_heads, d) or HND): the appended tokens' state.");
  return c;
}

// ---- offload simulator ----------------------------------------------------

struct OffloadSimObj {
  kvpolicy::OffloadSim sim;
  std::int32_t layers = 0;

  OffloadSimObj(double bandwidth_gb_s, double latency_us, double page_bytes, std::int64_t device_pages, const std::string& mode,
                std::int32_t num_layers, std::int32_t pool_pages)
      : layers(num_layers) {
    kvpolicy::OffloadMode m{};
    if (mode == "prefetch")
      m = kvpolicy::OffloadMode::kPrefetch;
    else if (mode == "fetch_on_miss")
      m = kvpolicy::OffloadMode::kFetchOnMiss;
    else if (mode == "all_resident")
      m = kvpolicy::OffloadMode::kAllResident;
    else
      value_error("offload_sim: mode is '" + mode + "'; expected 'prefetch', 'fetch_on_miss' or 'all_resident'");
    check(kvpolicy::OffloadSim::make(kvpolicy::OffloadSimParams{bandwidth_gb_s, latency_us, page_bytes, device_pages}, m, num_layers,
                                     pool_pages, &sim));
  }

  static std::span<const std::int32_t> ids(const char* name, const ArrayArg& a) {
    if (!a.present()) return {};
    if (a.view.dtype != DType::kI32) type_error(std::string("OffloadSim.step: ") + name + " must be int32");
    return {static_cast<const std::int32_t*>(a.view.data), static_cast<std::size_t>(a.view.extents[0])};
  }

  nb::dict step(std::int32_t layer, nb::handle request, nb::handle needed, double overlap_us) {
    const ArrayArg R = array_arg("OffloadSim.step", "request", request, {1}, false, true, true);
    const ArrayArg N = array_arg("OffloadSim.step", "needed", needed, {1});
    kvpolicy::OffloadStepReport r;
    check(sim.step(layer, ids("request", R), ids("needed", N), overlap_us, &r));
    return report(r);
  }

  static nb::dict report(const kvpolicy::OffloadStepReport& r) {
    nb::dict d;
    d["needed"] = r.needed;
    d["requested_needed"] = r.requested_needed;
    d["resident_hits"] = r.resident_hits;
    d["arrived_hits"] = r.arrived_hits;
    d["late"] = r.late;
    d["demand"] = r.demand;
    d["prefetched"] = r.prefetched;
    d["wasted"] = r.wasted;
    d["bytes"] = r.bytes;
    d["stall_us"] = r.stall_us;
    return d;
  }

  nb::dict totals() const {
    const kvpolicy::OffloadTotals& t = sim.totals();
    nb::dict d = report(t.sum);
    d["steps"] = t.steps;
    d["prediction_recall"] = t.prediction_recall();
    d["buffer_hit_rate"] = t.buffer_hit_rate();
    d["late_miss_rate"] = t.late_miss_rate();
    return d;
  }
  std::string mode() const { return kvpolicy::offload_mode_name(sim.mode()); }
  std::int64_t resident(std::int32_t layer) const {
    if (layer < 0 || layer >= layers) value_error("OffloadSim.resident: layer " + std::to_string(layer) + " out of range");
    return sim.resident(layer);
  }
};

}  // namespace

void bind_prefetch(nb::module_& m) {
  bind_state_class<QuestLA>(m, "QuestLookaheadState", "Quest lookahead's state of one layer: the Quest metadata it reads and the history.");
  bind_state_class<kvpolicy::SpeCache>(m, "SpeCacheState", "SpeCache's state of one layer: the low-bit key copy and the history.")
      .def_ro("codes", &PrefetchState<kvpolicy::SpeCache>::a, "uint8 (num_pages, num_kv_heads, page_size, row_bytes) low-bit keys");
  bind_state_class<kvpolicy::ShadowKV>(m, "ShadowKVState", "ShadowKV's state of one layer: chunk landmarks, outlier scores, history.")
      .def_ro("landmarks", &PrefetchState<kvpolicy::ShadowKV>::a, "float32 (num_pages, chunks_per_page, num_kv_heads, head_dim)")
      .def_ro("outlier", &PrefetchState<kvpolicy::ShadowKV>::b, "float32 (num_pages, chunks_per_page, num_kv_heads) min cosine");
  bind_state_class<kvpolicy::InfiniGen>(m, "InfiniGenState", "InfiniGen's state of one layer: skew, partial channels, partial keys.")
      .def_ro("skew", &PrefetchState<kvpolicy::InfiniGen>::a, "float32 (num_kv_heads, head_dim, head_dim) skewing matrices A_g")
      .def_ro("channels", &PrefetchState<kvpolicy::InfiniGen>::b, "int32 (num_kv_heads, partial_dim) partial channels S_g")
      .def_ro("partial_keys", &PrefetchState<kvpolicy::InfiniGen>::c, "float32 (num_pages, num_kv_heads, page_size, partial_dim)")
      .def_prop_ro("prepared", [](const PrefetchState<kvpolicy::InfiniGen>& s) { return s.st.prepared; });

  bind_policy_class<QuestLA, false>(m, "QuestLookaheadPolicy", "Quest-page lookahead (next-step prefetch from Quest's page bounds).")
      .def("new_state", &quest_la_state, nb::arg("meta"), "A state reading Quest's page metadata meta (QuestState.data, float32).");
  bind_policy_class<kvpolicy::SpeCache, true>(m, "SpeCachePolicy", "SpeCache (speculative next-token prefetch over a low-bit key copy).")
      .def("new_state", &specache_state, nb::arg("num_pages"), nb::arg("page_size"), nb::arg("num_kv_heads"), nb::arg("head_dim"))
      .def(
          "row_bytes", [](const PrefetchPolicyObj<kvpolicy::SpeCache>& p, std::int64_t d) { return p.policy().row_bytes(d); },
          nb::arg("head_dim"));
  bind_policy_class<kvpolicy::ShadowKV, true>(m, "ShadowKVPolicy", "ShadowKV-style chunk landmarks, outliers, local tail and reuse.")
      .def("new_state", &shadowkv_state, nb::arg("num_pages"), nb::arg("page_size"), nb::arg("num_kv_heads"), nb::arg("head_dim"));
  bind_policy_class<kvpolicy::InfiniGen, true>(m, "InfiniGenPolicy", "InfiniGen (next-layer speculation over partial skewed keys).")
      .def("new_state", &infinigen_state, nb::arg("num_pages"), nb::arg("page_size"), nb::arg("num_kv_heads"), nb::arg("head_dim"))
      .def("prepare", &PrefetchPolicyObj<kvpolicy::InfiniGen>::prepare, nb::arg("state"), nb::arg("queries").none(),
           nb::arg("k_pages").none(), nb::arg("indptr").none(), nb::arg("indices").none(), nb::arg("last_page_len").none(),
           nb::arg("layout") = "NHD",
           "Prefill: the skew, partial channels (from the prompt's post-RoPE queries (num_q_heads, W, head_dim) float32) and "
           "the partial keys of every token the table holds.");

  nb::class_<OffloadSimObj>(m, "OffloadSim",
                            "The offload simulator (eval/offload_sim.hpp): a finite device buffer per layer and a link model; "
                            "step() replays one layer step's request and read pages.")
      .def(nb::init<double, double, double, std::int64_t, const std::string&, std::int32_t, std::int32_t>(), nb::arg("bandwidth_gb_s"),
           nb::arg("latency_us"), nb::arg("page_bytes"), nb::arg("device_pages"), nb::arg("mode"), nb::arg("num_layers"),
           nb::arg("pool_pages"))
      .def("step", &OffloadSimObj::step, nb::arg("layer"), nb::arg("request").none(), nb::arg("needed").none(), nb::arg("overlap_us"),
           "One layer step: request (int32 pages, most urgent first; None: no request), needed (int32 distinct pages attention "
           "read), overlap_us (compute the prefetch hides behind). Returns the step's report.")
      .def_prop_ro("totals", &OffloadSimObj::totals, "Sums over every step, with the timed hit rates.")
      .def_prop_ro("mode", &OffloadSimObj::mode)
      .def("resident", &OffloadSimObj::resident, nb::arg("layer"), "Pages resident on the device for a layer.");
}

}  // namespace kvpy
