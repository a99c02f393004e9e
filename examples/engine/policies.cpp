// SPDX-License-Identifier: Apache-2.0
// policies.hpp compiled once (kvp_engine_lib): the hook factories the project
// uses, on the float caches (the list is the header's extern declarations).
#include "policies.hpp"

namespace kvp_engine {

KVP_ENGINE_HOOKS_FOR(, ContiguousKVCache<float>)
KVP_ENGINE_HOOKS_FOR(, PagedKVCache<float>)
template Hooks<PagedKVCache<float>> quest_hooks<float, kvpolicy::backend::Cpu>(kvpolicy::Quest, kvpolicy::ExecContext);
KVP_ENGINE_QUANT_HOOKS_FOR(, kvpolicy::GgmlQuant)
KVP_ENGINE_QUANT_HOOKS_FOR(, kvpolicy::Fp8Quant)
KVP_ENGINE_QUANT_HOOKS_FOR(, kvpolicy::Int4Quant)
template Hooks<PagedKVCache<float>> quantize_hooks<PagedKVCache<float>, kvpolicy::GgmlQuant, kvpolicy::backend::Cpu>(
    kvpolicy::GgmlQuant, kvpolicy::GgmlQuant, kvpolicy::ExecContext, std::function<bool(int)>);
template Hooks<PagedKVCache<float>> quantize_hooks<PagedKVCache<float>, kvpolicy::Fp8Quant, kvpolicy::backend::Cpu>(
    kvpolicy::Fp8Quant, kvpolicy::Fp8Quant, kvpolicy::ExecContext, std::function<bool(int)>);
template Hooks<PagedKVCache<float>> quantize_hooks<PagedKVCache<float>, kvpolicy::Int4Quant, kvpolicy::backend::Cpu>(
    kvpolicy::Int4Quant, kvpolicy::Int4Quant, kvpolicy::ExecContext, std::function<bool(int)>);
KVP_ENGINE_KIVI_HOOKS_FOR(, ContiguousKVCache<float>)
KVP_ENGINE_KIVI_HOOKS_FOR(, PagedKVCache<float>)
KVP_ENGINE_MERGE_HOOKS_FOR(, kvpolicy::KvpressMerging)
KVP_ENGINE_MERGE_HOOKS_FOR(, kvpolicy::LookMPivot)
KVP_ENGINE_MERGE_HOOKS_FOR(, kvpolicy::D2O)
KVP_ENGINE_MERGE_HOOKS_FOR(, kvpolicy::NearestKeptMerge)
template Hooks<ContiguousKVCache<float>> merge_after<ContiguousKVCache<float>, kvpolicy::D2O, kvpolicy::backend::Cpu>(
    Hooks<ContiguousKVCache<float>>, kvpolicy::D2O, kvpolicy::ExecContext);
template Hooks<ContiguousKVCache<float>> merge_after<ContiguousKVCache<float>, kvpolicy::NearestKeptMerge, kvpolicy::backend::Cpu>(
    Hooks<ContiguousKVCache<float>>, kvpolicy::NearestKeptMerge, kvpolicy::ExecContext);

}  // namespace kvp_engine
