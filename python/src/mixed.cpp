// SPDX-License-Identifier: Apache-2.0
// MixedPrecision<SnapKV, Q>: three tiers (full precision, quantized, evicted)
// on one byte budget, the scorer SnapKV from a registry spec, the per-token
// quantizer Q (ggml, fp8, int4) from a quantization spec through
// visit_quant_spec (its keys half: role=keys). One sequence per call;
// queries float32, keys float32 / float16 / bfloat16 read in place.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <optional>
#include <string>
#include <variant>

#include "common.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/quantization/mixed_precision.hpp"
#include "kvpolicy/policy/quantization/quant_spec.hpp"

namespace kvpy {

namespace {

using kvpolicy::DType;
using Cpu = kvpolicy::backend::Cpu;
using Ctx = kvpolicy::Context<Cpu>;
using MP = std::variant<kvpolicy::MixedPrecision<kvpolicy::SnapKV, kvpolicy::GgmlQuant>,
                        kvpolicy::MixedPrecision<kvpolicy::SnapKV, kvpolicy::Fp8Quant>,
                        kvpolicy::MixedPrecision<kvpolicy::SnapKV, kvpolicy::Int4Quant>>;

class MixedPrecisionPolicy {
 public:
  MixedPrecisionPolicy(const std::string& scorer_spec, const std::string& quant_spec, double ratio, double bytes, double full_share) {
    kvpolicy::SnapKV snap;
    check(kvpolicy::make_policy(scorer_spec, &snap));
    const kvpolicy::MixedPrecisionParams p{ratio, bytes, full_share};
    check(kvpolicy::visit_quant_spec(quant_spec, [&](auto k, auto) -> kvpolicy::Status {
      using Q = decltype(k);
      if constexpr (std::is_same_v<Q, kvpolicy::KiviQuant>) {
        return KVP_INVALID("mixed_precision: quantization spec '%s' is kivi, which is not a per-token format; use ggml, fp8 or int4",
                           quant_spec.c_str());
      } else {
        mp_.emplace(std::in_place_type<kvpolicy::MixedPrecision<kvpolicy::SnapKV, Q>>, snap, k, p);
        return kvpolicy::Status::ok();
      }
    }));
    check(std::visit([](const auto& m) { return m.validate_params(); }, *mp_));
  }

  std::pair<std::int64_t, std::int64_t> split(std::int64_t T, std::int64_t head_dim, std::int64_t elem_bytes) const {
    if (T < 0 || head_dim < 1 || elem_bytes < 1) value_error("mixed_precision: split needs kv_len >= 0, head_dim >= 1, elem_bytes >= 1");
    const kvpolicy::MixedSplit s =
        std::visit([&](const auto& m) { return m.split(T, head_dim, static_cast<std::size_t>(elem_bytes)); }, *mp_);
    return {s.full, s.low};
  }

  double bytes_per_token(std::int64_t head_dim) const {
    return std::visit([&](const auto& m) { return static_cast<double>(m.quantizer().bytes_per_token(head_dim)); }, *mp_);
  }

  /// (keep indptr, keep indices, full flags) or, with scores_only, the scorer's (kv_heads, kv_len) scores.
  nb::object run(nb::handle queries, nb::handle keys, bool scores_only) const {
    const char* who = scores_only ? "MixedPrecision.scores" : "MixedPrecision.decide";
    clear_pointers();
    const ArrayArg Q = array_arg(who, "queries", queries, {3});
    const ArrayArg K = array_arg(who, "keys", keys, {3});
    if (Q.view.dtype != DType::kF32) type_error(std::string(who) + ": queries must be float32");
    const std::int64_t H = K.view.extents[0], T = K.view.extents[1], d = K.view.extents[2];
    nb::object result;
    check(kvpolicy::dispatch_dtype(K.view.dtype, "keys", [&](auto tag) -> kvpolicy::Status {
      using T_ = typename decltype(tag)::type;
      kvpolicy::ScoreInput<float, T_> in;
      KVP_RETURN_IF_ERROR((Q.view.template as<const float, 3>(&in.queries, "queries")));
      kvpolicy::TensorView<const T_, 3> k;
      KVP_RETURN_IF_ERROR((K.view.template as<const T_, 3>(&k, "keys")));
      record_pointer("keys", k.data());
      in.keys = kvpolicy::KVSource<T_>::from(k);
      return std::visit(
          [&](const auto& m) -> kvpolicy::Status {
            std::lock_guard<std::mutex> lk(exec_mutex());
            const kvpolicy::ExecContext ex = exec_context();
            const kvpolicy::ProblemShape shape{in.queries.extent(0), H, d, std::max<std::int64_t>(T, 1), in.queries.extent(1), 1};
            const kvpolicy::Requirements r = scores_only ? m.scorer().requirements(Ctx{{}, ex}, shape) : m.requirements(Ctx{{}, ex}, shape);
            KVP_RETURN_IF_ERROR(r.status);
            std::unique_ptr<std::byte[]> ws(new std::byte[r.workspace_bytes + 1]);
            const Ctx cx{kvpolicy::Workspace{ws.get(), r.workspace_bytes + 1}, ex};
            if (scores_only) {
              auto [s, sp] = new_array<float>({static_cast<std::size_t>(H), static_cast<std::size_t>(T)});
              kvpolicy::Status st;
              {
                nb::gil_scoped_release nogil;
                st = m.scorer().score(cx, in, kvpolicy::TensorView<float, 2>::contiguous(sp, {H, T}));
              }
              KVP_RETURN_IF_ERROR(st);
              result = nb::cast(s);
              return kvpolicy::Status::ok();
            }
            const kvpolicy::MixedSplit sp = m.split(T, d, sizeof(T_));
            const std::int64_t n = std::max<std::int64_t>(sp.full + sp.low, 0);
            auto [ip, ipp] = new_array<std::int32_t>({static_cast<std::size_t>(H + 1)});
            auto [ids, idp] = new_array<std::int32_t>({static_cast<std::size_t>(H * n)});
            auto [fl, flp] = new_array<std::uint8_t>({static_cast<std::size_t>(H * n)});
            kvpolicy::Status st;
            {
              nb::gil_scoped_release nogil;
              st = m.decide(cx, in, kvpolicy::KeepSet{ipp, idp, H, H * n}, std::span<std::uint8_t>(flp, static_cast<std::size_t>(H * n)));
            }
            KVP_RETURN_IF_ERROR(st);
            result = nb::make_tuple(ip, ids, fl);
            return kvpolicy::Status::ok();
          },
          *mp_);
    }));
    return result;
  }

 private:
  std::optional<MP> mp_;
};

}  // namespace

void bind_mixed(nb::module_& m) {
  nb::class_<MixedPrecisionPolicy>(m, "MixedPrecisionPolicy")
      .def(nb::init<const std::string&, const std::string&, double, double, double>(), nb::arg("scorer_spec"), nb::arg("quant_spec"),
           nb::arg("ratio"), nb::arg("bytes"), nb::arg("full_share"))
      .def("split", &MixedPrecisionPolicy::split, nb::arg("kv_len"), nb::arg("head_dim"), nb::arg("elem_bytes"))
      .def("bytes_per_token", &MixedPrecisionPolicy::bytes_per_token, nb::arg("head_dim"))
      .def("run", &MixedPrecisionPolicy::run, nb::arg("queries"), nb::arg("keys"), nb::arg("scores_only") = false);
}

}  // namespace kvpy
