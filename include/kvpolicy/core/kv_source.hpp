// SPDX-License-Identifier: Apache-2.0
// `KVSource<T>`: the keys or the values of one sequence as policies read them —
// either a strided `(kv_heads, kv_len, head_dim)` tensor or one sequence of a
// paged cache. Both hand out `Rows<T>` per kv head, read in place. A paged
// source states which half of the pool it reads (`role`): `from_paged` reads
// the keys (`k_data`), `from_paged_values` the values (`v_data`).
#pragma once

#include <cstdint>

#include "kvpolicy/core/rows.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

/// Which half of a paged pool a `KVSource` reads.
enum class KVRole : std::uint8_t { kKeys, kValues };

template <class T>
struct KVSource {
  TensorView<const T, 3> dense{};               ///< (kv_heads, kv_len, head_dim); used when `paged` is null
  const PagedKVView<const T>* paged = nullptr;  ///< paged cache, sequence `seq`
  std::int32_t seq = 0;
  KVRole role = KVRole::kKeys;  ///< paged only: keys (k_data) or values (v_data)

  static KVSource from(TensorView<const T, 3> v) noexcept { return KVSource{v, nullptr, 0, KVRole::kKeys}; }
  /// The keys of sequence `seq` of a paged cache.
  static KVSource from_paged(const PagedKVView<const T>& p, std::int32_t seq) noexcept { return KVSource{{}, &p, seq, KVRole::kKeys}; }
  /// The values of sequence `seq` of a paged cache.
  static KVSource from_paged_values(const PagedKVView<const T>& p, std::int32_t seq) noexcept {
    return KVSource{{}, &p, seq, KVRole::kValues};
  }
  /// Shape only, no data: for policies that read the engine's probabilities
  /// (`ScoreInput::attention` / `column_sums`) and need only (kv heads, kv_len).
  static KVSource shape_only(std::int64_t kv_heads, std::int64_t kv_len, std::int64_t head_dim = 0) noexcept {
    return KVSource{TensorView<const T, 3>(nullptr, {kv_heads, kv_len, head_dim}, {kv_len * head_dim, head_dim, 1}), nullptr, 0,
                    KVRole::kKeys};
  }

  bool empty() const noexcept { return paged == nullptr && dense.data() == nullptr; }

  std::int64_t kv_heads() const noexcept { return paged ? paged->num_kv_heads : dense.extent(0); }
  std::int64_t kv_len() const noexcept { return paged ? paged->seq_len(seq) : dense.extent(1); }
  std::int64_t head_dim() const noexcept { return paged ? paged->head_dim : dense.extent(2); }
  Rows<T> rows(std::int64_t h) const noexcept {
    if (paged == nullptr) return Rows<T>::from_heads(dense, h);
    return role == KVRole::kValues ? Rows<T>::paged_values(*paged, seq, static_cast<std::int32_t>(h))
                                   : Rows<T>::paged_keys(*paged, seq, static_cast<std::int32_t>(h));
  }

  /// A paged source's pool and page table (`PagedKVView::validate`: the key
  /// pool, and the value pool for a values source), skipped when the view is
  /// `*last` (a batch usually shares one pool; `*last` is then updated).
  /// The page ids are range-checked on the host only: `on_device`, they are
  /// device memory. A host call refuses a pool tagged as a device's. Dense
  /// sources: nothing to check here.
  Status validate_pool(const char* who, const char* name, bool on_device, const PagedKVView<const T>** last = nullptr) const noexcept {
    if (paged == nullptr || (last != nullptr && paged == *last)) return Status::ok();
    KVP_RETURN_IF_ERROR(paged->validate(who, /*need_values=*/role == KVRole::kValues, /*check_ids=*/!on_device));
    if (!on_device) KVP_REQUIRE(paged->device.is_host(), "%s: paged %s live on a device; this entry point reads host memory", who, name);
    if (last != nullptr) *last = paged;
    return Status::ok();
  }

  /// Structure checks (the paged table itself is validated once per batch by the caller).
  /// `on_device`: the call runs on a device backend, which reads views tagged
  /// `DeviceType::kCUDA`. A paged pool on a device follows FlashInfer's split
  /// (as Quest's page tables do): the pools and `table.indices` are device
  /// memory, `table.indptr` and `table.last_page_len` host arrays, so the host
  /// knows every length and row offset without a synchronisation and never
  /// reads a page id.
  Status validate(const char* who, const char* name, bool on_device = false) const noexcept {
    if (paged != nullptr) {
      KVP_REQUIRE(seq >= 0 && seq < paged->table.batch, "%s: %s sequence %d out of range [0, %d)", who, name, seq, paged->table.batch);
      if (on_device)
        KVP_REQUIRE(!paged->device.is_host(),
                    "%s: %s is a paged pool in host memory; a device backend reads device memory (tag the view kCUDA)", who, name);
      return Status::ok();
    }
    KVP_RETURN_IF_ERROR(dense.check_basic(who, name));
    if (on_device) {
      KVP_REQUIRE(!dense.device().is_host(), "%s: %s is a host tensor; a device backend reads device memory (tag the view kCUDA)", who,
                  name);
    } else {
      KVP_REQUIRE(dense.device().is_host(), "%s: %s is a device tensor; this entry point reads host memory", who, name);
    }
    KVP_REQUIRE(dense.extent(2) == 0 || dense.stride(2) == 1 || dense.extent(2) == 1,
                "%s: %s has head_dim stride %lld, must be 1 (rows are read as contiguous vectors)", who, name,
                static_cast<long long>(dense.stride(2)));
    return Status::ok();
  }
};

KVP_NAMESPACE_END
