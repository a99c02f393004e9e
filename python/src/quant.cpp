// SPDX-License-Identifier: Apache-2.0
// Quantization: a K or V quantizer built from a spec (quant_spec.hpp's
// visit_quant_spec: ggml, fp8, int4, kivi), one-shot quantize / dequantize
// on arrays read in place, and KIVI's streaming cache whose state (codes,
// scales, fp16 residual) lives in numpy arrays the caller can read.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "common.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/policy/quantization/quant_spec.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"

namespace kvpy {

namespace {

using kvpolicy::DType;
using QuantVariant = std::variant<kvpolicy::GgmlQuant, kvpolicy::Fp8Quant, kvpolicy::Int4Quant, kvpolicy::KiviQuant>;
using Ctx = kvpolicy::Context<kvpolicy::backend::Cpu>;

constexpr std::int64_t kMaxHeadDim = 4096;

/// A new numpy array of `shape` with the DLPack dtype `dt` (elements of `elem` bytes), zero-filled.
std::pair<nb::ndarray<nb::numpy>, void*> new_raw(std::initializer_list<std::size_t> shape, nb::dlpack::dtype dt, std::size_t elem) {
  std::size_t n = 1;
  for (auto s : shape) n *= s;
  auto* data = new std::uint8_t[n * elem > 0 ? n * elem : 1]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<std::uint8_t*>(p); });
  return {nb::ndarray<nb::numpy>(data, shape.size(), shape.begin(), owner, nullptr, dt), data};
}

nb::dlpack::dtype float_dtype(int bits) {
  nb::dlpack::dtype d;
  d.code = static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float);
  d.bits = static_cast<std::uint8_t>(bits);
  d.lanes = 1;
  return d;
}

/// A (A, B, C) uint8 view of an array argument (codes / scales), writable or not.
kvpolicy::TensorView<std::uint8_t, 3> bytes_view(const ArrayArg& a, const char* who, const char* name) {
  if (a.view.dtype != DType::kU8) type_error(std::string(who) + ": " + name + " must be uint8");
  kvpolicy::TensorView<std::uint8_t, 3> v;
  kvpolicy::AnyTensorView w = a.view;
  w.read_only = false;  // the library's QuantizedKV is non-const; read-only arguments are only read
  check(w.as<std::uint8_t, 3>(&v, name));
  return v;
}

class Quantizer {
 public:
  /// role: "keys" / "values" picks that half of visit_quant_spec's pair ("K_SPEC|V_SPEC" allowed, role set by the
  /// library); no role: the spec as written (one spec, its own `role` parameter where the format has one).
  Quantizer(const std::string& spec, std::optional<std::string> role) : spec_(spec) {
    if (role && *role != "keys" && *role != "values") value_error("Quantizer: role is '" + *role + "', must be 'keys' or 'values'");
    if (!role && spec.find('|') != std::string::npos)
      value_error("Quantizer: spec '" + spec + "' gives K and V specs; pass role='keys' or role='values' (or use make_quantizers)");
    check(kvpolicy::visit_quant_spec(spec, [&](auto k, auto v) -> kvpolicy::Status {
      if (!role) {
        decltype(k) raw;
        KVP_RETURN_IF_ERROR(kvpolicy::make_policy(spec, &raw));
        KVP_RETURN_IF_ERROR(raw.validate_params());
        q_ = raw;
      } else {
        if (*role == "keys") {
          KVP_RETURN_IF_ERROR(k.validate_params());
          q_ = k;
        } else {
          KVP_RETURN_IF_ERROR(v.validate_params());
          q_ = v;
        }
      }
      return kvpolicy::Status::ok();
    }));
  }

  const std::string& spec() const { return spec_; }
  std::string format() const {
    return std::visit([](const auto& q) { return std::string(std::decay_t<decltype(q)>::kName); }, q_);
  }
  std::optional<std::string> role() const {
    return std::visit(
        [](const auto& q) -> std::optional<std::string> {
          if constexpr (requires { q.params().role; })
            return q.params().role == kvpolicy::QuantRole::kKeys ? "keys" : "values";
          else
            return std::nullopt;
        },
        q_);
  }
  std::string layout_name() const {
    return std::visit([](const auto& q) { return std::string(q.layout().name); }, q_);
  }
  int bits() const {
    return std::visit([](const auto& q) { return static_cast<int>(q.layout().bits); }, q_);
  }
  bool is_kivi() const { return std::holds_alternative<kvpolicy::KiviQuant>(q_); }
  const kvpolicy::KiviQuant& kivi() const { return std::get<kvpolicy::KiviQuant>(q_); }

  double bytes_per_token(std::int64_t d) const {
    check_dim(d);
    return std::visit([&](const auto& q) { return q.bytes_per_token(d); }, q_);
  }
  std::int64_t codes_row_bytes(std::int64_t d) const {
    check_dim(d);
    return std::visit(
        [&](const auto& q) -> std::int64_t {
          if constexpr (requires { q.codes_row_bytes(d); })
            return q.codes_row_bytes(d);
          else
            return q.row_bytes(d);
        },
        q_);
  }
  std::int64_t scales_row_bytes(std::int64_t d) const {
    check_dim(d);
    return is_kivi() ? kivi().scales_row_bytes(d) : 0;
  }
  std::int64_t code_rows(std::int64_t tokens) const {
    if (tokens < 0) value_error("Quantizer.code_rows: tokens is " + std::to_string(tokens) + ", must be >= 0");
    return is_kivi() ? kivi().code_rows(tokens) : tokens;
  }

  /// One shot: rows (kv_heads, T, head_dim) -> codes (kv_heads, code_rows(T), codes_row_bytes) [, scales].
  nb::object quantize(nb::handle rows, nb::handle out, nb::handle out_scales, nb::handle head_scales) const {
    const char* who = "Quantizer.quantize";
    clear_pointers();
    const ArrayArg R = array_arg(who, "rows", rows, {3});
    const std::int64_t H = R.view.extents[0], T = R.view.extents[1], d = R.view.extents[2];
    check_dim(d);
    // Shape checks the library makes are repeated by it; these only size the arrays made here.
    const std::int64_t cb = codes_row_bytes_checked(d), sb = is_kivi() ? kivi().scales_row_bytes(d) : 0;
    const std::int64_t rows_out = is_kivi() ? kivi().code_rows(T) : T;
    nb::object codes_obj, scales_obj;
    ArrayArg C, S;
    if (out.is_valid() && !out.is_none()) {
      C = array_arg(who, "out", out, {3}, true, false);
      codes_obj = nb::borrow(out);
    } else {
      auto [arr, p] = new_raw({static_cast<std::size_t>(H), static_cast<std::size_t>(rows_out), static_cast<std::size_t>(cb)},
                              nb::dtype<std::uint8_t>(), 1);
      codes_obj = nb::cast(arr);
      C = array_arg(who, "out", codes_obj, {3}, true, false);
    }
    if (is_kivi()) {
      if (out_scales.is_valid() && !out_scales.is_none()) {
        S = array_arg(who, "out_scales", out_scales, {3}, true, false);
        scales_obj = nb::borrow(out_scales);
      } else {
        auto [arr, p] = new_raw({static_cast<std::size_t>(H), static_cast<std::size_t>(rows_out), static_cast<std::size_t>(sb)},
                                nb::dtype<std::uint8_t>(), 1);
        scales_obj = nb::cast(arr);
        S = array_arg(who, "out_scales", scales_obj, {3}, true, false);
      }
    } else if (out_scales.is_valid() && !out_scales.is_none()) {
      value_error(std::string(who) + ": out_scales is for kivi (the " + format() + " format keeps its scales in the codes)");
    }
    kvpolicy::QuantizedKV q;
    q.layout = std::visit([](const auto& p) { return p.layout(); }, q_);
    q.codes = bytes_view(C, who, "out");
    if (S.present()) q.scales = bytes_view(S, who, "out_scales");
    q.tokens = 0;
    std::vector<float> hs = fp8_head_scales(head_scales, who);
    check(kvpolicy::dispatch_dtype(R.view.dtype, "rows", [&](auto tag) -> kvpolicy::Status {
      using T_ = typename decltype(tag)::type;
      kvpolicy::TensorView<const T_, 3> x;
      KVP_RETURN_IF_ERROR((R.view.template as<const T_, 3>(&x, "rows")));
      std::lock_guard<std::mutex> lk(exec_mutex());
      const Ctx ctx{{}, exec_context()};
      nb::gil_scoped_release nogil;
      return std::visit(
          [&](const auto& p) -> kvpolicy::Status {
            using P = std::decay_t<decltype(p)>;
            typename P::State st{};
            if constexpr (std::is_same_v<P, kvpolicy::Fp8Quant>) st.head_scales = std::span<const float>(hs.data(), hs.size());
            return p.quantize(ctx, x, st, q);
          },
          q_);
    }));
    if (is_kivi()) return nb::make_tuple(codes_obj, scales_obj);
    return codes_obj;
  }

  /// Tokens [0, tokens) of codes back to (kv_heads, tokens, head_dim).
  nb::object dequantize(nb::handle codes, nb::handle scales, std::optional<std::int64_t> tokens, std::optional<std::int64_t> head_dim,
                        nb::handle dtype, nb::handle out, nb::handle head_scales) const {
    const char* who = "Quantizer.dequantize";
    clear_pointers();
    const ArrayArg C = array_arg(who, "codes", codes, {3}, false, false);
    const ArrayArg S = array_arg(who, "scales", scales, {3}, false, false, true);
    if (is_kivi() && !S.present()) type_error(std::string(who) + ": kivi needs scales (the second array quantize returned)");
    if (!is_kivi() && S.present()) value_error(std::string(who) + ": scales is for kivi (the " + format() + " format has none apart)");
    const std::int64_t H = C.view.extents[0];
    const ArrayArg O0 = array_arg(who, "out", out, {3}, true, true, true);
    std::int64_t d = 0;
    if (head_dim) {
      d = *head_dim;
    } else if (O0.present()) {
      d = O0.view.extents[2];
    } else {
      d = infer_head_dim(C.view.extents[2], who);
    }
    check_dim(d);
    std::int64_t T = 0;
    if (tokens) {
      T = *tokens;
    } else if (O0.present()) {
      T = O0.view.extents[1];
    } else {
      T = is_kivi() && kivi().params().role == kvpolicy::QuantRole::kKeys ? C.view.extents[1] * kivi().params().group : C.view.extents[1];
    }
    if (T < 0) value_error(std::string(who) + ": tokens is " + std::to_string(T) + ", must be >= 0");
    nb::object out_obj;
    ArrayArg O = O0;
    if (O.present()) {
      out_obj = nb::borrow(out);
    } else {
      const std::string dt = dtype_name_of(dtype);
      if (dt != "float32" && dt != "float16")
        value_error(std::string(who) + ": dtype is " + dt +
                    "; new outputs are float32 or float16 (pass out= for bfloat16, e.g. a torch tensor)");
      const int bits = dt == "float32" ? 32 : 16;
      auto [arr, p] =
          new_raw({static_cast<std::size_t>(H), static_cast<std::size_t>(T), static_cast<std::size_t>(d)}, float_dtype(bits), bits / 8);
      out_obj = nb::cast(arr);
      O = array_arg(who, "out", out_obj, {3}, true);
    }
    kvpolicy::QuantizedKV q;
    q.layout = std::visit([](const auto& p) { return p.layout(); }, q_);
    q.codes = bytes_view(C, who, "codes");
    if (S.present()) q.scales = bytes_view(S, who, "scales");
    q.tokens = T;
    std::vector<float> hs = fp8_head_scales(head_scales, who);
    check(kvpolicy::dispatch_dtype(O.view.dtype, "out", [&](auto tag) -> kvpolicy::Status {
      using T_ = typename decltype(tag)::type;
      kvpolicy::TensorView<T_, 3> y;
      KVP_RETURN_IF_ERROR((O.view.template as<T_, 3>(&y, "out")));
      std::lock_guard<std::mutex> lk(exec_mutex());
      const Ctx ctx{{}, exec_context()};
      nb::gil_scoped_release nogil;
      return std::visit(
          [&](const auto& p) -> kvpolicy::Status {
            using P = std::decay_t<decltype(p)>;
            if constexpr (std::is_same_v<P, kvpolicy::Fp8Quant>) {
              kvpolicy::Fp8QuantState st;
              st.head_scales = std::span<const float>(hs.data(), hs.size());
              return p.dequantize(ctx, q, y, st);
            } else {
              return p.dequantize(ctx, q, y);
            }
          },
          q_);
    }));
    return out_obj;
  }

  const QuantVariant& variant() const { return q_; }

 private:
  void check_dim(std::int64_t d) const {
    if (d < 1 || d > kMaxHeadDim) value_error("Quantizer: head_dim is " + std::to_string(d) + ", must be in [1, 4096]");
  }
  std::int64_t codes_row_bytes_checked(std::int64_t d) const {
    // The format's own head_dim rule, so that no array is sized from an invalid head_dim.
    check(std::visit(
        [&](const auto& q) -> kvpolicy::Status {
          using P = std::decay_t<decltype(q)>;
          if constexpr (requires { q.check_head_dim(d); })
            return q.check_head_dim(d);
          else if constexpr (std::is_same_v<P, kvpolicy::GgmlQuant>)
            return d % kvpolicy::kGgmlBlock == 0 ? kvpolicy::Status::ok()
                                                 : KVP_INVALID("ggml: head_dim %lld is not a multiple of the %s block (32 values)",
                                                               static_cast<long long>(d), q.layout().name);
          else
            return kvpolicy::Status::ok();
        },
        q_));
    return codes_row_bytes(d);
  }
  /// The smallest valid head_dim whose codes rows have `bytes` bytes.
  std::int64_t infer_head_dim(std::int64_t bytes, const char* who) const {
    for (std::int64_t d = 1; d <= kMaxHeadDim; ++d) {
      const bool valid = std::visit(
          [&](const auto& q) {
            using P = std::decay_t<decltype(q)>;
            if constexpr (requires { q.check_head_dim(d); })
              return q.check_head_dim(d).is_ok();
            else if constexpr (std::is_same_v<P, kvpolicy::GgmlQuant>)
              return d % kvpolicy::kGgmlBlock == 0;
            else
              return true;
          },
          q_);
      if (valid && codes_row_bytes(d) == bytes) return d;
    }
    value_error(std::string(who) + ": no head_dim gives " + std::to_string(bytes) + "-byte codes rows in the " + layout_name() +
                " format; pass head_dim=");
  }
  std::vector<float> fp8_head_scales(nb::handle head_scales, const char* who) const {
    std::vector<float> out;
    if (!head_scales.is_valid() || head_scales.is_none()) return out;
    if (!std::holds_alternative<kvpolicy::Fp8Quant>(q_)) value_error(std::string(who) + ": head_scales is for fp8 with scales=per_head");
    const ArrayArg A = array_arg(who, "head_scales", head_scales, {1});
    if (A.view.dtype != DType::kF32) type_error(std::string(who) + ": head_scales must be float32");
    const auto* p = static_cast<const float*>(A.view.data);
    for (std::int64_t i = 0; i < A.view.extents[0]; ++i) out.push_back(p[i * A.view.strides[0]]);
    return out;
  }
  static std::string dtype_name_of(nb::handle dtype) {
    if (dtype.is_none()) return "float32";
    nb::object np = nb::module_::import_("numpy");
    try {
      return nb::cast<std::string>(np.attr("dtype")(dtype).attr("name"));
    } catch (const nb::python_error&) {
      return nb::cast<std::string>(nb::str(dtype));
    }
  }

  std::string spec_;
  QuantVariant q_;
};

/// KIVI's streaming cache of one layer and role: codes, scales and the fp16 residual owned here (numpy arrays).
class KiviCache {
 public:
  KiviCache(const Quantizer& qz, std::int64_t kv_heads, std::int64_t head_dim, std::int64_t capacity)
      : qz_(qz), H_(kv_heads), d_(head_dim) {
    if (!qz.is_kivi()) value_error("KiviCache: the quantizer's format is " + qz.format() + ", not kivi");
    const kvpolicy::KiviQuant& k = qz.kivi();
    if (kv_heads < 1 || capacity < 0)
      value_error("KiviCache: kv_heads is " + std::to_string(kv_heads) + " and capacity " + std::to_string(capacity) +
                  "; need kv_heads >= 1, capacity >= 0");
    if (head_dim < 1 || head_dim > kMaxHeadDim)
      value_error("KiviCache: head_dim is " + std::to_string(head_dim) + ", must be in [1, 4096]");
    check(k.check_head_dim(head_dim));
    const auto H = static_cast<std::size_t>(kv_heads);
    const auto rows = static_cast<std::size_t>(k.code_rows(capacity));
    const auto R = static_cast<std::size_t>(std::max<std::int64_t>(k.params().residual, 1));
    auto [c, cp] = new_raw({H, rows, static_cast<std::size_t>(k.codes_row_bytes(head_dim))}, nb::dtype<std::uint8_t>(), 1);
    auto [s, sp] = new_raw({H, rows, static_cast<std::size_t>(k.scales_row_bytes(head_dim))}, nb::dtype<std::uint8_t>(), 1);
    auto [r, rp] = new_raw({H, R, static_cast<std::size_t>(head_dim)}, float_dtype(16), 2);
    codes_ = nb::cast(c);
    scales_ = nb::cast(s);
    residual_ = nb::cast(r);
    q_.layout = k.layout();
    q_.codes = kvpolicy::TensorView<std::uint8_t, 3>::contiguous(static_cast<std::uint8_t*>(cp),
                                                                 {kv_heads, static_cast<std::int64_t>(rows), k.codes_row_bytes(head_dim)});
    q_.scales = kvpolicy::TensorView<std::uint8_t, 3>::contiguous(
        static_cast<std::uint8_t*>(sp), {kv_heads, static_cast<std::int64_t>(rows), k.scales_row_bytes(head_dim)});
    q_.tokens = 0;
    st_.residual = kvpolicy::TensorView<kvpolicy::half, 3>::contiguous(static_cast<kvpolicy::half*>(rp),
                                                                       {kv_heads, static_cast<std::int64_t>(R), head_dim});
    st_.residual_len = 0;
    capacity_ = capacity;
  }

  void append(nb::handle rows) {
    const char* who = "KiviCache.append";
    clear_pointers();
    const ArrayArg R = array_arg(who, "rows", rows, {3});
    check(kvpolicy::dispatch_dtype(R.view.dtype, "rows", [&](auto tag) -> kvpolicy::Status {
      using T_ = typename decltype(tag)::type;
      kvpolicy::TensorView<const T_, 3> x;
      KVP_RETURN_IF_ERROR((R.view.template as<const T_, 3>(&x, "rows")));
      KVP_REQUIRE(x.extent(0) == H_ && x.extent(2) == d_,
                  "KiviCache.append: rows is (%lld, %lld, %lld), the cache has %lld kv heads and head_dim %lld",
                  static_cast<long long>(x.extent(0)), static_cast<long long>(x.extent(1)), static_cast<long long>(x.extent(2)),
                  static_cast<long long>(H_), static_cast<long long>(d_));
      std::lock_guard<std::mutex> lk(exec_mutex());
      const Ctx ctx{{}, exec_context()};
      nb::gil_scoped_release nogil;
      return qz_.kivi().append(ctx, x, st_, q_);
    }));
  }

  /// The logical sequence (quantized tokens, then the residual) decoded, or the quantized tokens only.
  nb::object dequantize(nb::handle dtype, bool include_residual) const {
    nb::object dq = qz_.dequantize(codes_view(), scales_view(), q_.tokens, d_, dtype, nb::none(), nb::none());
    if (!include_residual || st_.residual_len == 0) return dq;
    nb::object np = nb::module_::import_("numpy");
    nb::object res = residual_view().attr("__getitem__")(
        nb::make_tuple(nb::slice(nb::none(), nb::none(), nb::none()), nb::slice(nb::int_(0), nb::int_(st_.residual_len), nb::none())));
    return np.attr("concatenate")(nb::make_tuple(dq, res.attr("astype")(dq.attr("dtype"))), nb::arg("axis") = 1);
  }

  void reset() {
    q_.tokens = 0;
    st_.residual_len = 0;
  }

  nb::object codes_view() const { return codes_; }
  nb::object scales_view() const { return scales_; }
  nb::object residual_view() const { return residual_; }
  std::int64_t tokens() const { return q_.tokens; }
  std::int64_t residual_len() const { return st_.residual_len; }
  std::int64_t length() const { return q_.tokens + st_.residual_len; }
  std::int64_t capacity() const { return capacity_; }
  std::int64_t kv_heads() const { return H_; }
  std::int64_t head_dim() const { return d_; }
  const Quantizer& quantizer() const { return qz_; }

 private:
  Quantizer qz_;
  std::int64_t H_ = 0, d_ = 0, capacity_ = 0;
  nb::object codes_, scales_, residual_;
  kvpolicy::QuantizedKV q_{};
  kvpolicy::KiviState st_{};
};

/// A uint8 code pool given as an array: (num_pages, page_size, kv_heads, row_bytes) NHD or (num_pages, kv_heads,
/// page_size, row_bytes) HND, any strides with contiguous rows.
struct CodePool {
  ArrayArg arr;
  kvpolicy::PageStrides strides{};
  std::int32_t num_pages = 0, page_size = 0, heads = 0, row_bytes = 0;
};

CodePool code_pool(const char* who, const char* name, nb::handle a, const std::string& layout, bool writable) {
  if (layout != "NHD" && layout != "HND") value_error(std::string(who) + ": layout is '" + layout + "', must be 'NHD' or 'HND'");
  CodePool c;
  c.arr = array_arg(who, name, a, {4}, writable, true);
  if (c.arr.view.dtype != DType::kU8) type_error(std::string(who) + ": " + name + " must be uint8 (code rows)");
  const bool nhd = layout == "NHD";
  const auto& e = c.arr.view.extents;
  const auto& st = c.arr.view.strides;
  for (int i = 0; i < 4; ++i)
    if (e[i] > INT32_MAX) value_error(std::string(who) + ": " + name + " has an extent above 2^31");
  c.num_pages = static_cast<std::int32_t>(e[0]);
  c.page_size = static_cast<std::int32_t>(nhd ? e[1] : e[2]);
  c.heads = static_cast<std::int32_t>(nhd ? e[2] : e[1]);
  c.row_bytes = static_cast<std::int32_t>(e[3]);
  c.strides = kvpolicy::PageStrides{st[0], nhd ? st[2] : st[1], nhd ? st[1] : st[2], 1};
  return c;
}

/// Both halves of a pool view over code pools `k` and `v` (v may be k's own array) and a page table.
template <class T>
kvpolicy::PagedKVView<T> pool_view(const CodePool& k, const CodePool& v, const kvpolicy::PageTable& table) {
  kvpolicy::PagedKVView<T> p;
  p.k_data = static_cast<T*>(k.arr.view.data);
  p.v_data = static_cast<T*>(v.arr.view.data);
  p.k_strides = k.strides;
  p.v_strides = v.strides;
  p.num_pages = k.num_pages;
  p.num_kv_heads = k.heads;
  p.page_size = k.page_size;
  p.head_dim = k.row_bytes;
  p.table = table;
  p.device = kvpolicy::kHost;
  return p;
}

void same_pool_shape(const char* who, const CodePool& k, const CodePool& v) {
  if (k.num_pages != v.num_pages || k.page_size != v.page_size || k.heads != v.heads || k.row_bytes != v.row_bytes)
    value_error(std::string(who) + ": k_pages and v_pages differ in (num_pages, page_size, kv_heads, row_bytes)");
}

/// The formats a paged pool holds (self-contained rows); KIVI is refused by name.
template <class F>
kvpolicy::Status with_row_format(const char* who, const Quantizer& q, F&& f) {
  return std::visit(
      [&](const auto& p) -> kvpolicy::Status {
        using P = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<P, kvpolicy::KiviQuant>)
          return KVP_INVALID("%s: kivi's rows are not self-contained (per-channel key groups); a paged pool holds ggml, fp8 or int4 rows",
                             who);
        else
          return f(p);
      },
      q.variant());
}

/// Quantize-on-append: rows (kv_heads, n, head_dim) of tokens [len - n, len) of sequence `seq` into `pages`.
void quantize_paged_append_py(const Quantizer& q, nb::handle pages, nb::handle indptr, nb::handle indices, nb::handle last_page_len,
                              std::int32_t seq, nb::handle rows, const std::string& layout) {
  const char* who = "quantize_paged_append";
  clear_pointers();
  const CodePool c = code_pool(who, "pages", pages, layout, true);
  const TableArgs t = table_args(who, indptr, indices, last_page_len);
  const ArrayArg R = array_arg(who, "rows", rows, {3});
  const auto pool = pool_view<std::uint8_t>(c, c, t.table);
  check(kvpolicy::dispatch_dtype(R.view.dtype, "rows", [&](auto tag) -> kvpolicy::Status {
    using T_ = typename decltype(tag)::type;
    kvpolicy::TensorView<const T_, 3> x;
    KVP_RETURN_IF_ERROR((R.view.template as<const T_, 3>(&x, "rows")));
    return with_row_format(who, q, [&](const auto& p) {
      nb::gil_scoped_release nogil;
      return kvpolicy::quantize_paged_append(Ctx{}, p, pool, seq, x, /*values=*/false);
    });
  }));
}

/// Quest's page metadata (meta: (num_pages, kv_heads, 2, head_dim) float32, e.g. QuestState.data) from the codes.
void quantized_page_meta_append_py(const Quantizer& q, nb::handle meta, nb::handle k_pages, nb::handle indptr, nb::handle indices,
                                   nb::handle last_page_len, std::int64_t head_dim, nb::handle append_len, const std::string& layout) {
  const char* who = "quantized_page_meta_append";
  clear_pointers();
  const CodePool c = code_pool(who, "k_pages", k_pages, layout, false);
  const TableArgs t = table_args(who, indptr, indices, last_page_len);
  const ArrayArg M = array_arg(who, "meta", meta, {4}, true, true);
  if (M.view.dtype != DType::kF32) type_error(std::string(who) + ": meta must be float32 (a QuestState of dtype float32)");
  const auto& e = M.view.extents;
  if (e[0] != c.num_pages || e[1] != c.heads || e[2] != 2 || e[3] != head_dim)
    value_error(std::string(who) + ": meta has shape (" + std::to_string(e[0]) + ", " + std::to_string(e[1]) + ", " + std::to_string(e[2]) +
                ", " + std::to_string(e[3]) + "), expected (num_pages=" + std::to_string(c.num_pages) +
                ", kv_heads=" + std::to_string(c.heads) + ", 2, head_dim=" + std::to_string(head_dim) + ")");
  const ArrayArg A = array_arg(who, "append_len", append_len, {1}, false, true, true);
  if (A.present() && (A.view.dtype != DType::kI32 || A.view.extents[0] != t.table.batch))
    value_error(std::string(who) + ": append_len must be int32 with one entry per sequence (" + std::to_string(t.table.batch) + ")");
  kvpolicy::PageMetaView<float> mv;
  mv.max_data = static_cast<float*>(M.view.data);
  mv.min_data = mv.max_data + M.view.strides[2];
  mv.page_stride = M.view.strides[0];
  mv.head_stride = M.view.strides[1];
  mv.num_pages = static_cast<std::int32_t>(e[0]);
  mv.num_kv_heads = static_cast<std::int32_t>(e[1]);
  mv.head_dim = static_cast<std::int32_t>(e[3]);
  mv.device = kvpolicy::kHost;
  const auto pool = pool_view<const std::uint8_t>(c, c, t.table);
  const auto* al = A.present() ? static_cast<const std::int32_t*>(A.view.data) : nullptr;
  std::lock_guard<std::mutex> lk(exec_mutex());
  const kvpolicy::ExecContext ex = exec_context();
  const std::size_t wsb =
      kvpolicy::quantized_paged_workspace(std::max(c.page_size, 1), std::max<std::int64_t>(head_dim, 1), 1, ex.workers());
  std::unique_ptr<std::byte[]> ws(new std::byte[wsb + 1]);
  check(with_row_format(who, q, [&](const auto& p) {
    nb::gil_scoped_release nogil;
    return kvpolicy::quantized_page_meta_append(Ctx{kvpolicy::Workspace{ws.get(), wsb + 1}, ex}, p, pool, head_dim, al, mv);
  }));
}

/// Decode attention of queries (batch, num_q_heads, head_dim) over each sequence's pages of a quantized pool:
/// (out (batch, num_q_heads, head_dim) float32, lse (batch, num_q_heads) float32).
nb::tuple quantized_paged_decode_attention_py(const Quantizer& qk, const Quantizer& qv, nb::handle k_pages, nb::handle v_pages,
                                              nb::handle indptr, nb::handle indices, nb::handle last_page_len, nb::handle queries,
                                              float scale, const std::string& layout, nb::handle out) {
  const char* who = "quantized_paged_decode_attention";
  clear_pointers();
  const CodePool kc = code_pool(who, "k_pages", k_pages, layout, false);
  const CodePool vc = code_pool(who, "v_pages", v_pages, layout, false);
  same_pool_shape(who, kc, vc);
  const TableArgs t = table_args(who, indptr, indices, last_page_len);
  const ArrayArg Q = array_arg(who, "queries", queries, {3});
  if (Q.view.dtype != DType::kF32) type_error(std::string(who) + ": queries must be float32");
  const std::int64_t B = Q.view.extents[0], Hq = Q.view.extents[1], d = Q.view.extents[2];
  if (B != t.table.batch)
    value_error(std::string(who) + ": queries has batch " + std::to_string(B) + ", the table " + std::to_string(t.table.batch));
  if (kc.heads < 1 || Hq % kc.heads != 0)
    value_error(std::string(who) + ": queries has " + std::to_string(Hq) + " heads, not a multiple of the pool's kv_heads " +
                std::to_string(kc.heads));
  const std::int64_t G = Hq / kc.heads;
  nb::object out_obj;
  float* o = nullptr;
  if (out.is_valid() && !out.is_none()) {
    const ArrayArg O = array_arg(who, "out", out, {3}, true, true);
    if (O.view.dtype != DType::kF32) type_error(std::string(who) + ": out must be float32");
    if (O.view.extents[0] != B || O.view.extents[1] != Hq || O.view.extents[2] != d || O.view.strides[1] != d ||
        O.view.strides[0] != Hq * d)
      value_error(std::string(who) + ": out must be a contiguous float32 (batch, num_q_heads, head_dim) array like queries");
    o = static_cast<float*>(O.view.data);
    out_obj = nb::borrow(out);
  }
  auto [tmp_arr, tmp] = new_array<float>({static_cast<std::size_t>(B), static_cast<std::size_t>(Hq), static_cast<std::size_t>(d)});
  auto [lse_arr, lse] = new_array<float>({static_cast<std::size_t>(B), static_cast<std::size_t>(Hq)});
  const auto pool = pool_view<const std::uint8_t>(kc, vc, t.table);
  const std::vector<float> qbuf = [&] {  // (B, Hq, d) contiguous copy of the queries (any strides)
    std::vector<float> v(static_cast<std::size_t>(B * Hq * d));
    const auto* src = static_cast<const float*>(Q.view.data);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t c = 0; c < d; ++c)
          v[static_cast<std::size_t>((b * Hq + h) * d + c)] = src[b * Q.view.strides[0] + h * Q.view.strides[1] + c];
    return v;
  }();
  const float sc = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(std::max<std::int64_t>(d, 1)));
  const std::size_t wsb =
      kvpolicy::quantized_paged_attention_workspace<kvpolicy::backend::Cpu>(std::max(kc.page_size, 1), std::max<std::int64_t>(d, 1), G);
  std::unique_ptr<std::byte[]> ws(new std::byte[wsb + 1]);
  check(with_row_format(who, qk, [&](const auto& pk) {
    return with_row_format(who, qv, [&](const auto& pv) -> kvpolicy::Status {
      nb::gil_scoped_release nogil;
      for (std::int64_t b = 0; b < B; ++b) {
        const std::int32_t* pages = t.table.indices + t.table.indptr[b];
        const std::int64_t n = pool.seq_len(static_cast<std::int32_t>(b));
        for (std::int32_t h = 0; h < kc.heads; ++h) {
          const std::int64_t row = b * Hq + h * G;
          KVP_RETURN_IF_ERROR(kvpolicy::quantized_paged_decode_attention(Ctx{kvpolicy::Workspace{ws.get(), wsb + 1}}, pk, pv, pool, h,
                                                                         pages, n, qbuf.data() + row * d, G, d, sc, tmp + row * d,
                                                                         lse + row));
        }
      }
      return kvpolicy::Status::ok();
    });
  }));
  if (o != nullptr) {
    std::copy(tmp, tmp + B * Hq * d, o);
    return nb::make_tuple(out_obj, lse_arr);
  }
  return nb::make_tuple(tmp_arr, lse_arr);
}

}  // namespace

void bind_quant(nb::module_& m) {
  nb::class_<Quantizer>(m, "Quantizer",
                        "A K or V cache quantizer built from a quantization spec (formats ggml, fp8, int4, kivi; e.g. "
                        "'ggml:type=q4_0', 'fp8:format=e4m3,scales=per_token_head', 'int4:rotation=none', "
                        "'kivi:role=values,bits=2,group=32,residual=128'). role='keys' / 'values' takes that half of a "
                        "'K_SPEC|V_SPEC' spec with the role the library assigns; no role: the spec as written.")
      .def(nb::init<const std::string&, std::optional<std::string>>(), nb::arg("spec"), nb::arg("role").none() = nb::none())
      .def_prop_ro("spec", &Quantizer::spec)
      .def("__repr__",
           [](const Quantizer& q) {
             const auto r = q.role();
             return "Quantizer('" + q.spec() + "'" + (r ? ", role='" + *r + "'" : std::string()) + ")";
           })
      .def_prop_ro("format", &Quantizer::format, "ggml, fp8, int4 or kivi")
      .def_prop_ro("role", &Quantizer::role, "keys or values for formats with a role (ggml, int4, kivi), else None")
      .def_prop_ro("layout", &Quantizer::layout_name, "the code layout's name (q4_0, e4m3, int4_token, kivi_k2, ...)")
      .def_prop_ro("bits", &Quantizer::bits, "code bits per value")
      .def("bytes_per_token", &Quantizer::bytes_per_token, nb::arg("head_dim"),
           "Bytes one token costs per kv head, scales included (KIVI: without the residual window).")
      .def("row_bytes", &Quantizer::codes_row_bytes, nb::arg("head_dim"),
           "Bytes of one codes row: one (kv head, token) row; KIVI keys: one group of `group` tokens; KIVI values: one token's codes.")
      .def("codes_row_bytes", &Quantizer::codes_row_bytes, nb::arg("head_dim"), "Same as row_bytes.")
      .def("scales_row_bytes", &Quantizer::scales_row_bytes, nb::arg("head_dim"),
           "Bytes of one scales row (KIVI's separate scales; 0 for the formats that keep scales in the codes).")
      .def("code_rows", &Quantizer::code_rows, nb::arg("tokens"), "Codes rows `tokens` tokens take (KIVI keys: groups; else tokens).")
      .def("quantize", &Quantizer::quantize, nb::arg("rows"), nb::arg("out").none() = nb::none(), nb::arg("out_scales").none() = nb::none(),
           nb::arg("head_scales").none() = nb::none(),
           "rows (kv_heads, T, head_dim) float32 / float16 / bfloat16, read in place -> codes uint8 (kv_heads, code_rows(T), "
           "row_bytes(head_dim)); KIVI: (codes, scales). out= / out_scales=: caller-owned uint8 arrays (kv_heads, >= rows, "
           "bytes) written in place and returned. head_scales: fp8 scales=per_head, float32 (kv_heads,). Nothing is written on error.")
      .def("dequantize", &Quantizer::dequantize, nb::arg("codes"), nb::arg("scales").none() = nb::none(),
           nb::arg("tokens").none() = nb::none(), nb::arg("head_dim").none() = nb::none(), nb::arg("dtype").none() = nb::none(),
           nb::arg("out").none() = nb::none(), nb::arg("head_scales").none() = nb::none(),
           "codes (kv_heads, >= rows, row_bytes) [+ scales for KIVI] -> (kv_heads, tokens, head_dim) float32 (dtype='float16' "
           "for float16) or into out= (any float dtype, torch bfloat16 included). tokens defaults to the codes' rows (KIVI "
           "keys: rows * group), head_dim to the one the row bytes imply.");

  nb::class_<KiviCache>(m, "KiviCache",
                        "KIVI's streaming K or V cache of one layer: codes and scales (uint8) and the fp16 residual window, "
                        "numpy arrays owned by this object, filled by append() with the library's residual rule.")
      .def(nb::init<const Quantizer&, std::int64_t, std::int64_t, std::int64_t>(), nb::arg("quantizer"), nb::arg("kv_heads"),
           nb::arg("head_dim"), nb::arg("capacity"))
      .def(
          "__init__",
          [](KiviCache* self, const std::string& spec, std::int64_t kv_heads, std::int64_t head_dim, std::int64_t capacity,
             std::optional<std::string> role) { new (self) KiviCache(Quantizer(spec, role), kv_heads, head_dim, capacity); },
          nb::arg("spec"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("capacity"), nb::arg("role").none() = nb::none(),
          "From a kivi spec ('kivi:role=values,bits=2') and optionally role='keys' / 'values'.")
      .def("append", &KiviCache::append, nb::arg("rows"),
           "rows (kv_heads, n, head_dim) join the residual; keys: whole blocks of `residual` tokens are quantized when "
           "reached; values: every token but the last `residual`. Nothing is written on error.")
      .def("dequantize", &KiviCache::dequantize, nb::arg("dtype").none() = nb::none(), nb::arg("include_residual") = true,
           "(kv_heads, tokens [+ residual_len], head_dim): the quantized tokens decoded, then the residual rows.")
      .def("reset", &KiviCache::reset, "New sequence: tokens and residual_len back to 0.")
      .def("__repr__",
           [](const KiviCache& c) {
             return "KiviCache('" + c.quantizer().spec() + "', tokens=" + std::to_string(c.tokens()) +
                    ", residual_len=" + std::to_string(c.residual_len()) + ", capacity=" + std::to_string(c.capacity()) + ")";
           })
      .def_prop_ro("codes", &KiviCache::codes_view, "(kv_heads, code_rows(capacity), codes_row_bytes) uint8")
      .def_prop_ro("scales", &KiviCache::scales_view, "(kv_heads, code_rows(capacity), scales_row_bytes) uint8")
      .def_prop_ro("residual", &KiviCache::residual_view, "(kv_heads, max(residual, 1), head_dim) float16; rows [0, residual_len) in use")
      .def_prop_ro("tokens", &KiviCache::tokens, "quantized tokens held")
      .def_prop_ro("residual_len", &KiviCache::residual_len, "tokens in the full-precision residual")
      .def_prop_ro("length", &KiviCache::length, "tokens + residual_len")
      .def_prop_ro("capacity", &KiviCache::capacity)
      .def_prop_ro("kv_heads", &KiviCache::kv_heads)
      .def_prop_ro("head_dim", &KiviCache::head_dim)
      .def_prop_ro("quantizer", &KiviCache::quantizer);
  m.def("quantize_paged_append", &quantize_paged_append_py, nb::arg("quantizer"), nb::arg("pages").none(), nb::arg("indptr").none(),
        nb::arg("indices").none(), nb::arg("last_page_len").none(), nb::arg("seq"), nb::arg("rows").none(), nb::arg("layout") = "NHD",
        "Quantize-on-append: rows (kv_heads, n, head_dim) (float32 / float16 / bfloat16) are tokens [len - n, len) of sequence seq "
        "(len from the page table) and are written in the quantizer's format at their slots of `pages`, a uint8 code pool "
        "(num_pages, page_size, kv_heads, row_bytes) NHD or (num_pages, kv_heads, page_size, row_bytes) HND, in place. "
        "Nothing is written on error.");
  m.def("quantized_page_meta_append", &quantized_page_meta_append_py, nb::arg("quantizer"), nb::arg("meta").none(),
        nb::arg("k_pages").none(), nb::arg("indptr").none(), nb::arg("indices").none(), nb::arg("last_page_len").none(),
        nb::arg("head_dim"), nb::arg("append_len").none() = nb::none(), nb::arg("layout") = "NHD",
        "Quest's page metadata meta (num_pages, kv_heads, 2, head_dim) float32 (QuestState.data) updated in place from the "
        "decoded keys of the code pool k_pages: equal to Quest.on_append on the decoded pool.");
  m.def("quantized_paged_decode_attention", &quantized_paged_decode_attention_py, nb::arg("key_quantizer"), nb::arg("value_quantizer"),
        nb::arg("k_pages").none(), nb::arg("v_pages").none(), nb::arg("indptr").none(), nb::arg("indices").none(),
        nb::arg("last_page_len").none(), nb::arg("queries").none(), nb::arg("scale") = 0.0f, nb::arg("layout") = "NHD",
        nb::arg("out").none() = nb::none(),
        "Exact softmax decode attention of queries (batch, num_q_heads, head_dim) float32 over every sequence's tokens of a "
        "quantized pool (keys decoded by key_quantizer, values by value_quantizer, a page at a time): (out (batch, num_q_heads, "
        "head_dim), lse (batch, num_q_heads)) float32. scale 0: 1/sqrt(head_dim).");
}

}  // namespace kvpy
