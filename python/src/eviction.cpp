// SPDX-License-Identifier: Apache-2.0
// One-shot eviction through the registry's type-erased AnyEvictionPolicy: any
// erased policy by spec string, on keys / values of float32, float16 or
// bfloat16 read in place (3-D: one sequence, 4-D: a batch with a leading axis).
#include <nanobind/stl/string.h>

#include <memory>
#include <vector>

#include "common.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/registry.hpp"

namespace kvpy {

namespace {

using kvpolicy::AnyEvictionPolicy;
using kvpolicy::AnyTensorView;
using kvpolicy::DType;

kvpolicy::BackendKind backend_kind(const std::string& b) {
  if (b == "cpu") return kvpolicy::BackendKind::kCpu;
  if (b == "scalar") return kvpolicy::BackendKind::kScalar;
  value_error("backend is '" + b + "'; expected 'cpu' (SIMD, the default) or 'scalar' (the reference)");
}

/// A float32 view of `v` (rank R): `v` itself when it is float32, else a
/// widened contiguous copy held in `store` (queries and probabilities only;
/// keys and values are never copied).
template <int R>
kvpolicy::TensorView<const float, R> as_float(const AnyTensorView& v, const char* name, std::vector<std::unique_ptr<float[]>>& store) {
  kvpolicy::TensorView<const float, R> out;
  if (v.dtype == DType::kF32) {
    check(v.as<const float, R>(&out, name));
    return out;
  }
  typename kvpolicy::TensorView<const float, R>::Index e{};
  std::int64_t n = 1;
  for (int i = 0; i < R; ++i) n *= (e[i] = v.extents[i]);
  auto buf = std::make_unique<float[]>(static_cast<std::size_t>(n > 0 ? n : 1));
  float* dst = buf.get();
  check(kvpolicy::dispatch_dtype(v.dtype, name, [&](auto tag) -> kvpolicy::Status {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float>) {
      return kvpolicy::Status::ok();
    } else {
      kvpolicy::TensorView<const T, R> src;
      KVP_RETURN_IF_ERROR((v.as<const T, R>(&src, name)));
      std::int64_t idx[R] = {};
      for (std::int64_t i = 0; i < n; ++i) {
        std::int64_t off = 0;
        for (int k = 0; k < R; ++k) off += idx[k] * src.stride(k);
        dst[i] = kvpolicy::to_float(src.data()[off]);
        for (int k = R - 1; k >= 0; --k) {
          if (++idx[k] < e[k]) break;
          idx[k] = 0;
        }
      }
      return kvpolicy::Status::ok();
    }
  }));
  out = kvpolicy::TensorView<const float, R>::contiguous(dst, e);
  store.push_back(std::move(buf));
  return out;
}

/// A writable int32 1-D array given by the caller, or a new one.
std::pair<nb::object, std::int32_t*> out_i32(const char* who, const char* name, nb::handle given, std::int64_t need, bool exact) {
  if (given.is_valid() && !given.is_none()) {
    ArrayArg a = array_arg(who, name, given, {1}, true, true);
    if (a.view.dtype != DType::kI32) type_error(std::string(who) + ": " + name + " must be int32");
    if (exact ? a.view.extents[0] != need : a.view.extents[0] < need)
      value_error(std::string(who) + ": " + name + " has " + std::to_string(a.view.extents[0]) + " entries, needs " +
                  (exact ? "" : "at least ") + std::to_string(need));
    return {nb::borrow(given), static_cast<std::int32_t*>(a.view.data)};
  }
  auto [arr, ptr] = new_array<std::int32_t>({static_cast<std::size_t>(need)});
  return {nb::cast(arr), ptr};
}

/// The call's arrays as one ScoreInput per sequence (keys' dtype dispatched), handed to
/// `fn(std::vector<ScoreInput<float, Tk>>&, const ProblemShape&, bool batched) -> Status` (errors raise).
template <class Fn>
void with_inputs(const char* who, nb::handle keys, nb::handle queries, nb::handle values, nb::handle attention, nb::handle column_sums,
                 std::int64_t lookahead, Fn&& fn) {
  const ArrayArg K = array_arg(who, "keys", keys, {3, 4});
  const bool batched = K.view.rank == 4;
  const int r3 = batched ? 4 : 3, r2 = batched ? 3 : 2;
  const ArrayArg Q = array_arg(who, "queries", queries, {r3}, false, true, /*optional=*/true);
  const ArrayArg V = array_arg(who, "values", values, {r3}, false, true, true);
  const ArrayArg A = array_arg(who, "attention", attention, {r3}, false, true, true);
  const ArrayArg C = array_arg(who, "column_sums", column_sums, {r2}, false, true, true);
  for (const ArrayArg* a : {&K, &Q, &V, &A, &C}) {
    const DType d = a->view.dtype;
    if (a->present() && d != DType::kF32 && d != DType::kF16 && d != DType::kBF16)
      type_error(std::string(who) + ": " +
                 (a == &K   ? "keys"
                  : a == &Q ? "queries"
                  : a == &V ? "values"
                  : a == &A ? "attention"
                            : "column_sums") +
                 " has dtype " + kvpolicy::dtype_name(d) + "; supported: float32, float16, bfloat16");
  }
  if (V.present() && V.view.dtype != K.view.dtype)
    type_error(std::string(who) + ": values has dtype " + kvpolicy::dtype_name(V.view.dtype) + " but keys has " +
               kvpolicy::dtype_name(K.view.dtype) + "; keys and values share one dtype");
  const std::int64_t B = batched ? K.view.extents[0] : 1;
  auto check_batch = [&](const ArrayArg& a, const char* name) {
    if (batched && a.present() && a.view.extents[0] != B)
      value_error(std::string(who) + ": " + name + " has batch " + std::to_string(a.view.extents[0]) + ", keys has " + std::to_string(B));
  };
  check_batch(Q, "queries");
  check_batch(V, "values");
  check_batch(A, "attention");
  check_batch(C, "column_sums");
  auto seq = [&](const ArrayArg& a, std::int64_t b) { return batched ? batch_slice(a.view, b) : a.view; };
  std::vector<std::unique_ptr<float[]>> store;  // widened queries / probabilities

  check(kvpolicy::dispatch_dtype(K.view.dtype, "keys", [&](auto tag) -> kvpolicy::Status {
    using Tk = typename decltype(tag)::type;
    using In = kvpolicy::ScoreInput<float, Tk>;
    std::vector<In> batch(static_cast<std::size_t>(B));
    for (std::int64_t b = 0; b < B; ++b) {
      In& in = batch[static_cast<std::size_t>(b)];
      kvpolicy::TensorView<const Tk, 3> k;
      check(seq(K, b).template as<const Tk, 3>(&k, "keys"));
      in.keys = kvpolicy::KVSource<Tk>::from(k);
      if (V.present()) {
        kvpolicy::TensorView<const Tk, 3> v;
        check(seq(V, b).template as<const Tk, 3>(&v, "values"));
        in.values = kvpolicy::KVSource<Tk>::from(v);
      }
      if (Q.present()) in.queries = as_float<3>(seq(Q, b), "queries", store);
      if (A.present()) in.attention = as_float<3>(seq(A, b), "attention", store);
      if (C.present()) in.column_sums = as_float<2>(seq(C, b), "column_sums", store);
      in.lookahead = lookahead;
    }
    const In& first = batch.front();
    const std::int64_t Hkv = first.keys.kv_heads();
    const std::int64_t Hq = Q.present()   ? first.queries.extent(0)
                            : A.present() ? first.attention.extent(0)
                            : C.present() ? first.column_sums.extent(0)
                                          : Hkv;
    const std::int64_t q_len = Q.present() ? first.queries.extent(1) : A.present() ? first.attention.extent(1) : 0;
    std::int64_t max_len = 0;
    for (const In& in : batch) max_len = std::max(max_len, in.keys.kv_len());
    const kvpolicy::ProblemShape shape{
        .num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = first.keys.head_dim(), .max_kv_len = max_len, .q_len = q_len, .batch = B};
    return fn(batch, shape, batched);
  }));
}

class EvictionPolicy {
 public:
  explicit EvictionPolicy(const std::string& spec) : spec_(spec) { check(kvpolicy::make_eviction_policy(spec, &policy_)); }

  const std::string& name() const { return policy_.name(); }
  const std::string& spec() const { return spec_; }
  std::int64_t kept_count(std::int64_t n) const { return policy_.kept_count(n); }
  std::int64_t protected_tokens(std::int64_t n) const { return policy_.protected_tokens(n); }
  bool has_scores() const { return policy_.has_scores(); }

  nb::tuple evict(nb::handle keys, nb::handle queries, nb::handle values, nb::handle attention, nb::handle column_sums,
                  std::int64_t lookahead, const std::string& backend, nb::handle indptr_out, nb::handle indices_out,
                  nb::handle shard) const {
    const char* who = "evict";
    clear_pointers();
    const kvpolicy::BackendKind kind = backend_kind(backend);
    const kvpolicy::HeadShard* sh = head_shard(shard);
    nb::object indptr_obj, indices_obj;
    with_inputs(who, keys, queries, values, attention, column_sums, lookahead, [&](auto& batch, const kvpolicy::ProblemShape& shape, bool) {
      using In = typename std::decay_t<decltype(batch)>::value_type;
      std::lock_guard<std::mutex> lk(exec_mutex());
      kvpolicy::ExecContext exec = exec_context();
      exec.shard = sh;
      const kvpolicy::Requirements req = policy_.requirements(kind, shape, exec);
      KVP_RETURN_IF_ERROR(req.status);
      std::int32_t *indptr = nullptr, *indices = nullptr;
      std::tie(indptr_obj, indptr) = out_i32(who, "indptr", indptr_out, req.output.rows + 1, true);
      std::tie(indices_obj, indices) = out_i32(who, "indices", indices_out, req.output.capacity, false);
      const std::int64_t cap = indices_out.is_valid() && !indices_out.is_none() ? nb::len(indices_out) : req.output.capacity;
      std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes > 0 ? req.workspace_bytes : 1]);
      const kvpolicy::KeepSet keep{indptr, indices, req.output.rows, cap};
      nb::gil_scoped_release nogil;
      return policy_.evict(kind, std::span<const In>(batch), keep, kvpolicy::Workspace{ws.get(), req.workspace_bytes}, exec);
    });
    return nb::make_tuple(indptr_obj, indices_obj);
  }

  /// Per-token scores (num_kv_heads, kv_len) of one sequence, or (batch, num_kv_heads, kv_len) of a batch of
  /// equal-length sequences, into a new float32 array or the caller's `out` (float32, writable, that shape, any strides).
  nb::object score(nb::handle keys, nb::handle queries, nb::handle values, nb::handle attention, nb::handle column_sums,
                   std::int64_t lookahead, const std::string& backend, nb::handle out) const {
    const char* who = "score";
    clear_pointers();
    const kvpolicy::BackendKind kind = backend_kind(backend);
    if (!policy_.has_scores()) {  // the library's message, before any argument is read
      check(policy_.score_requirements(kind, kvpolicy::ProblemShape{1, 1, 1, 1, 1, 1}).status);
    }
    nb::object result;
    with_inputs(
        who, keys, queries, values, attention, column_sums, lookahead, [&](auto& batch, const kvpolicy::ProblemShape& shape, bool batched) {
          const std::int64_t B = static_cast<std::int64_t>(batch.size()), H = shape.num_kv_heads, T = shape.max_kv_len;
          kvpolicy::TensorView<float, 3> dst;  // (B, H, T)
          if (out.is_valid() && !out.is_none()) {
            ArrayArg o = array_arg(who, "out", out, {batched ? 3 : 2}, true, false);
            if (o.view.dtype != DType::kF32) type_error(std::string(who) + ": out must be float32");
            const std::int64_t want[3] = {B, H, T};
            const int off = batched ? 0 : 1;
            for (int i = 0; i < o.view.rank; ++i)
              if (o.view.extents[i] != want[i + off])
                value_error(std::string(who) + ": out has extent " + std::to_string(o.view.extents[i]) + " on axis " + std::to_string(i) +
                            ", expected " + std::to_string(want[i + off]) +
                            (batched ? " (batch, num_kv_heads, kv_len)" : " (num_kv_heads, kv_len)"));
            const std::int64_t s0 = batched ? o.view.strides[0] : 0;
            dst = kvpolicy::TensorView<float, 3>(static_cast<float*>(o.view.data), {B, H, T},
                                                 {s0, o.view.strides[o.view.rank - 2], o.view.strides[o.view.rank - 1]});
            result = nb::borrow(out);
          } else {
            if (batched) {
              auto [arr, ptr] = new_array<float>({static_cast<std::size_t>(B), static_cast<std::size_t>(H), static_cast<std::size_t>(T)});
              dst = kvpolicy::TensorView<float, 3>::contiguous(ptr, {B, H, T});
              result = nb::cast(arr);
            } else {
              auto [arr, ptr] = new_array<float>({static_cast<std::size_t>(H), static_cast<std::size_t>(T)});
              dst = kvpolicy::TensorView<float, 3>::contiguous(ptr, {1, H, T});
              result = nb::cast(arr);
            }
          }
          std::lock_guard<std::mutex> lk(exec_mutex());
          const kvpolicy::ExecContext exec = exec_context();
          kvpolicy::ProblemShape one = shape;
          one.batch = 1;
          const kvpolicy::Requirements req = policy_.score_requirements(kind, one, exec);
          KVP_RETURN_IF_ERROR(req.status);
          std::unique_ptr<std::byte[]> ws(new std::byte[req.workspace_bytes > 0 ? req.workspace_bytes : 1]);
          // Scores go to a scratch map first, so nothing is written into `out` when a sequence fails.
          std::unique_ptr<float[]> tmp(new float[static_cast<std::size_t>(B * H * (T > 0 ? T : 1))]);
          nb::gil_scoped_release nogil;
          for (std::int64_t b = 0; b < B; ++b) {
            const auto map = kvpolicy::TensorView<float, 2>::contiguous(tmp.get() + b * H * T, {H, T});
            KVP_RETURN_IF_ERROR(
                policy_.score(kind, batch[static_cast<std::size_t>(b)], map, kvpolicy::Workspace{ws.get(), req.workspace_bytes}, exec));
          }
          for (std::int64_t b = 0; b < B; ++b)
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t j = 0; j < T; ++j) dst(b, h, j) = tmp[static_cast<std::size_t>((b * H + h) * T + j)];
          return kvpolicy::Status::ok();
        });
    return result;
  }

 private:
  std::string spec_;
  AnyEvictionPolicy policy_;
};

}  // namespace

void bind_eviction(nb::module_& m) {
  nb::class_<EvictionPolicy>(m, "EvictionPolicy",
                             "A one-shot eviction policy of the registry, built from a spec string "
                             "('snapkv:compression_ratio=0.5,window=64'); immutable, safe to share between threads.")
      .def(nb::init<const std::string&>(), nb::arg("spec"))
      .def_prop_ro("name", &EvictionPolicy::name)
      .def_prop_ro("spec", &EvictionPolicy::spec)
      .def("kept_count", &EvictionPolicy::kept_count, nb::arg("kv_len"),
           "Tokens kept per row for a sequence of kv_len tokens (-1: invalid).")
      .def("protected_tokens", &EvictionPolicy::protected_tokens, nb::arg("kv_len"), "Tokens kept by rule (window, sinks).")
      .def_prop_ro("has_scores", &EvictionPolicy::has_scores, "Whether score() gives per-token scores (the policy is a Scorer).")
      .def("score", &EvictionPolicy::score, nb::arg("keys").none(), nb::arg("queries").none() = nb::none(),
           nb::arg("values").none() = nb::none(), nb::arg("attention").none() = nb::none(), nb::arg("column_sums").none() = nb::none(),
           nb::arg("lookahead") = 0, nb::arg("backend") = "cpu", nb::arg("out").none() = nb::none(),
           "Per-token scores as float32 (num_kv_heads, kv_len) (a batch of equal-length sequences: (batch, num_kv_heads, "
           "kv_len)): higher = keep, protected tokens (window, sinks) +inf; evict keeps each row's best (ties: the later "
           "token). Same inputs as evict. out: an optional caller-owned float32 array of that shape (written only on success). "
           "ValueError for a policy without scores (StreamingLLM).")
      .def("evict", &EvictionPolicy::evict, nb::arg("keys").none(), nb::arg("queries").none() = nb::none(),
           nb::arg("values").none() = nb::none(), nb::arg("attention").none() = nb::none(), nb::arg("column_sums").none() = nb::none(),
           nb::arg("lookahead") = 0, nb::arg("backend") = "cpu", nb::arg("indptr").none() = nb::none(),
           nb::arg("indices").none() = nb::none(), nb::arg("shard").none() = nb::none(),
           "The KeepSet of one sequence (keys (kv_heads, kv_len, head_dim)) or a batch (a leading batch axis on every "
           "array) as (indptr, indices) int32 arrays: row r = seq * rows_per_seq + head keeps indices[indptr[r]:indptr[r+1]], "
           "ascending. Keys / values are read in place (float32, float16, bfloat16, any strides with a contiguous last axis); "
           "queries (num_q_heads, q_len, head_dim) post-RoPE, attention (num_q_heads, q_len, kv_len) and column_sums "
           "(num_q_heads, kv_len) are read as float32 (other float dtypes are widened into a temporary). "
           "indptr / indices: optional caller-owned int32 outputs. shard: a HeadShard when the arrays hold this rank's heads "
           "of a tensor-parallel layer (policies with a layer-wide budget, Ada-KV, then decide with the other ranks).");
}

}  // namespace kvpy
