// SPDX-License-Identifier: Apache-2.0
// kvpolicy._core: the module, array conversion, the registry listing and the
// thread pool. The policy entry points are in eviction.cpp, apply.cpp, state.cpp.
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <map>
#include <memory>
#include <thread>

#include "common.hpp"
#include "kvpolicy/core/version.hpp"
#include "kvpolicy/registry.hpp"
#include "kvpolicy/util/thread_pool.hpp"

namespace kvpy {

bool to_dtype(nb::dlpack::dtype dt, kvpolicy::DType* out) {
  using C = nb::dlpack::dtype_code;
  if (dt.lanes != 1) return false;
  if (dt.code == static_cast<std::uint8_t>(C::Float) && dt.bits == 32) return *out = kvpolicy::DType::kF32, true;
  if (dt.code == static_cast<std::uint8_t>(C::Float) && dt.bits == 16) return *out = kvpolicy::DType::kF16, true;
  if (dt.code == static_cast<std::uint8_t>(C::Bfloat) && dt.bits == 16) return *out = kvpolicy::DType::kBF16, true;
  if (dt.code == static_cast<std::uint8_t>(C::Int) && dt.bits == 32) return *out = kvpolicy::DType::kI32, true;
  if (dt.code == static_cast<std::uint8_t>(C::Int) && dt.bits == 64) return *out = kvpolicy::DType::kI64, true;
  if (dt.code == static_cast<std::uint8_t>(C::UInt) && dt.bits == 8) return *out = kvpolicy::DType::kU8, true;
  return false;
}

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  using C = nb::dlpack::dtype_code;
  const char* base = dt.code == static_cast<std::uint8_t>(C::Float)     ? "float"
                     : dt.code == static_cast<std::uint8_t>(C::Bfloat)  ? "bfloat"
                     : dt.code == static_cast<std::uint8_t>(C::Int)     ? "int"
                     : dt.code == static_cast<std::uint8_t>(C::UInt)    ? "uint"
                     : dt.code == static_cast<std::uint8_t>(C::Bool)    ? "bool"
                     : dt.code == static_cast<std::uint8_t>(C::Complex) ? "complex"
                                                                        : "code";
  return std::string(base) + std::to_string(dt.bits);
}

namespace {

std::string ranks_text(std::initializer_list<int> ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : " or ") + std::to_string(r);
  return s;
}

}  // namespace

ArrayArg array_arg(const char* who, const char* name, nb::handle obj, std::initializer_list<int> ranks, bool writable, bool last_contiguous,
                   bool optional) {
  ArrayArg out;
  if (!obj.is_valid() || obj.is_none()) {
    if (optional) return out;
    type_error(std::string(who) + ": " + name + " is None; expected an array (numpy array or torch tensor) of rank " + ranks_text(ranks));
  }
  auto fill = [&](const auto& a) {
    if (a.device_type() != nb::device::cpu::value)
      value_error(std::string(who) + ": " + name + " is on device type " + std::to_string(a.device_type()) +
                  "; this build of kvpolicy reads host (CPU) memory only");
    kvpolicy::DType dt{};
    if (!to_dtype(a.dtype(), &dt))
      type_error(std::string(who) + ": " + name + " has dtype " + dlpack_dtype_name(a.dtype()) +
                 "; supported: float32, float16, bfloat16 (int32 for ids and positions)");
    const int rank = static_cast<int>(a.ndim());
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end())
      value_error(std::string(who) + ": " + name + " has rank " + std::to_string(rank) + ", expected rank " + ranks_text(ranks));
    if (rank > kvpolicy::AnyTensorView::kMaxRank) value_error(std::string(who) + ": " + name + " has too many axes");
    out.view.data = const_cast<void*>(static_cast<const void*>(a.data()));
    out.view.dtype = dt;
    out.view.device = kvpolicy::kHost;
    out.view.rank = rank;
    out.view.read_only = !writable;
    for (int i = 0; i < rank; ++i) {
      out.view.extents[i] = static_cast<std::int64_t>(a.shape(i));
      out.view.strides[i] = a.stride(i);
    }
  };
  bool ok = false;
  if (writable) {
    MArray m;
    ok = nb::try_cast<MArray>(obj, m, false);
    if (ok) fill(m);
  } else {
    Array r;
    ok = nb::try_cast<Array>(obj, r, false);
    if (ok) fill(r);
  }
  if (!ok) {
    const std::string tname = nb::type_name(obj.type()).c_str();
    type_error(std::string(who) + ": " + name + " must be " + (writable ? "a writable " : "a ") +
               "numpy array or torch tensor (any object with __dlpack__ or the buffer protocol), got " + tname);
  }
  const int rank = out.view.rank;
  if (last_contiguous && rank > 0 && out.view.extents[rank - 1] > 1 && out.view.strides[rank - 1] != 1)
    value_error(std::string(who) + ": " + name + " has stride " + std::to_string(out.view.strides[rank - 1]) +
                " on its last axis; rows must be contiguous (stride 1), e.g. pass .contiguous() / np.ascontiguousarray");
  out.owner = nb::borrow(obj);
  record_pointer(name, out.view.data);
  return out;
}

kvpolicy::AnyTensorView batch_slice(const kvpolicy::AnyTensorView& v, std::int64_t b) {
  kvpolicy::AnyTensorView s = v;
  s.rank = v.rank - 1;
  for (int i = 0; i + 1 < v.rank; ++i) {
    s.extents[i] = v.extents[i + 1];
    s.strides[i] = v.strides[i + 1];
  }
  std::size_t elem = v.dtype == kvpolicy::DType::kF32 || v.dtype == kvpolicy::DType::kI32 ? 4
                     : v.dtype == kvpolicy::DType::kI64                                   ? 8
                     : v.dtype == kvpolicy::DType::kU8                                    ? 1
                                                                                          : 2;
  s.data = static_cast<char*>(v.data) + b * v.strides[0] * static_cast<std::int64_t>(elem);
  return s;
}

namespace {

struct Pool {
  std::mutex mu;  // one call at a time uses the pool
  std::unique_ptr<kvpolicy::ThreadPool> pool;
  int threads = 0;
};

Pool& pool() {
  static Pool p;
  return p;
}

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void set_num_threads(int n) {
  if (n < 1) value_error("set_num_threads: n is " + std::to_string(n) + ", must be >= 1");
  Pool& p = pool();
  std::lock_guard<std::mutex> lk(p.mu);
  if (p.threads == n && p.pool) return;
  p.pool = std::make_unique<kvpolicy::ThreadPool>(n);
  p.threads = n;
}

int get_num_threads() {
  Pool& p = pool();
  return p.threads > 0 ? p.threads : default_threads();
}

thread_local std::map<std::string, std::uintptr_t> tl_pointers;

}  // namespace

kvpolicy::ExecContext exec_context() {
  Pool& p = pool();
  if (!p.pool) {
    p.threads = default_threads();
    p.pool = std::make_unique<kvpolicy::ThreadPool>(p.threads);
  }
  return p.pool->context();
}

std::mutex& exec_mutex() { return pool().mu; }

void record_pointer(const char* name, const void* p) { tl_pointers[name] = reinterpret_cast<std::uintptr_t>(p); }
void clear_pointers() { tl_pointers.clear(); }

}  // namespace kvpy

NB_MODULE(_core, m) {
  using namespace kvpy;
  m.doc() = "kvpolicy's C++ policies on numpy arrays and torch tensors (zero-copy views); see the kvpolicy package";
  m.attr("__version__") =
      std::to_string(KVP_VERSION_MAJOR) + "." + std::to_string(KVP_VERSION_MINOR) + "." + std::to_string(KVP_VERSION_PATCH);
  m.attr("isa") = nb::str(kvpolicy::backend::Cpu::isa_name());

  m.def(
      "registry",
      []() {
        nb::list out;
        for (const auto& p : kvpolicy::registry()) {
          nb::dict d;
          d["name"] = std::string(p.name);
          d["family"] = std::string(p.family);
          d["paper"] = std::string(p.paper);
          d["erased"] = p.erased;
          nb::list params;
          for (const auto& a : p.params) params.append(nb::make_tuple(a.name, a.value, a.doc));
          d["params"] = params;
          out.append(d);
        }
        return out;
      },
      "Every built-in policy of every family: dicts with name, family, paper, erased (one-shot eviction built from a "
      "spec) and params, a list of (key, default in spec syntax, doc).");
  m.def("set_num_threads", &set_num_threads, nb::arg("n"), "Workers of the pool every policy call runs on (the caller included).");
  m.def("get_num_threads", &get_num_threads, "Workers of the pool every policy call runs on.");
  m.def(
      "_last_view_pointers", []() { return tl_pointers; },
      "Debug: the data pointer of every view the last call on this thread built, by argument name (tests prove zero-copy with it).");
  m.def(
      "_view_pointer",
      [](nb::handle a) {
        clear_pointers();
        ArrayArg x = array_arg("_view_pointer", "a", a, {1, 2, 3, 4, 5}, false, false);
        return reinterpret_cast<std::uintptr_t>(x.view.data);
      },
      nb::arg("a"), "Debug: the data pointer of the view the library builds on `a` (no copy is ever made).");

  bind_eviction(m);
  bind_apply(m);
  bind_state(m);
  bind_quant(m);
  bind_selection(m);
  bind_merge(m);
  bind_mixed(m);
  bind_distributed(m);
  bind_prefetch(m);
}
