// SPDX-License-Identifier: Apache-2.0
// Policies with caller-owned state, built typed from a spec (registry.hpp's
// make_policy<P>): H2O (online eviction) with its accumulated-attention state
// held in a numpy array the caller can read.
#include <nanobind/stl/string.h>

#include <memory>
#include <vector>

#include "common.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/registry.hpp"

namespace kvpy {

namespace {

using kvpolicy::DType;

/// One sequence's (one layer's) H2O state: scores (rows, capacity) float32 owned here.
struct H2OStateObj {
  nb::ndarray<nb::numpy, float> scores_arr;
  float* scores = nullptr;
  std::int64_t rows = 0, capacity = 0;
  kvpolicy::H2OState st{};

  H2OStateObj(std::int64_t r, std::int64_t c) : rows(r), capacity(c) {
    if (r < 1 || c < 0)
      value_error("H2OState: rows is " + std::to_string(r) + " and capacity " + std::to_string(c) + "; need rows >= 1, capacity >= 0");
    auto [arr, ptr] = new_array<float>({static_cast<std::size_t>(r), static_cast<std::size_t>(c)});
    scores_arr = arr;
    scores = ptr;
    std::fill(scores, scores + r * c, 0.0f);
    st.scores = kvpolicy::TensorView<float, 2>::contiguous(scores, {r, c});
  }
};

class H2OPolicy {
 public:
  explicit H2OPolicy(const std::string& spec) : spec_(spec) { check(kvpolicy::make_policy<kvpolicy::H2O>(spec, &policy_)); }
  const std::string& spec() const { return spec_; }
  std::int64_t cache_size(std::int64_t prompt_len) const { return policy_.cache_size(prompt_len); }

  /// State rows for these head counts (kv heads, or query heads with granularity=query_head).
  std::int64_t state_rows(std::int64_t num_q_heads, std::int64_t num_kv_heads) const {
    return policy_.state_rows(kvpolicy::ProblemShape{.num_q_heads = num_q_heads, .num_kv_heads = num_kv_heads});
  }

  void update(H2OStateObj& s, nb::handle keys, nb::handle queries, nb::handle attention, nb::handle column_sums) const {
    const char* who = "H2O.update";
    clear_pointers();
    const ArrayArg K = array_arg(who, "keys", keys, {3}, false, true, true);
    const ArrayArg Q = array_arg(who, "queries", queries, {3}, false, true, true);
    const ArrayArg A = array_arg(who, "attention", attention, {3}, false, true, true);
    const ArrayArg C = array_arg(who, "column_sums", column_sums, {2}, false, true, true);
    if (!A.present() && !C.present() && !(Q.present() && K.present()))
      value_error(std::string(who) +
                  ": give attention (num_q_heads, q_len, kv_len), column_sums (num_q_heads, kv_len), or queries and keys");
    for (const ArrayArg* p : {&Q, &A, &C})
      if (p->present() && p->view.dtype != DType::kF32)
        type_error(std::string(who) + ": queries / attention / column_sums must be float32");
    const DType kd = K.present() ? K.view.dtype : DType::kF32;
    check(kvpolicy::dispatch_dtype(kd, "keys", [&](auto tag) -> kvpolicy::Status {
      using Tk = typename decltype(tag)::type;
      kvpolicy::ScoreInput<float, Tk> in;
      if (K.present()) {
        kvpolicy::TensorView<const Tk, 3> k;
        KVP_RETURN_IF_ERROR((K.view.template as<const Tk, 3>(&k, "keys")));
        in.keys = kvpolicy::KVSource<Tk>::from(k);
      }
      if (Q.present()) KVP_RETURN_IF_ERROR((Q.view.template as<const float, 3>(&in.queries, "queries")));
      if (A.present()) KVP_RETURN_IF_ERROR((A.view.template as<const float, 3>(&in.attention, "attention")));
      if (C.present()) KVP_RETURN_IF_ERROR((C.view.template as<const float, 2>(&in.column_sums, "column_sums")));
      const std::int64_t Hq = Q.present() ? in.queries.extent(0) : A.present() ? in.attention.extent(0) : in.column_sums.extent(0);
      const kvpolicy::ProblemShape shape{.num_q_heads = Hq,
                                         .num_kv_heads = K.present() ? in.keys.kv_heads() : s.rows,
                                         .head_dim = (Q.present() && K.present()) ? in.keys.head_dim() : 0,
                                         .max_kv_len = s.capacity,
                                         .q_len = Q.present() ? in.queries.extent(1) : 0};
      std::lock_guard<std::mutex> lk(exec_mutex());
      const kvpolicy::ExecContext exec = exec_context();
      const kvpolicy::Context<kvpolicy::backend::Cpu> sizing{{}, exec};
      const kvpolicy::Requirements req = policy_.requirements(sizing, shape);
      KVP_RETURN_IF_ERROR(req.status);
      std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes > 0 ? req.workspace_bytes : 1]);
      nb::gil_scoped_release nogil;
      return policy_.update(sizing.with_workspace(kvpolicy::Workspace{ws.get(), req.workspace_bytes}), s.st, in);
    }));
  }

  nb::tuple evict(H2OStateObj& s, std::int64_t num_coming) const {
    const kvpolicy::ProblemShape shape{.num_q_heads = s.rows, .num_kv_heads = s.rows, .head_dim = 0, .max_kv_len = s.capacity, .q_len = 0};
    std::lock_guard<std::mutex> lk(exec_mutex());
    const kvpolicy::ExecContext exec = exec_context();
    const kvpolicy::Context<kvpolicy::backend::Cpu> sizing{{}, exec};
    const kvpolicy::Requirements req = policy_.requirements(sizing, shape);
    check(req.status);
    auto [indptr, ip] = new_array<std::int32_t>({static_cast<std::size_t>(s.rows + 1)});
    auto [indices, id] = new_array<std::int32_t>({static_cast<std::size_t>(std::max<std::int64_t>(s.rows * s.capacity, 1))});
    std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes > 0 ? req.workspace_bytes : 1]);
    const kvpolicy::KeepSet keep{ip, id, s.rows, s.rows * s.capacity};
    kvpolicy::Status st;
    {
      nb::gil_scoped_release nogil;
      st = policy_.evict_for_space(sizing.with_workspace(kvpolicy::Workspace{ws.get(), req.workspace_bytes}), s.st, num_coming, keep);
    }
    check(st);
    return nb::make_tuple(indptr, indices);
  }

 private:
  std::string spec_;
  kvpolicy::H2O policy_;
};

}  // namespace

void bind_state(nb::module_& m) {
  nb::class_<H2OStateObj>(m, "H2OState", "H2O's caller-owned state of one sequence and layer: accumulated attention per cache slot.")
      .def(nb::init<std::int64_t, std::int64_t>(), nb::arg("rows"), nb::arg("capacity"))
      .def_prop_ro(
          "scores",
          [](nb::handle self) {
            H2OStateObj& s = nb::cast<H2OStateObj&>(self);
            const std::size_t shape[2] = {static_cast<std::size_t>(s.rows), static_cast<std::size_t>(s.capacity)};
            return nb::ndarray<nb::numpy, float>(s.scores, 2, shape, self);
          },
          "(rows, capacity) float32, the accumulated attention (a view)")
      .def_prop_rw(
          "length", [](const H2OStateObj& s) { return s.st.length; }, [](H2OStateObj& s, std::int64_t n) { s.st.length = n; },
          "slots in use (equals the cache length after each update / evict)")
      .def_prop_ro("prompt_len", [](const H2OStateObj& s) { return s.st.prompt_len; })
      .def_prop_ro("capacity", [](const H2OStateObj& s) { return s.capacity; })
      .def(
          "reset", [](H2OStateObj& s) { s.st.reset(); }, "New sequence: length and prompt_len back to 0.");

  nb::class_<H2OPolicy>(m, "H2OPolicy", "H2O (online eviction) built from a spec string ('h2o:hh_size=64,recent_size=192').")
      .def(nb::init<const std::string&>(), nb::arg("spec"))
      .def_prop_ro("spec", &H2OPolicy::spec)
      .def("cache_size", &H2OPolicy::cache_size, nb::arg("prompt_len") = 0, "hh + recent: the cache size an evict trims to.")
      .def("state_rows", &H2OPolicy::state_rows, nb::arg("num_q_heads"), nb::arg("num_kv_heads"))
      .def("update", &H2OPolicy::update, nb::arg("state"), nb::arg("keys").none() = nb::none(), nb::arg("queries").none() = nb::none(),
           nb::arg("attention").none() = nb::none(), nb::arg("column_sums").none() = nb::none(),
           "Folds one forward call's attention into the state: attention (num_q_heads, q_len, kv_len), column_sums "
           "(num_q_heads, kv_len), or queries (num_q_heads, q_len, head_dim) with keys (num_kv_heads, kv_len, head_dim).")
      .def("evict", &H2OPolicy::evict, nb::arg("state"), nb::arg("num_coming") = 0,
           "Evicts down to hh + recent (minus num_coming): (indptr, indices) of the kept slots per state row; the state is "
           "re-packed to match the compacted cache.");
}

}  // namespace kvpy
