// SPDX-License-Identifier: Apache-2.0
// Tensor-parallel head shards from Python: `HeadShard(kv_head_offset,
// num_kv_heads, num_q_heads, comm)` where `comm` is any object with `rank`,
// `world_size`, `all_reduce_sum(int64 array)` (sum over the ranks, in place)
// and `all_gather(bytes) -> bytes` (every rank's bytes in rank order), e.g.
// `kvpolicy.distributed.TorchCollective` over a torch.distributed group. The
// library calls them from its own thread with the GIL re-acquired; an
// exception becomes the call's error on this rank (RuntimeError).
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>

#include "common.hpp"
#include "kvpolicy/core/collective.hpp"

namespace kvpy {

namespace {

class PyCollective {
 public:
  explicit PyCollective(nb::object obj) : obj_(std::move(obj)) {
    const int rank = nb::cast<int>(obj_.attr("rank")), world = nb::cast<int>(obj_.attr("world_size"));
    c_ = kvpolicy::Collective{rank, world, this, &all_reduce_sum, &all_gather};
    check(c_.validate("HeadShard"));
  }
  const kvpolicy::Collective& collective() const { return c_; }
  nb::object object() const { return obj_; }

 private:
  static kvpolicy::Status raised(const char* op, const char* what) noexcept {
    return kvpolicy::Status::error(kvpolicy::StatusCode::kCollectiveError, "collective.%s raised: %s", op, what);
  }
  /// "collective.op raised: TypeName: message" (the exception itself, not its traceback).
  static kvpolicy::Status raised(const char* op, nb::python_error& e) noexcept {
    try {
      const std::string type = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
      const std::string text = nb::cast<std::string>(nb::str(e.value()));
      return raised(op, (type + ": " + text).c_str());
    } catch (...) {
      return raised(op, "an exception");
    }
  }
  static kvpolicy::Status all_reduce_sum(void* impl, std::int64_t* data, std::size_t n) noexcept {
    auto* self = static_cast<PyCollective*>(impl);
    nb::gil_scoped_acquire gil;
    try {
      const std::size_t shape[1] = {n};
      nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>> view(data, 1, shape, nb::handle());  // the library's buffer, in place
      self->obj_.attr("all_reduce_sum")(nb::cast(view, nb::rv_policy::reference));           // no copy: the sums land in place
      return kvpolicy::Status::ok();
    } catch (nb::python_error& e) {
      return raised("all_reduce_sum", e);
    } catch (const std::exception& e) {
      return raised("all_reduce_sum", e.what());
    }
  }
  static kvpolicy::Status all_gather(void* impl, const void* send, std::size_t bytes, void* recv) noexcept {
    auto* self = static_cast<PyCollective*>(impl);
    nb::gil_scoped_acquire gil;
    try {
      const nb::object r = self->obj_.attr("all_gather")(nb::bytes(static_cast<const char*>(send), bytes));
      const nb::bytes out = nb::cast<nb::bytes>(r);
      const std::size_t want = bytes * static_cast<std::size_t>(self->c_.world_size);
      if (out.size() != want)
        return kvpolicy::Status::error(kvpolicy::StatusCode::kCollectiveError,
                                       "collective.all_gather returned %zu bytes, expected world_size x %zu = %zu", out.size(), bytes,
                                       want);
      std::memcpy(recv, out.c_str(), want);
      return kvpolicy::Status::ok();
    } catch (nb::python_error& e) {
      return raised("all_gather", e);
    } catch (const std::exception& e) {
      return raised("all_gather", e.what());
    }
  }

  nb::object obj_;
  kvpolicy::Collective c_{};
};

struct PyHeadShard {
  std::unique_ptr<PyCollective> comm;
  kvpolicy::HeadShard shard{};
  PyHeadShard(std::int64_t offset, std::int64_t kv, std::int64_t q, nb::object c) : comm(std::make_unique<PyCollective>(std::move(c))) {
    if (kv < 1 || q < kv || q % kv != 0)
      value_error("HeadShard: num_q_heads=" + std::to_string(q) + ", num_kv_heads=" + std::to_string(kv) +
                  "; query heads must be a positive multiple of kv heads");
    if (offset < 0 || offset >= kv)
      value_error("HeadShard: kv_head_offset=" + std::to_string(offset) + " is outside [0, num_kv_heads=" + std::to_string(kv) + ")");
    shard = kvpolicy::HeadShard{offset, kv, q, &comm->collective()};
  }
};

}  // namespace

const kvpolicy::HeadShard* head_shard(nb::handle obj) {
  if (!obj.is_valid() || obj.is_none()) return nullptr;
  if (!nb::isinstance<PyHeadShard>(obj)) type_error("shard must be a kvpolicy.HeadShard or None");
  return &nb::cast<PyHeadShard&>(obj).shard;
}

void bind_distributed(nb::module_& m) {
  nb::class_<PyHeadShard>(m, "HeadShard",
                          "This rank's part of a layer's heads under tensor parallelism: kv heads [kv_head_offset, kv_head_offset + "
                          "local kv heads) of num_kv_heads, each with its whole GQA group, and the collective that reaches the other "
                          "ranks (rank, world_size, all_reduce_sum(int64 array) in place, all_gather(bytes) -> bytes in rank order).")
      .def(nb::init<std::int64_t, std::int64_t, std::int64_t, nb::object>(), nb::arg("kv_head_offset"), nb::arg("num_kv_heads"),
           nb::arg("num_q_heads"), nb::arg("comm"))
      .def_prop_ro("kv_head_offset", [](const PyHeadShard& s) { return s.shard.kv_head_offset; })
      .def_prop_ro("num_kv_heads", [](const PyHeadShard& s) { return s.shard.num_kv_heads; })
      .def_prop_ro("num_q_heads", [](const PyHeadShard& s) { return s.shard.num_q_heads; })
      .def_prop_ro("comm", [](const PyHeadShard& s) { return s.comm->object(); });
}

}  // namespace kvpy
